"""
Checkpoints, the one place that resolves `init_from` for train.py, sample.py and hellaswag.py, and
the persistent compilation cache their processes share.

On disk (orbax CheckpointManager): out_dir/ckpt/<iter>/{params, opt_state, meta, metrics}. `meta` is
JSON: iter_num, best_val_loss, model_args (GPTConfig), config (the training settings, the seed among
them), loader (data position), and digests: a checksum of every array, which each restore verifies
(orbax keeps none of the data). `metrics`: the val loss of the eval at that step, if any, which
rotation keeps the best of (see manager). Orbax writes each step to a temporary directory and
renames it when complete, so a crash mid-save leaves the previous checkpoint loadable.
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
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import sharding as sharding_  # `sharding` is restore's argument
import storage
import tokenizer
from configurator import InputNotFound, RunStopped, UsageError, stderr_into
from layers import relayout_blocks
from model import GPT, RUNTIME_FIELDS, GPTConfig, load_pretrained

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

    meta = dict(meta, digests=digests({"params": params, "opt_state": opt_state}))
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
            error = next(
                (
                    f"{key} differs from the checksum saved with it: the checkpoint is corrupt"
                    if key in saved
                    else f"its meta has no checksum of {key}"
                    for key, digest in digests(arrays).items()
                    if saved.get(key) != digest
                ),
                None,
            )
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
    try:
        model_config_from_meta(meta)
    except ValueError as e:
        return f"its model_args are no model: {e}"
    return None


def _of_type(value, kind):
    """JSON's value of a GPTConfig field's type: an int is a float too, a bool is no int."""
    if kind is float:
        return type(value) in (int, float)
    return type(value) is kind


def digests(tree):
    """{path: 16 hex digits} of every array in `tree`, such as "params/h/0/attn/c_attn/kernel": a
    checksum of its bits as one global array, computed where it lives (one jit, on the shards), the
    same on any mesh and any number of processes. Two sums mod 2^32 over the array's bits as uint32
    x_i (narrower dtypes widened), i the flat index: sum(x_i * (2i + 1)), which any one flipped bit
    changes (2^k times an odd number is never 0 mod 2^32), and the sum of a murmur3 mix of x_i ^ (i
    * golden ratio), so that a random corruption of many bits goes unseen with odds of about
    2^-64."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        return {}
    # one program over all arrays. A jit per array compiles faster (a dozen shapes among GPT-2's 446
    # arrays), but puts hundreds of programs with collectives in flight at once, and two processes
    # on CPU hung in them
    arrays = [x for _, x in leaves]
    # (arrays, 2) uint32
    sums = np.asarray(_digest_sums(arrays, tuple(_whole_axes(x) for x in arrays)))
    return {
        jax.tree_util.keystr(path, simple=True, separator="/").removesuffix(
            "/value"
        ): f"{a:08x}{b:08x}"
        for (path, _), (a, b) in zip(leaves, sums.tolist())
    }


def _whole_axes(x):
    """The axes along which each device holds the whole array (summing along them moves no data)."""
    shape = np.shape(x)
    if not isinstance(getattr(x, "sharding", None), jax.sharding.Sharding):
        return tuple(range(len(shape)))
    return tuple(a for a, n in enumerate(x.sharding.shard_shape(shape)) if n == shape[a])


@partial(jax.jit, static_argnums=1)
def _digest_sums(arrays, whole_axes):
    return jnp.stack([_digest(x, axes) for x, axes in zip(arrays, whole_axes)])


def _digest(x, whole_axes):
    """(2,) uint32: the two sums of `x` (see digests)."""
    bits = _as_uint32(x)
    i = _flat_index(bits.shape)
    return jnp.stack(
        [
            _sum(bits * (2 * i + 1), whole_axes),
            _sum(_fmix32(bits ^ (i * jnp.uint32(0x9E3779B9))), whole_axes),
        ]
    )


def _as_uint32(x):
    """x's bits: bitcast to the unsigned int of its width, widened to uint32 (8-byte dtypes: two
    uint32 each)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize > 4:
        return lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape):
    """Each element's index in the flattened array, mod 2^32, without flattening it (a reshape of a
    sharded array can move data between devices)."""
    i, stride = jnp.uint32(0), 1
    for axis in reversed(range(len(shape))):
        i = i + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return i


def _fmix32(h):
    """murmur3's finalizer: every input bit flips each output bit with probability ~1/2."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _sum(v, whole_axes):
    """v's sum mod 2^32. XLA:CPU fuses no computation into a reduction: the values would be written
    out in full, then read. Halved first, along axes each device holds whole, the computation fuses
    into the halving, which writes an eighth of them for the reduction to read; 3 halvings at most,
    as XLA fuses it into 8 slices of it, not 16."""
    halvings = 0
    for axis in whole_axes:
        while v.shape[axis] % 2 == 0 and halvings < 3 and v.size > 1024:
            half = v.shape[axis] // 2
            v = lax.slice_in_dim(v, 0, half, axis=axis) + lax.slice_in_dim(
                v, half, 2 * half, axis=axis
            )
            halvings += 1
    return jnp.sum(v, dtype=jnp.uint32)


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
            lambda: GPT(model_config_from_meta(meta, dtype=dtype, dropout=dropout), nnx.Rngs(0))
        )
        params, _ = restore_state(out_dir, step, meta, model.config, mngr=reader)
    nnx.update(model, params)
    return model, meta


def restore_state(out_dir, step, meta, config: GPTConfig, tx=None, mesh=None, mngr=None):
    """(params, optimizer state or None without `tx`) of checkpoint `step`, for a model of `config`:
    on `mesh`, each array split by sharding.PARAM_SPECS (default: the first device). Read in the
    layout the checkpoint was saved in, then converted to config's (scan_layers: the blocks stacked
    or not), so either resumes with the other."""

    def templates(config):
        params = nnx.state(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))
        return params, None if tx is None else jax.eval_shape(tx.init, params)

    def shardings(tree):
        return None if mesh is None or tree is None else sharding_.shardings_for(tree, mesh)

    saved = replace(config, scan_layers=meta["model_args"].get("scan_layers", False))
    params, opt_state = templates(saved)
    where = (
        None if mesh is None else {"params": shardings(params), "opt_state": shardings(opt_state)}
    )
    restored = restore(
        out_dir, params=params, opt_state=opt_state, sharding=where, step=step, mngr=mngr, meta=meta
    )
    state = (restored["params"], restored.get("opt_state"))
    if saved.scan_layers != config.scan_layers:
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
    a nanoGPT checkpoint's dataset's meta.pkl, or one beside an exported model
    (tokenizer.codec_for), else GPT-2's BPE; and our checkpoint's step (None for other formats)."""
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
    dataset = (train_config or {}).get("dataset")
    return model, tokenizer.codec_for(model.config.vocab_size, dataset=dataset, beside=beside), None


def load_bpe_model(init_from, out_dir, dtype, why):
    """(model, step) of load_with_codec for a task whose text is GPT-2's BPE (HellaSwag, lm-eval's):
    a character-level model is one line saying `why` it cannot be scored."""
    model, codec, step = load_with_codec(init_from, out_dir, dtype)
    if isinstance(codec, tokenizer.CharCodec):
        where = out_dir if init_from == "resume" else init_from
        raise UsageError(
            f"{where} is a character-level model (a vocabulary of {codec.n_vocab} characters): "
            f"{why}, give a GPT-2 model"
        )
    return model, step
