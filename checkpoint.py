"""
Checkpoints, the one place that resolves `init_from` for train.py, sample.py and hellaswag.py, and the
persistent compilation cache their processes share.

On disk (orbax CheckpointManager): out_dir/ckpt/<iter>/{params, opt_state, meta}. `meta` is JSON:
iter_num, best_val_loss, model_args (GPTConfig), config (the training settings), loader (data position),
seed. Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-save
leaves the previous checkpoint loadable.
"""

import fcntl
import os
import socket
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from dataclasses import asdict, replace

import jax
from flax import nnx

import sharding as sharding_  # `sharding` is restore's argument
from configurator import InputNotFound, RunStopped, UsageError, stderr_into
from model import GPT, RUNTIME_FIELDS, GPTConfig, relayout_blocks

CKPT_SUBDIR = "ckpt"
LOCK_FILE = "run.lock"
META_KEYS = ("iter_num", "best_val_loss", "model_args", "config", "loader")


class CheckpointError(UsageError):
    pass


def ckpt_dir(out_dir):
    return os.path.join(os.path.abspath(out_dir), CKPT_SUBDIR)


def manager(out_dir, max_to_keep=3):
    import orbax.checkpoint as ocp  # here, not at the top: a process that loads HF weights never pays its import
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(ckpt_dir(out_dir), options=options)


def save(mngr, iter_num, params, opt_state, meta):
    """Write one checkpoint (async: the host goes on; `wait_saved(mngr)` before exit). A failure, now or in the
    background, stops the run with one line (see check_saved)."""
    import orbax.checkpoint as ocp

    with _save_errors(mngr):
        mngr.save(iter_num, force=True, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))


def check_saved(mngr):
    """Once the save in flight is done: its failure as one line (RunStopped). Waits for nothing."""
    if not mngr.is_saving_in_progress():
        wait_saved(mngr)


def wait_saved(mngr):
    with _save_errors(mngr):
        mngr.wait_until_finished()


@contextmanager
def _save_errors(mngr):
    try:
        yield
    except Exception as e:  # whatever the writer raised: ENOSPC, EDQUOT, a storage error
        intact = max(mngr.all_steps(), default=None)
        raise RunStopped(f"saving a checkpoint to {mngr.directory} failed ({_first_line(e)}); the run stopped. "
                         + (f"Checkpoint {intact} is intact: free space and resume from it" if intact is not None
                            else "No checkpoint was written")) from e


def _first_line(e):
    return (str(e).splitlines() or [type(e).__name__])[0].split(" See full")[0][:200]


def _reader(path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))


def all_steps(out_dir):
    """The saved steps in out_dir, oldest first; none is an error naming the fix."""
    path = ckpt_dir(out_dir)
    steps = []
    if os.path.isdir(path):
        with closing(_reader(path)) as mngr:
            steps = mngr.all_steps()
    if not steps:
        raise InputNotFound(f"no checkpoint in {path}: train first (python train.py ...) or check --out_dir")
    return sorted(steps)


def restore(out_dir, params=None, opt_state=None, sharding=None, step=None):
    """Read the latest (or `step`) checkpoint: {'meta': dict, 'params': ..., 'opt_state': ...}. `params`
    and `opt_state` are templates (abstract or concrete) of what to read; None skips that item. `sharding`:
    where the arrays go, whatever mesh saved them: one Sharding for all (default: the first device), or
    {'params': tree of shardings, 'opt_state': tree of shardings}. Each process reads only its shards."""
    steps = all_steps(out_dir)
    step = steps[-1] if step is None else step
    if step not in steps:
        raise CheckpointError(f"no checkpoint of step {step} in {ckpt_dir(out_dir)}: it has steps "
                              f"{', '.join(map(str, steps))}")
    import orbax.checkpoint as ocp

    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    per_item = (lambda k: sharding) if isinstance(sharding, jax.sharding.Sharding) else sharding.__getitem__
    items = {"meta": ocp.args.JsonRestore()}
    if params is not None:
        items["params"] = ocp.args.StandardRestore(sharding_.abstract(params, per_item("params")))
    if opt_state is not None:
        items["opt_state"] = ocp.args.StandardRestore(sharding_.abstract(opt_state, per_item("opt_state")))
    # orbax reads the arrays concurrently and, at the first failure, closes its event loop with the other reads
    # (the same corruption) in flight: their errors, from Python and C++, reach stderr before and after ours.
    # So stderr (the file descriptor) goes to a file while it restores: replayed on success, dropped on failure
    with tempfile.TemporaryFile() as log:
        with stderr_into(log):
            try:
                with closing(_reader(ckpt_dir(out_dir))) as mngr:
                    restored = mngr.restore(step, args=ocp.args.Composite(**items))
                error = None
            except Exception as e:  # orbax raises many kinds; the user needs one line
                error = f"{type(e).__name__}: {_first_line(e)}"
                time.sleep(0.5)  # the reads still in flight finish, into the log
        if error is None and not set(META_KEYS) <= restored["meta"].keys():
            error = f"its meta lacks {', '.join(k for k in META_KEYS if k not in restored['meta'])}"
        if error is None:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace"))
            return {k: restored[k] for k in items}
    earlier = [s for s in steps if s < step]
    fallback = (f"move it away to resume from step {max(earlier)}" if earlier
                else "no earlier checkpoint to fall back on")
    raise CheckpointError(f"checkpoint {os.path.join(ckpt_dir(out_dir), str(step))} did not restore ({error}); "
                          f"{fallback}")


def lock_out_dir(out_dir):
    """This run's exclusive lock on out_dir, or one line naming the run that holds it. flock: the OS releases it
    when the process ends, however it ends, so a crashed run's lock file is stale and the next run takes it.
    Returns the open lock file: closing it releases the lock."""
    f = open(os.path.join(out_dir, LOCK_FILE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UsageError(f"{out_dir} is in use by another run ({holder}): wait for it to end, "
                         "or give this one another --out_dir") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def append_line(path, line):
    """One write() of the whole line, so that a crash leaves at most a partial last line, never two mixed."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"{path}: short write (disk full?)")
    finally:
        os.close(fd)


def drop_partial_line(path):
    """Cut a last line without its newline (a crash mid-write), which would otherwise sit mid-file once appended to."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def model_config_from_meta(meta, **settings):
    """The architecture from the checkpoint; the run's choices (model.RUNTIME_FIELDS: dtype, dropout, attention,
    remat, loss_chunk) from `settings` or GPTConfig's defaults, never the checkpoint's: a run saved with
    attention='cudnn' on a GPU must resume or sample on a CPU."""
    return GPTConfig(**{k: v for k, v in meta["model_args"].items() if k not in RUNTIME_FIELDS}, **settings)


def load_model(init_from, out_dir="out", dtype="float32", dropout=0.0, step=None):
    """A GPT for inference from `init_from`: 'resume' (the latest checkpoint in out_dir, or `step`), a GPT-2
    name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), an HF directory or a nanoGPT ckpt.pt (or its out_dir).
    Returns (model, training config dict: ours, nanoGPT's, or None for HF weights)."""
    if init_from == "scratch":
        raise UsageError("init_from='scratch' has no weights to load: use resume, a gpt2* name, an HF directory "
                         "or a nanoGPT ckpt.pt")
    if init_from != "resume":
        from weights import load_pretrained

        return load_pretrained(init_from, dropout=dropout, dtype=dtype)
    model, meta = load_checkpoint_model(out_dir, step, dtype, dropout)
    return model, meta["config"]


def load_checkpoint_model(out_dir, step=None, dtype="float32", dropout=0.0):
    """(GPT, meta) of our checkpoint in out_dir: the latest, or `step`."""
    step = all_steps(out_dir)[-1] if step is None else step
    meta = restore(out_dir, step=step)["meta"]
    model = nnx.eval_shape(lambda: GPT(model_config_from_meta(meta, dtype=dtype, dropout=dropout), nnx.Rngs(0)))
    params, _ = restore_state(out_dir, step, meta, model.config)
    nnx.update(model, params)
    return model, meta


def restore_state(out_dir, step, meta, config: GPTConfig, tx=None, mesh=None):
    """(params, optimizer state or None without `tx`) of checkpoint `step`, for a model of `config`: on `mesh`, each
    array split by sharding.PARAM_SPECS (default: the first device). Read in the layout the checkpoint was saved
    in, then converted to config's (scan_layers: the blocks stacked or not), so either resumes with the other."""
    def templates(config):
        params = nnx.state(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))
        return params, None if tx is None else jax.eval_shape(tx.init, params)

    def shardings(tree):
        return None if mesh is None or tree is None else sharding_.shardings_for(tree, mesh)

    saved = replace(config, scan_layers=meta["model_args"].get("scan_layers", False))
    params, opt_state = templates(saved)
    where = None if mesh is None else {"params": shardings(params), "opt_state": shardings(opt_state)}
    restored = restore(out_dir, params=params, opt_state=opt_state, sharding=where, step=step)
    state = (restored["params"], restored.get("opt_state"))
    if saved.scan_layers != config.scan_layers:
        target = templates(config)
        relayout = jax.jit(lambda state: relayout_blocks(state, target), out_shardings=shardings(target))
        state = relayout(state) if mesh is not None else relayout_blocks(state, target)
    return state


def use_compilation_cache():
    """JAX's persistent compilation cache, on by default, so that a second run of a command compiles nothing:
    in $JAX_COMPILATION_CACHE_DIR (JAX's own setting: set it to move the cache, set it empty to turn it off),
    else in nanogpt-jax/jax under the user's cache directory ($XDG_CACHE_HOME or ~/.cache). Call it before
    anything is compiled."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache, "nanogpt-jax", "jax"))
    # every compilation, not only those over 1 s (JAX's default): start-up is many small ones
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def meta_for(model_config: GPTConfig, config: dict, iter_num, best_val_loss, loader_state):
    return {"iter_num": iter_num, "best_val_loss": best_val_loss, "model_args": asdict(model_config),
            "config": config, "loader": loader_state, "seed": config.get("seed")}
