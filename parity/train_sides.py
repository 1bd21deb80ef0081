"""
The two sides of training parity, for check_train and check_speedrun: train.py's optimizer, state
and jitted step on compute/sharding.py's mesh (JaxTrainer) beside parity/torch_reference.py's
TorchTrainer, each trained on the same batches from train.py's loader (make_batches, train_side).
Not a check to run: `python -m parity.check_train` runs them.
"""

import time
from typing import NamedTuple

from configurator import UsageError
from dataio.dataloader import make_loader

# jax, and our modules on it (model, sharding, train_step, weights), are imported where they are
# used: check_train's bad arguments fail before jax loads, in a fraction of a second (parse_args)


class Run(NamedTuple):
    """One check: train.py's settings `c` (optimizer, schedule, seed), the weights, the data, the
    batch layout."""

    c: dict
    model_dir: str  # an HF GPT-2 directory both sides load
    data_dir: str  # train.bin (or *train*.npy shards), read by train.py's loader
    steps: int
    rows: int  # sequences per step, over all micro-batches and devices
    seq_len: int
    accum: int  # micro-batches per step (torch: loss / accum, ours: lax.scan)
    devices: int  # our mesh's devices; torch computes the same global batch on one CPU
    fsdp: int = 1  # the mesh's fsdp axis (data = devices / (fsdp x tensor_parallel))
    tensor_parallel: int = 1


class JaxTrainer:
    """train.py's optimizer, state and jitted step, in `dtype`, on compute/sharding.py's mesh over
    run.devices: params and optimizer state from train_step.init_state (split by
    sharding.PARAM_SPECS), the batch's rows over data x fsdp."""

    def __init__(self, run, dtype):
        import jax

        from archs import models
        from compute import sharding
        from dataio.pretrained import read_pretrained
        from model import RUNTIME_FIELDS, GPTConfig
        from run import train_step

        c = dict(run.c, dtype=dtype)
        # a .pt of the record's: its heads
        config_args, state, _ = read_pretrained(run.model_dir, n_head=c["n_head"])
        config = GPTConfig(**config_args, **{k: c[k] for k in RUNTIME_FIELDS})
        mesh = sharding.make_mesh(run.fsdp, run.tensor_parallel, jax.devices()[: run.devices])
        sharding.check_model_fits_mesh(config, mesh)
        tx = train_step.make_optimizer(c)
        self.graphdef, params, opt_state = train_step.init_state(config, mesh, tx, weights=state)
        self.batch_sharding = sharding.batch_sharding(mesh)
        # record 20's windows and gradient, its sequences a step on each batch shard
        sequences = run.rows // (run.devices // run.tensor_parallel)
        step = train_step.make_train_step(
            self.graphdef, tx, c["grad_clip"], **models.arch_of(c["arch"]).step_inputs(c, sequences)
        )
        batch_shape = (run.accum, run.rows // run.accum, run.seq_len)  # (accum, B, T)
        self.train_step, _, _ = train_step.compile_step(
            step, params, opt_state, batch_shape, self.batch_sharding
        )
        self.defs = jax.tree.structure(params), jax.tree.structure(opt_state)
        # as train.py's loop holds them
        self.state = jax.tree.leaves(params), jax.tree.leaves(opt_state)
        self.c, self.base_key, self.iter_num = c, jax.random.key(c["seed"]), 0

    def step(self, x, y):
        import jax

        from run import train_step

        # the lr of this update: train_step.get_lr at the optimizer's own schedule count
        lr = float(
            train_step.get_lr(
                train_step.schedule_count(self.defs[1].unflatten(self.state[1])), self.c
            )
        )
        key = jax.random.fold_in(self.base_key, self.iter_num)  # as train.py (dropout is 0: unused)
        # one process: device_put is train.py's make_array_from_process_local_data
        x, y = jax.device_put(x, self.batch_sharding), jax.device_put(y, self.batch_sharding)
        *self.state, metrics = self.train_step(*self.state, x, y, key)
        self.iter_num += 1
        return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]), "lr": lr}

    def state_dict(self):
        from flax import nnx

        from dataio.weights import state_dict

        return state_dict(nnx.merge(self.graphdef, self.defs[0].unflatten(self.state[0])))


def make_trainers(run, dtype):
    """{side: constructor}: torch fp32 (the reference), ours in `dtype`, and torch autocast-bf16 for
    bf16."""
    from parity.torch_reference import TorchTrainer

    sides = {
        "torch": lambda: TorchTrainer(run.model_dir, run.c),
        "jax": lambda: JaxTrainer(run, dtype),
    }
    if dtype == "bfloat16":
        sides["torch_bf16"] = lambda: TorchTrainer(run.model_dir, run.c, autocast_bf16=True)
    return sides


def train_side(trainer, batches):
    """{"records": [{"loss", "grad_norm", "lr"}] per step, "initial"/"final": {HF name: array},
    "ms": per step}."""
    initial = trainer.state_dict()
    records = [trainer.step(*batches[0])]  # ours compiles here
    t0 = time.time()
    records += [trainer.step(x, y) for x, y in batches[1:]]
    ms = (time.time() - t0) / max(len(batches) - 1, 1) * 1000
    return {"records": records, "initial": initial, "final": trainer.state_dict(), "ms": ms}


def make_batches(run):
    """run.steps batches (x, y), each (accum, rows / accum, T) int32, from train.py's loader: the
    tokens of a step depend on (seed, step) only, not on how its rows split into micro-batches or
    devices."""
    import jax

    if run.c["dropout"] != 0.0:
        raise UsageError(
            "training parity needs dropout 0: the two frameworks draw different dropout masks"
        )
    check_rows(run.rows, run.accum, run.devices, run.tensor_parallel)
    if run.devices > jax.device_count():
        raise UsageError(f"{run.devices} devices asked for, {jax.device_count()} here")
    loader = make_loader(
        run.data_dir,
        "train",
        run.seq_len,
        run.rows // run.accum,
        run.c["seed"],
        vocab_size=hf_vocab_size(run.model_dir),
    )
    return [loader.next(run.accum) for _ in range(run.steps)]


def check_rows(rows, accum, devices, tensor_parallel):
    shards = devices // tensor_parallel  # data x fsdp: the devices of a tensor group share rows
    if rows % (accum * shards):
        raise UsageError(
            f"{rows} rows per step do not split into --accum {accum} micro-batches over {shards} "
            "batch shards (data x fsdp): rows per step must be divisible by accum x data x fsdp"
        )


def hf_vocab_size(model_dir):
    from dataio.weights import hf_directory, read_hf_config

    return read_hf_config(hf_directory(model_dir))["vocab_size"]
