"""
Checkpoints, and the one place that resolves `init_from` for train.py, sample.py and hellaswag.py.

On disk (orbax CheckpointManager): out_dir/ckpt/<iter>/{params, opt_state, meta}. `meta` is JSON:
iter_num, best_val_loss, model_args (GPTConfig), config (the training settings), loader (data position),
seed. Orbax writes each step to a temporary directory and renames it when complete, so a crash mid-save
leaves the previous checkpoint loadable.
"""

import os
import sys
import tempfile
import time
from contextlib import closing, contextmanager
from dataclasses import asdict

import jax
import orbax.checkpoint as ocp
from flax import nnx

from model import GPT, RUNTIME_FIELDS, GPTConfig

CKPT_SUBDIR = "ckpt"


class CheckpointError(ValueError):
    pass


def ckpt_dir(out_dir):
    return os.path.join(os.path.abspath(out_dir), CKPT_SUBDIR)


def manager(out_dir, max_to_keep=3):
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(ckpt_dir(out_dir), options=options)


def save(mngr, iter_num, params, opt_state, meta):
    """Write one checkpoint (async: the host goes on; `mngr.wait_until_finished()` before exit)."""
    mngr.save(iter_num, force=True, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)))


def _reader(path):
    return ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(create=False))


def latest_step(out_dir):
    path = ckpt_dir(out_dir)
    steps = []
    if os.path.isdir(path):
        with closing(_reader(path)) as mngr:
            steps = mngr.all_steps()
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {path}: train first (python train.py ...) or check --out_dir")
    return max(steps)


def _abstract(tree, sharding):
    """ShapeDtypeStructs with the sharding to restore onto (replicated on the mesh, or one device)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def restore(out_dir, params=None, opt_state=None, sharding=None, step=None):
    """Read the latest (or `step`) checkpoint: {'meta': dict, 'params': ..., 'opt_state': ...}. `params`
    and `opt_state` are templates (abstract or concrete) of what to read; None skips that item."""
    step = latest_step(out_dir) if step is None else step
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    items = {"meta": ocp.args.JsonRestore()}
    if params is not None:
        items["params"] = ocp.args.StandardRestore(_abstract(params, sharding))
    if opt_state is not None:
        items["opt_state"] = ocp.args.StandardRestore(_abstract(opt_state, sharding))
    # orbax reads the arrays concurrently and, at the first failure, closes its event loop with the other reads
    # (the same corruption) in flight: their errors, from Python and C++, reach stderr before and after ours.
    # So stderr (the file descriptor) goes to a file while it restores: replayed on success, dropped on failure
    with tempfile.TemporaryFile() as log:
        with _stderr_into(log):
            try:
                with closing(_reader(ckpt_dir(out_dir))) as mngr:
                    restored = mngr.restore(step, args=ocp.args.Composite(**items))
                error = None
            except Exception as e:  # orbax raises many kinds; the user needs one line
                error = (str(e).splitlines() or [type(e).__name__])[0].split(" See full")[0][:200]
                time.sleep(0.5)  # the reads still in flight finish, into the log
        if error is None:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace"))
            return {k: restored[k] for k in items}
    raise CheckpointError(f"checkpoint {os.path.join(ckpt_dir(out_dir), str(step))} is corrupt or incomplete "
                          f"({error}); delete it to resume from an earlier one")


@contextmanager
def _stderr_into(file):
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def model_config_from_meta(meta, **settings):
    """The architecture from the checkpoint; the run's choices (model.RUNTIME_FIELDS: dtype, dropout, attention,
    remat, loss_chunk) from `settings` or GPTConfig's defaults, never the checkpoint's: a run saved with
    attention='cudnn' on a GPU must resume or sample on a CPU."""
    return GPTConfig(**{k: v for k, v in meta["model_args"].items() if k not in RUNTIME_FIELDS}, **settings)


def load_model(init_from, out_dir="out", dtype="float32", dropout=0.0):
    """A GPT for inference from `init_from`: 'resume' (the latest checkpoint in out_dir), a GPT-2 name
    (gpt2, gpt2-medium, gpt2-large, gpt2-xl) or an HF directory. Returns (model, training config dict from
    the checkpoint, or None for HF weights)."""
    if init_from == "scratch":
        raise ValueError("init_from='scratch' has no weights to load: use resume, a gpt2* name or an HF directory")
    if init_from != "resume":
        return GPT.from_pretrained(init_from, dropout=dropout, dtype=dtype), None
    meta = restore(out_dir)["meta"]
    model = nnx.eval_shape(lambda: GPT(model_config_from_meta(meta, dtype=dtype, dropout=dropout), nnx.Rngs(0)))
    params = restore(out_dir, params=nnx.state(model))["params"]
    nnx.update(model, params)
    return model, meta["config"]


def meta_for(model_config: GPTConfig, config: dict, iter_num, best_val_loss, loader_state):
    return {"iter_num": iter_num, "best_val_loss": best_val_loss, "model_args": asdict(model_config),
            "config": config, "loader": loader_state, "seed": config.get("seed")}
