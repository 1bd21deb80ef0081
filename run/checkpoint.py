"""
Checkpoints, and the one place that resolves `init_from` for train.py, sample.py and hellaswag.py.

On disk (orbax CheckpointManager): out_dir/ckpt/<iter>/{params, opt_state, meta, metrics}. `meta` is
JSON: iter_num, best_val_loss, model_args (GPTConfig), config (the training settings, the seed among
them), loader (data position), and digests: a checksum of every array (dataio/checksums.py), which
each restore verifies (orbax keeps none of the data). `metrics`: the val loss of the eval at that
step, if any, which rotation keeps the best of (see manager). Orbax writes each step to a temporary
directory and renames it when complete, so a crash mid-save leaves the previous checkpoint loadable.
"""

import dataclasses
import logging
import math
import os
import sys
import tempfile
import time
from contextlib import closing, contextmanager, nullcontext
from dataclasses import asdict, replace

import jax
from flax import nnx

from archs.models import build, load_pretrained
from compute import sharding as sharding_  # `sharding` is restore's argument
from compute.layers import relayout_blocks
from configurator import InputNotFound, RunStopped, UsageError, stderr_into
from dataio import checksums, storage, tokenizer
from model import RUNTIME_FIELDS, GPTConfig

CKPT_SUBDIR = "ckpt"
META_KEYS = ("iter_num", "best_val_loss", "model_args", "config", "loader")
# model_args a restore needs
ARCHITECTURE = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias")


class CheckpointError(UsageError):
    pass


def ckpt_dir(out_dir):
    return storage.join(storage.absolute(out_dir), CKPT_SUBDIR)


def manager(out_dir, keep=3):
    """The run's writer. It keeps the latest `keep` checkpoints (the resume point among them) and
    the one of the best val loss, whatever rotation does: orbax's best_fn alone would keep the best
    `keep` instead, deleting the resume point once it is worse, and it keeps checkpoints saved
    without a val loss forever. best_fn is still set: orbax writes a save's metrics only then (and
    reads them back when a resumed run reopens the directory)."""
    # here, not at the top: a process that loads HF weights never pays its import
    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_managers as policies

    policy = policies.AnyPreservationPolicy(
        [
            policies.LatestN(n=keep),
            # reverse: sorted by descending val loss, and BestN keeps the last n
            policies.BestN(
                get_metric_fn=_val_loss, reverse=True, n=1, keep_checkpoints_without_metrics=False
            ),
        ]
    )
    options = ocp.CheckpointManagerOptions(
        create=True, preservation_policy=policy, best_fn=_val_loss, best_mode="min"
    )
    # orbax's warnings of what is normal here: a save without a val loss, a save that waited for the
    # one before
    logging.getLogger("absl").addFilter(_without_normal_warnings)
    if not getattr(sys.unraisablehook, "quiets_closed_loop", False):
        sys.unraisablehook = _quiet_closed_loop(sys.unraisablehook)
    return ocp.CheckpointManager(ckpt_dir(out_dir), options=options)


def _val_loss(metrics):
    v = metrics.get("val_loss")
    return v if type(v) in (int, float) and math.isfinite(v) else math.inf  # NaN is never the best


def _without_normal_warnings(record):
    return not any(
        note in record.getMessage()
        for note in ("did not provide metrics", "Waiting for previous save")
    )


def _quiet_closed_loop(hook):
    """sys.unraisablehook without orbax's noise of a failed save. At the first failed write (a full
    disk) orbax closes the event loop of the save; each write still in flight (one per array file)
    completes later in tensorstore's threads, whose callback into the closed loop raises
    RuntimeError('Event loop is closed'): an unraisable error, printed as a traceback by the default
    hook, dozens of them before our one line (check_saved)."""

    def quiet(unraisable):
        if not (
            isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
        ):
            hook(unraisable)

    quiet.quiets_closed_loop = True
    return quiet


def save(mngr, iter_num, params, opt_state, meta, val_loss=None):
    """Write one checkpoint (async: the host goes on; `wait_saved(mngr)` before exit), with the
    digests of its arrays in meta. `val_loss`: that of the eval of this step (None: saved without
    one), for rotation to keep the best. A failure, now or in the background, stops the run with one
    line (see check_saved)."""
    import orbax.checkpoint as ocp

    meta = dict(meta, digests=checksums.digests({"params": params, "opt_state": opt_state}))
    # the one before (orbax's save waits too): seen whole even on a store never idle at a check
    wait_saved(mngr)
    with _save_errors(mngr):
        _unconfirmed(mngr).add(iter_num)
        mngr.save(
            iter_num,
            force=True,
            metrics=None if val_loss is None else {"val_loss": float(val_loss)},
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )


def check_saved(mngr):
    """Once the save in flight is done: its failure as one line (RunStopped). Waits for nothing."""
    if not mngr.is_saving_in_progress():
        wait_saved(mngr)


def wait_saved(mngr):
    with _save_errors(mngr):
        mngr.wait_until_finished()
        _unconfirmed(mngr).clear()


def _unconfirmed(mngr):
    """Steps whose save started and was not yet seen to complete (orbax lists a step as soon as its
    save starts)."""
    return vars(mngr).setdefault("nanogpt_unconfirmed", set())


@contextmanager
def _save_errors(mngr):
    try:
        yield
    except Exception as e:  # whatever the writer raised: ENOSPC, EDQUOT, a storage error
        cause, fix = storage.write_failure(str(mngr.directory), e)
        intact = _intact(mngr, ask_storage=fix != "check the network")
        raise RunStopped(
            f"saving a checkpoint to {mngr.directory} failed ({_first_line(cause)}); the run "
            "stopped. "
            + (
                f"Checkpoint {intact} is intact: {fix} and resume from it"
                if intact is not None
                else "No checkpoint is left there"
            ),
            writers_left=True,
        ) from e


def _intact(mngr, ask_storage):
    """The newest step seen saved whole whose folder is still there (out_dir's target may have been
    deleted): orbax's record of the saves, less those not seen to complete, checked on the storage
    where it answers (`ask_storage` False: known not to, the record stands)."""
    for step in sorted(set(mngr.all_steps()) - _unconfirmed(mngr), reverse=True):
        if not ask_storage:
            return step
        try:
            if storage.isdir(storage.join(str(mngr.directory), str(step))):
                return step
        except Exception:  # noqa: BLE001 - a storage that cannot answer now (the network gone): the record stands
            return step
    return None


def _first_line(e):
    return (str(e).splitlines() or [type(e).__name__])[0].split(" See full")[0][:200]


def _reader(path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))


def _opened(out_dir, mngr):
    """The run's manager `mngr` (left open), or a reader of out_dir's checkpoints (closed after
    use)."""
    return nullcontext(mngr) if mngr is not None else closing(_reader(ckpt_dir(out_dir)))


def all_steps(out_dir, mngr=None):
    """The saved steps in out_dir (read through `mngr`, the run's manager, if given), oldest first;
    none is an error naming the fix."""
    path = ckpt_dir(out_dir)
    steps = []
    if mngr is not None or storage.isdir(path):
        with _opened(out_dir, mngr) as m:
            steps = m.all_steps()
    if not steps:
        raise InputNotFound(
            f"no checkpoint in {path}: train first (python train.py ...) or check --out_dir"
        )
    return sorted(steps)


def restore(out_dir, params=None, opt_state=None, sharding=None, step=None, mngr=None, meta=None):
    """Read the latest (or `step`) checkpoint: {'meta': dict, 'params': ..., 'opt_state': ...}.
    `params` and `opt_state` are templates (abstract or concrete) of what to read; None skips that
    item. `sharding`: where the arrays go, whatever mesh saved them: one Sharding for all (default:
    the first device), or {'params': tree of shardings, 'opt_state': tree of shardings}. Each
    process reads only its shards. `mngr`: the run's manager, read through instead of opening
    another; `meta`: the step's, already read."""
    steps = all_steps(out_dir, mngr)
    step = steps[-1] if step is None else step
    if step not in steps:
        raise CheckpointError(
            f"no checkpoint of step {step} in {ckpt_dir(out_dir)}: it has steps "
            f"{', '.join(map(str, steps))}"
        )
    import orbax.checkpoint as ocp

    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    per_item = (
        (lambda k: sharding)
        if isinstance(sharding, jax.sharding.Sharding)
        else sharding.__getitem__
    )
    items = {} if meta is not None else {"meta": ocp.args.JsonRestore()}
    if params is not None:
        items["params"] = ocp.args.StandardRestore(sharding_.abstract(params, per_item("params")))
    if opt_state is not None:
        items["opt_state"] = ocp.args.StandardRestore(
            sharding_.abstract(opt_state, per_item("opt_state"))
        )
    # orbax reads the arrays concurrently and, at the first failure, closes its event loop with the
    # other reads (the same corruption) in flight: their errors, from Python and C++, reach stderr
    # before and after ours. So stderr (the file descriptor) goes to a file while it restores:
    # replayed on success, dropped on failure
    with tempfile.TemporaryFile() as log:
        with stderr_into(log):
            try:
                with _opened(out_dir, mngr) as m:
                    restored = dict(m.restore(step, args=ocp.args.Composite(**items)))
                restored.setdefault("meta", meta)
                error = None
            except Exception as e:  # orbax raises many kinds; the user needs one line
                error = f"{type(e).__name__}: {_first_line(e)}"
                time.sleep(0.5)  # the reads still in flight finish, into the log
        if error is None:
            error = _meta_error(restored["meta"])
        arrays = {k: restored[k] for k in ("params", "opt_state") if k in items and error is None}
        saved = restored["meta"].get("digests") if error is None else None
        if arrays and saved is not None:  # the arrays as orbax returned them, before any relayout
            error = checksums.mismatch(arrays, saved)
        if error is None:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace"))
            if arrays and saved is None and jax.process_index() == 0:
                print(
                    f"checkpoint {storage.join(ckpt_dir(out_dir), str(step))} carries no checksums "
                    "(saved before they were kept): its arrays load unverified",
                    file=sys.stderr,
                )
            return {k: restored[k] for k in ("meta", *items)}
    earlier = [s for s in steps if s < step]
    fallback = (
        f"move it away to resume from step {max(earlier)}"
        if earlier
        else "no earlier checkpoint to fall back on"
    )
    raise CheckpointError(
        f"checkpoint {storage.join(ckpt_dir(out_dir), str(step))} did not restore ({error}); "
        f"{fallback}"
    )


def _meta_error(meta):
    """What makes a checkpoint's meta unusable, in a few words (a traceback in train, sample or
    export otherwise), or None."""
    if not isinstance(meta, dict):
        return "its meta is not a JSON object"
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        return f"its meta lacks {', '.join(missing)}"
    if type(meta["iter_num"]) is not int or meta["iter_num"] < 0:
        return f"its meta's iter_num is {meta['iter_num']!r}, not an integer >= 0"
    if not _of_type(meta["best_val_loss"], float):
        return f"its meta's best_val_loss is {meta['best_val_loss']!r}, not a number"
    for key in ("model_args", "config", "loader"):
        if not isinstance(meta[key], dict):
            return f"its meta's {key} is {type(meta[key]).__name__}, not a JSON object"
    if "digests" in meta and not (
        isinstance(meta["digests"], dict)
        and all(isinstance(v, str) for v in meta["digests"].values())
    ):
        return "its meta's digests are not a JSON object of strings"
    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig)}
    for key, value in meta["model_args"].items():
        if key not in fields:
            return f"its model_args has {key!r}, which is not a model.GPTConfig field"
        if not _of_type(value, fields[key]):
            return f"its model_args {key}={value!r} is not {fields[key].__name__}"
    lacking = [k for k in ARCHITECTURE if k not in meta["model_args"]]
    if lacking:
        return f"its model_args lack {', '.join(lacking)}"
    try:  # with the dtype its tables were saved in, which restore_state reads them as
        model_config_from_meta(meta, embed_dtype=meta["model_args"].get("embed_dtype", "float32"))
    except ValueError as e:
        return f"its model_args are no model: {e}"
    return None


def _of_type(value, kind):
    """JSON's value of a GPTConfig field's type: an int is a float too, a bool is no int."""
    if kind is float:
        return type(value) in (int, float)
    return type(value) is kind


def model_config_from_meta(meta, **settings):
    """The architecture from the checkpoint; the run's choices (model.RUNTIME_FIELDS: dtype,
    dropout, attention, remat, loss_chunk) from `settings` or GPTConfig's defaults, never the
    checkpoint's: a run saved with attention='cudnn' on a GPU must resume or sample on a CPU."""
    return GPTConfig(
        **{k: v for k, v in meta["model_args"].items() if k not in RUNTIME_FIELDS}, **settings
    )


def load_model(init_from, out_dir="out", dtype="float32", dropout=0.0):
    """A GPT for inference from `init_from`: 'resume' (the latest checkpoint in out_dir), a GPT-2
    name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), an HF directory, a nanoGPT ckpt.pt (or its
    out_dir) or a modded-nanogpt state_step*.pt (arch='speedrun'). Returns (model, training config
    dict: ours, nanoGPT's, or None for HF weights)."""
    if init_from == "scratch":
        raise UsageError(
            "init_from='scratch' has no weights to load: use resume, a gpt2* name, an HF "
            "directory, a nanoGPT ckpt.pt or a modded-nanogpt state_step*.pt"
        )
    if init_from != "resume":
        return load_pretrained(init_from, dropout=dropout, dtype=dtype)
    model, meta = load_checkpoint_model(out_dir, dtype=dtype, dropout=dropout)
    return model, meta["config"]


def load_checkpoint_model(out_dir, step=None, dtype="float32", dropout=0.0):
    """(GPT, meta) of our checkpoint in out_dir: the latest, or `step`."""
    if not storage.isdir(ckpt_dir(out_dir)):
        all_steps(out_dir)  # no checkpoint: one line naming the fix
    # one reader: the steps, the meta (once), the arrays
    with closing(_reader(ckpt_dir(out_dir))) as reader:
        step = all_steps(out_dir, reader)[-1] if step is None else step
        meta = restore(out_dir, step=step, mngr=reader)["meta"]
        model = nnx.eval_shape(
            lambda: build(model_config_from_meta(meta, dtype=dtype, dropout=dropout), nnx.Rngs(0))
        )
        params, _ = restore_state(out_dir, step, meta, model.config, mngr=reader)
    nnx.update(model, params)
    return model, meta


def restore_state(out_dir, step, meta, config: GPTConfig, tx=None, mesh=None, mngr=None):
    """(params, optimizer state or None without `tx`) of checkpoint `step`, for a model of `config`:
    on `mesh`, each array split by sharding.PARAM_SPECS (default: the first device). Read in the
    layout and dtypes the checkpoint was saved in, then converted to config's (scan_layers: the
    blocks stacked or not; embed_dtype), so either resumes with the other."""

    def templates(config):
        params = nnx.state(nnx.eval_shape(lambda: build(config, nnx.Rngs(0))))
        return params, None if tx is None else jax.eval_shape(tx.init, params)

    def shardings(tree):
        return None if mesh is None or tree is None else sharding_.shardings_for(tree, mesh)

    args = {"scan_layers": False, "embed_dtype": "float32", **meta["model_args"]}  # as saved
    saved = replace(config, scan_layers=args["scan_layers"], embed_dtype=args["embed_dtype"])
    params, opt_state = templates(saved)
    where = (
        None if mesh is None else {"params": shardings(params), "opt_state": shardings(opt_state)}
    )
    restored = restore(
        out_dir, params=params, opt_state=opt_state, sharding=where, step=step, mngr=mngr, meta=meta
    )
    state = (restored["params"], restored.get("opt_state"))
    if saved != config:
        target = templates(config)
        relayout = jax.jit(
            lambda state: relayout_blocks(state, target), out_shardings=shardings(target)
        )
        state = relayout(state) if mesh is not None else relayout_blocks(state, target)
    return state


def meta_for(model_config: GPTConfig, config: dict, iter_num, best_val_loss, loader_state):
    return {
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
        "model_args": asdict(model_config),
        "config": config,
        "loader": loader_state,
    }


def load_with_codec(init_from, out_dir, dtype):
    """(model, codec, step): the model; what decodes its ids: the vocabulary our checkpoint carries,
    a nanoGPT checkpoint's dataset's meta.pkl or one beside an exported model, a nanochat
    checkpoint's tokenizer/ (tokenizer.codec_for), else GPT-2's BPE; and our checkpoint's step
    (None for other formats)."""
    if init_from == "resume":
        model, meta = load_checkpoint_model(out_dir, dtype=dtype)
        codec = tokenizer.codec_for(
            model.config.vocab_size, meta.get("vocab"), meta["config"].get("dataset")
        )
        return model, codec, meta["iter_num"]
    model, train_config = load_model(init_from, dtype=dtype)
    beside = (
        init_from
        if os.path.isdir(init_from)
        else os.path.dirname(init_from)
        if os.path.isfile(init_from)
        else None
    )  # a hub name
    # a nanoGPT run's dataset (its meta.pkl), a nanochat checkpoint's vocab (its tokenizer/)
    vocab, dataset = ((train_config or {}).get(k) for k in ("vocab", "dataset"))
    codec = tokenizer.codec_for(model.config.vocab_size, vocab, dataset, beside)
    return model, codec, None


def load_bpe_model(init_from, out_dir, dtype, why):
    """(model, step) of load_with_codec for a task whose text is GPT-2's BPE (HellaSwag, lm-eval's):
    a character-level model is one line saying `why` it cannot be scored."""
    model, codec, step = load_with_codec(init_from, out_dir, dtype)
    refuse_char_level(codec, out_dir if init_from == "resume" else init_from, why)
    return model, step


def refuse_char_level(codec, where, why):
    """One line when `codec` is a character-level model's (`where`): `why` it cannot be scored."""
    if isinstance(codec, tokenizer.CharCodec):
        raise UsageError(
            f"{where} is a character-level model (a vocabulary of {codec.n_vocab} characters): "
            f"{why}, give a GPT-2 model"
        )
