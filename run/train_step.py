"""
The training step, shared by train.py, parity/check_train.py and the benchmarks: the optimizers
(nanoGPT's AdamW with its weight-decay grouping; modded-nanogpt's Muon, archs/muon.py) and schedules
(nanoGPT's cosine, modded-nanogpt's trapezoid of record 5 and cooldown of record 20), the jitted
step (micro-batches scanned, gradients averaged, clipped by global norm), the eval step, and
init_state: the params and optimizer state, each array created or read straight into its shards,
from scratch, a checkpoint or pretrained weights.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from archs import nanochat_optim, nanochat_optim_state, nanochat_sft
from archs.models import build, model_from
from archs.muon import muon, muon20
from compute import sharding
from compute.layers import mean_of
from run import checkpoint


def get_lr(it, c):
    """AdamW's learning rate at iteration `it` (0-based: step `it` uses get_lr(it)); with
    optimizer='muon' Adam's, with 'muon20' the head's. Works on ints and tracers. lr_schedule
    'cosine': nanoGPT's linear warmup, cosine decay to min_lr, then min_lr; 'trapezoid' and
    'cooldown': learning_rate times a modded-nanogpt record's multiplier (MULTIPLIERS)."""
    if not c["decay_lr"]:
        return jnp.asarray(c["learning_rate"], jnp.float32)
    if c["lr_schedule"] in MULTIPLIERS:
        return c["learning_rate"] * MULTIPLIERS[c["lr_schedule"]](it, c)
    it = jnp.asarray(it, jnp.float32)
    warmup = c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    ratio = jnp.clip(
        (it - c["warmup_iters"]) / max(c["lr_decay_iters"] - c["warmup_iters"], 1), 0.0, 1.0
    )
    coeff = 0.5 * (1.0 + jnp.cos(math.pi * ratio))  # coeff ranges 0..1
    cosine = c["min_lr"] + coeff * (c["learning_rate"] - c["min_lr"])
    return jnp.where(
        it < c["warmup_iters"], warmup, jnp.where(it > c["lr_decay_iters"], c["min_lr"], cosine)
    )


def trapezoid(it, c):
    """modded-nanogpt's get_lr (record 5), a multiplier of each optimizer's max rate: (it + 1) /
    warmup_iters during the warmup, 1, then (max_iters - it) / warmdown_iters over the last
    warmdown_iters iterations (0 at max_iters)."""
    it = jnp.asarray(it, jnp.float32)
    warmdown_start = c["max_iters"] - c["warmdown_iters"]
    warmup = (it + 1) / max(c["warmup_iters"], 1)
    # at max_iters without a warmdown: 0, not 0/0
    warmdown = (c["max_iters"] - it) / max(c["warmdown_iters"], 1)
    return jnp.where(it < c["warmup_iters"], warmup, jnp.where(it < warmdown_start, 1.0, warmdown))


COOLDOWN_FLOOR = 0.1  # record 20's multiplier at the end of its cooldown


def cooldown(it, c):
    """Record 20's get_lr, a multiplier of every group's max rate: 1, then linearly to
    COOLDOWN_FLOOR over the last cooldown_frac of max_iters (reached at max_iters, kept after)."""
    # the run's fraction still to go; its difference exact in float32 (the record's, in float64)
    left = (c["max_iters"] - jnp.asarray(it, jnp.float32)) / max(c["max_iters"], 1)
    w = jnp.clip(left / c["cooldown_frac"], 0.0, 1.0)  # 1 -> 0
    return w * 1.0 + (1 - w) * COOLDOWN_FLOOR


def warmdown(it, c):
    """nanochat's get_lr_multiplier (archs/nanochat_optim.py): (it + 1) / warmup_iters, 1, then
    linearly to final_lr_frac over the last cooldown_frac of max_iters."""
    return nanochat_optim.lr_multiplier(
        it, c["max_iters"], c["warmup_iters"], c["cooldown_frac"], c["final_lr_frac"]
    )


MULTIPLIERS = {"trapezoid": trapezoid, "cooldown": cooldown, "warmdown": warmdown}


def sft_multiplier(c, progress):
    """lr_schedule='sft' (nanochat's chat_sft): every group's multiplier at iteration `it`,
    init_lr_frac times chat_sft's multiplier of the mixture's progress at that step (`progress`:
    archs.nanochat_sft.progress_table's, one per step); past the table (a resume asked for more
    steps), its last."""
    table = jnp.asarray(progress, jnp.float32)

    def multiplier(it):
        at = table[jnp.minimum(jnp.asarray(it, jnp.int32), table.shape[0] - 1)]
        return c["init_lr_frac"] * nanochat_sft.lr_multiplier(
            at, c["warmup_frac"], c["cooldown_frac"], c["final_lr_frac"]
        )

    return multiplier


def scheduled(it, c, rate):
    """A group's learning rate at iteration `it`, whose max is `rate`: on the schedule that takes
    Adam's from learning_rate (the records: one LambdaLR multiplier for every group; under
    'cosine', min_lr scaled alike)."""
    if not c["decay_lr"]:
        return jnp.asarray(rate, jnp.float32)
    if c["lr_schedule"] in MULTIPLIERS:
        return rate * MULTIPLIERS[c["lr_schedule"]](it, c)
    return get_lr(it, c) * (rate / c["learning_rate"])


def get_muon_lr(it, c):
    """Muon's learning rate at iteration `it`: muon_learning_rate, scheduled."""
    return scheduled(it, c, c["muon_learning_rate"])


def decay_mask(params):
    """nanoGPT's grouping: every >=2-D tensor decays (matmul weights and embeddings), biases and
    norms don't. The stacked blocks' params (scan_layers) count without their layer axis."""

    def decays(path, p):
        return (
            p.ndim
            - bool(sharding.STACKED.search(jax.tree_util.keystr(path, simple=True, separator=".")))
            >= 2
        )

    return jax.tree_util.tree_map_with_path(decays, params)


def lr_of(c, progress=None):
    """The head's learning rate at iteration `it`, which the step's metrics report: get_lr, or
    under lr_schedule='sft' learning_rate times sft_multiplier's."""
    if c["lr_schedule"] == "sft":
        multiplier = sft_multiplier(c, progress)
        return lambda it: c["learning_rate"] * multiplier(it)
    return partial(get_lr, c=c)


def make_optimizer(c, progress=None):
    """The optimizer of c["optimizer"]: 'adamw', nanoGPT's; 'muon', modded-nanogpt's record 5
    (muon.muon); 'muon20', its record 20 (muon.muon20); 'muonadamw', nanochat's
    (nanochat_optim.for_run), each group's rate scheduled (lr_schedule='sft': on `progress`,
    sft_multiplier's table)."""
    if c["optimizer"] == "muon20":
        return muon20(c, lambda rate: partial(scheduled, c=c, rate=rate))
    if c["optimizer"] == "muonadamw":
        if c["lr_schedule"] == "sft":
            return nanochat_optim.for_run(c, sft_multiplier(c, progress))
        return nanochat_optim.for_run(c, partial(scheduled, c=c, rate=1.0))
    adamw = optax.adamw(
        learning_rate=partial(get_lr, c=c),
        b1=c["beta1"],
        b2=c["beta2"],
        eps=1e-8,
        weight_decay=c["weight_decay"],
        mask=decay_mask,
    )
    if c["optimizer"] == "adamw":
        return adamw
    return muon(c, adamw, partial(get_muon_lr, c=c))


def batch_loss(model, x, y, key=None, inputs=None):
    """The model's mean loss on a batch (B, T) (GPT.loss: the logits in chunks where loss_chunk says
    so). On a single CPU device the rows go through the model as two independent halves, which
    XLA:CPU's executor runs side by side on two cores: faster than one batch whose every op splits
    its work over the threads (docs/benchmarks.md). Same loss: one mean over both halves' targets;
    dropout draws a key per half. inputs: the architecture's own keywords to its loss at this step
    (Arch.step_inputs: record 20's window), which takes the batch whole."""
    if inputs:
        return model.loss(x, y, key=key, **inputs)
    if sharding.target_platform() != "cpu" or sharding.target_size() > 1 or x.shape[0] % 2:
        return model.loss(x, y, key=key)
    keys = jax.random.split(key) if key is not None else (None, None)
    halves = [
        model.loss_terms(model.hidden_states(rows, k)[1], targets)
        for rows, targets, k in zip(jnp.split(x, 2), jnp.split(y, 2), keys)
    ]
    return mean_of(*(a + b for a, b in zip(*halves)))  # (total, count) of both halves


def make_train_step(graphdef, tx, grad_clip, lr_schedule=None, inputs=None, grad_scale=1.0):
    """The one step: scan over micro-batches (memory flat in their number), average the grads, clip
    by global norm as torch.nn.utils.clip_grad_norm_ does, apply tx. x, y: (accum, B, T). Jitted by
    on_leaves with the state's shardings pinned. With `lr_schedule` (tx's), the metrics hold the
    step's learning rate, so that the loop never computes it on the host. inputs (the loss's
    keywords at the step's count), grad_scale: the architecture's (Arch.step_inputs)."""

    def loss_fn(params, x, y, key, step_inputs):
        return batch_loss(nnx.merge(graphdef, params), x, y, key, step_inputs)

    def train_step(params, opt_state, x, y, key):
        accum = x.shape[0]
        step_inputs = None if inputs is None else inputs(schedule_count(opt_state))

        def micro_step(grad_sum, batch):
            x, y, key = batch
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key, step_inputs)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        # the gradient sum takes the params' shardings, in float32 (record 20's bf16 tables too)
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
        grads, losses = jax.lax.scan(micro_step, zeros, (x, y, jax.random.split(key, accum)))
        # the loss is a mean over each micro-batch; the sum over micro-batches must become a mean
        # too (times grad_scale: record 20's sum over sequences)
        grads = jax.tree.map(lambda g: g * (grad_scale / accum), grads)
        grad_norm = optax.tree.norm(grads)
        if grad_clip > 0.0:
            scale = jnp.minimum(1.0, grad_clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        # each rounded once to its param's dtype (embed_dtype), as the optimizer takes it
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        metrics = {"loss": jnp.mean(losses), "grad_norm": grad_norm}
        if lr_schedule is not None:
            metrics["lr"] = lr_schedule(schedule_count(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # read on the host only at log steps and saves
        metrics["finite"] = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        return params, opt_state, metrics

    return train_step


def schedule_count(opt_state):
    """The number of updates the learning-rate schedule has counted (the step's iteration number):
    AdamW's, or with optimizer='muon' or 'muon20' the first group's (every group counts the
    same)."""
    is_schedule = lambda s: isinstance(s, optax.ScaleByScheduleState)  # noqa: E731
    return next(s.count for s in jax.tree.leaves(opt_state, is_leaf=is_schedule) if is_schedule(s))


def on_leaves(step, params, opt_state, batch_sharding=None):
    """`step` jitted over flat lists of arrays: (param leaves, opt leaves, x, y, key) -> the same,
    and metrics. jit flattens nnx Variables in Python, slowly (CPU time a 2-core machine takes from
    the step itself); lists of arrays cost a quarter of it (docs/benchmarks.md). The state's
    shardings (those of `params` and `opt_state`) are pinned on input and output, so the step
    compiles once and nothing reshards."""
    param_def, opt_def = jax.tree.structure(params), jax.tree.structure(opt_state)
    shardings = None
    if batch_sharding is not None:
        state = [[x.sharding for x in jax.tree.leaves(t)] for t in (params, opt_state)]
        replicated = sharding.replicated(batch_sharding.mesh)
        shardings = dict(
            in_shardings=(*state, batch_sharding, batch_sharding, replicated),
            out_shardings=(*state, replicated),
        )

    @partial(jax.jit, donate_argnums=(0, 1), **(shardings or {}))
    def leaves_step(params, opt_state, x, y, key):
        params, opt_state, metrics = step(
            param_def.unflatten(params), opt_def.unflatten(opt_state), x, y, key
        )
        return jax.tree.leaves(params), jax.tree.leaves(opt_state), metrics

    return leaves_step


def compile_step(step, params, opt_state, batch_shape, batch_sharding):
    """`step` jitted on the state's shardings (see on_leaves) and compiled for (accum, B, T) batches
    -> (compiled step, state bytes per device, XLA's step peak bytes per device). params and
    opt_state may be abstract (ShapeDtypeStructs with shardings): then nothing is materialized
    (bench/train.py --memory)."""
    lowered = lower_step(step, params, opt_state, batch_shape, batch_sharding)
    compiled = lowered.compile(compiler_options(batch_sharding.mesh))
    return (
        compiled,
        sharding.bytes_per_device([params, opt_state]),
        step_peak(compiled, batch_sharding.mesh),
    )


# XLA:GPU rewrites LayerNorm, forward and backward, into cuDNN's fused norm kernels: the 124M step
# at batch 64 took 131.9 ms instead of 139.7 on an H200 (docs/benchmarks.md). Off by default in XLA,
# so set where the step compiles.
GPU_OPTIONS = {"xla_gpu_enable_cudnn_layer_norm": True}


def compiler_options(mesh):
    """XLA's options for a step compiled for `mesh`'s devices: GPU_OPTIONS on an NVIDIA GPU."""
    return GPU_OPTIONS if sharding.platform_of(mesh) in ("gpu", "cuda") else None


def lower_step(step, params, opt_state, batch_shape, batch_sharding):
    """compile_step's program, lowered (traced), not compiled."""
    jitted = on_leaves(step, params, opt_state, batch_sharding)
    batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding)
    # an abstract key: a concrete one made under (or placed on) a mesh of devices this process
    # cannot address, a TPU topology compiled for on a CPU, fails
    key = jax.ShapeDtypeStruct(
        (), jax.random.key(0).dtype, sharding=sharding.replicated(batch_sharding.mesh)
    )
    # the model pins its activations to it (sharding.constrain_batch)
    with jax.set_mesh(batch_sharding.mesh):
        return jitted.lower(jax.tree.leaves(params), jax.tree.leaves(opt_state), batch, batch, key)


def step_peak(compiled, mesh):
    """XLA's peak bytes per device of a step compiled for `mesh` (sharding.step_peak_bytes)."""
    return sharding.step_peak_bytes(compiled, sharding.platform_of(mesh))


@jax.jit
def first_nonfinite(so_far, iter_num, finite):
    """The first iteration whose step was not finite (-1: none yet), combined on device: no host
    sync a step."""
    return jnp.where((so_far < 0) & ~finite, iter_num, so_far)


@jax.jit
def all_finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_eval_step(graphdef, params, token_bytes=None):
    """Mean loss of one batch; takes the param leaves, as the train step does (see on_leaves), and
    the architecture's keywords to its loss at the step evaluated (Arch.eval_inputs). With
    `token_bytes` (each id's bytes, 0 for a special token: a nanochat tokenizer's), [mean loss,
    nats of the targets that carry bytes, their bytes]: bits per byte, as nanochat's
    evaluate_bpb."""
    param_def = jax.tree.structure(params)
    token_bytes = None if token_bytes is None else jnp.asarray(token_bytes, jnp.int32)

    @jax.jit
    def eval_step(param_leaves, x, y, inputs=None):
        model = nnx.merge(graphdef, param_def.unflatten(param_leaves))
        if token_bytes is None:
            return batch_loss(model, x, y, None, inputs)
        _, hidden = model.hidden_states(x)
        # an ignored target (-1: finetuning's unlearned tokens) spells no bytes
        nbytes = jnp.where(y >= 0, token_bytes[jnp.maximum(y, 0)], 0)
        nats, _ = model.loss_terms(hidden, jnp.where(nbytes > 0, y, -1))
        loss = mean_of(*model.loss_terms(hidden, y))
        return jnp.stack([loss, nats, jnp.sum(nbytes).astype(jnp.float32)])

    return eval_step


def bits_per_byte(terms):
    """An eval's [loss, nats, bytes] rows (make_eval_step with token_bytes) -> (mean loss, bits
    per byte)."""
    terms = jnp.stack(terms)
    return float(jnp.mean(terms[:, 0])), float(
        terms[:, 1].sum() / (math.log(2) * terms[:, 2].sum())
    )


def sharded_model(make_model, mesh):
    """(graphdef, params) of make_model(), each param created on the mesh already split by its
    spec."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    params = jax.jit(
        lambda: nnx.split(make_model())[1], out_shardings=sharding.shardings_for(abstract, mesh)
    )()
    return graphdef, params


def init_state(config, mesh, tx, *, seed=0, weights=None, block_size=None, restore=None):
    """(graphdef, params, optimizer state) of a GPT of `config` on the mesh, every array created or
    read straight into its shards (sharding.PARAM_SPECS): no device holds a full replica on the way.
    From scratch (init drawn from `seed`); from `weights` ({HF name: array}, config being theirs),
    cropped to `block_size` when shorter; or restored from a checkpoint: `restore` = (out_dir, its
    meta, the run's checkpoint manager), whose optimizer state comes back too. Weights holding an
    optimizer_state (a nanochat checkpoint's, train_setup.warm_start): the optimizer starts from
    it, as chat_sft's load_state_dict starts its."""
    if restore is not None:
        out_dir, meta, mngr = restore
        params, opt_state = checkpoint.restore_state(
            out_dir, meta["iter_num"], meta, config, tx, mesh, mngr
        )
        return nnx.graphdef(nnx.eval_shape(lambda: build(config, nnx.Rngs(0)))), params, opt_state
    if weights is None:
        graphdef, params = sharded_model(lambda: build(config, nnx.Rngs(seed)), mesh)
    else:
        model = model_from(config, weights, mesh)
        if block_size is not None and block_size < config.block_size:
            model.crop_block_size(block_size)
        rows = model.weight_rows()
        graphdef, params = nnx.split(model)
        # a no-op where in place
        params = jax.device_put(params, sharding.shardings_for(params, mesh))
    opt_shardings = sharding.shardings_for(jax.eval_shape(tx.init, params), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    warm = getattr(weights, "optimizer_state", None)
    if warm is not None:
        opt_state = nanochat_optim_state.warm_started(opt_state, warm.state, rows)
        opt_state = jax.device_put(opt_state, opt_shardings)
    return graphdef, params, opt_state
