"""
nanochat's optimizer, MuonAdamW (nanochat/optim.py; its groups from gpt.py's setup_optimizer, its
schedules from scripts/base_train.py), from optax's pieces: optax.partition over nanochat's seven
groups by each param's path (param_labels), six of plain AdamW each with its own betas, eps, weight
decay and rate (nanochat_adamw), and Muon on every matrix of the blocks (nanochat_muon). Every
group's rate is its initial rate times the run's lr_multiplier; Muon's momentum and weight decay
follow their own schedules. Its torch twin, written from optim.py, is
parity/nanochat_optim_reference.py; archs/nanochat_recipe.py resolves the rates and the horizon.

nanochat's Muon differs from modded-nanogpt's (archs/muon.py) in:
- momentum: record 20's EMA and Nesterov lerps, momentum from get_muon_momentum (0.85 -> 0.97
  over 400 steps, -> 0.90 over the warmdown);
- before the iteration, MuonEq: each row rescaled to the mean row norm; then the Frobenius norm
  divided out (x 1.01 + 1e-6);
- Polar Express (Amsel et al.) in place of Newton-Schulz: five quintics, each its own
  coefficients, on X^T X for a tall matrix and X X^T for a wide or square one; in bfloat16 only
  where nanochat's COMPUTE_DTYPE is (CUDA sm80+), else float32;
- Muon+: the result's Frobenius norm snapped to sqrt(min(rows, cols));
- NorMuon's variance reduction: a second moment per row (rows >= cols) or per column, an EMA at
  beta2 0.9, the update divided by its root and renormalised to the norm it had;
- cautious weight decay, p -= lr (g + wd p [g p >= 0]), at lr x sqrt(max(1, rows / cols)).
rows, cols: torch's (out, in); our kernels are (in, out), so each goes through the math
transposed. A shape group of nanochat's is a batch of matrices that each go through the same math
alone, at one set of hyperparameters: here every matrix is its own leaf (the stacked blocks under
scan_layers, a batch again).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from archs import nanochat_sft
from archs.muon import in_float32, lerp, on_every_device

# Polar Express's coefficients for 5 iterations, safety factor 2e-2, cushion 2 (arXiv 2505.16932)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# setup_optimizer's AdamW groups: (beta1, beta2), eps, weight decay (not scheduled)
ADAM_GROUPS = {
    "lm_head": ((0.8, 0.96), 1e-10, 0.01),
    "embedding": ((0.8, 0.995), 1e-10, 0.001),
    "value_embeds": ((0.8, 0.995), 1e-10, 0.01),
    "resid": ((0.8, 0.95), 1e-10, 0.05),
    "x0": ((0.96, 0.95), 1e-10, 0.0),  # higher beta1 for x0 (nanochat)
    "smear": ((0.8, 0.95), 1e-10, 0.0),
}
# a param's group by the first name of its path (nanochat's state-dict names, our nnx attributes)
GROUP_OF = {
    "lm_head": "lm_head",
    "wte": "embedding",
    "value_embeds": "value_embeds",
    "resid_lambdas": "resid",
    "x0_lambdas": "x0",
    "smear_gate": "smear",
    "smear_lambda": "smear",
    "backout_lambda": "smear",
    "h": "muon",  # every param of the blocks is a matrix
}
MUON_BETA2 = 0.9  # the second moment's EMA (setup_optimizer)
MOMENTUM_WARMUP = 400  # get_muon_momentum's warmup, in steps whatever the run's length
SMEAR_LR = 0.2  # setup_optimizer's rate for the smear group: neither batch- nor width-scaled
D_MODEL_REF = 768  # the width the AdamW rates were tuned at (d12)


def path_names(key_path):
    """A param's path as names: ('h', '0', 'attn', 'c_q', 'kernel'), from an nnx.State (its
    trailing 'value' dropped) or a plain nested dict or list."""
    names = []
    for entry in key_path:
        name = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))
        names.append(str(name))
    return tuple(names[:-1] if names and names[-1] == "value" else names)


def param_labels(params):
    """nanochat's group of every param (GROUP_OF, by its path's first name); ValueError for a
    param in none of them, or a non-matrix in the blocks."""

    def label(key_path, p):
        names = path_names(key_path)
        group = GROUP_OF.get(names[0])
        if group is None:
            raise ValueError(f"{'.'.join(names)} is in none of nanochat's optimizer groups")
        if group == "muon" and p.ndim < 2:
            raise ValueError(f"{'.'.join(names)} is in the blocks but is not a matrix: not Muon's")
        return group

    return jax.tree_util.tree_map_with_path(label, params)


def group_rates(model_dim, unembedding_lr, embedding_lr, matrix_lr, scalar_lr):
    """Each group's initial rate as setup_optimizer sets it: AdamW's embedding and head rates
    scaled by 1/sqrt(model_dim / 768), the value embeddings' at half the embedding's, resid at 1%
    of scalar_lr, x0 at scalar_lr, smear at 0.2 whatever; Muon's matrix_lr. (base_train passes its
    rates times the batch-size scale: archs/nanochat_recipe.py.)"""
    dmodel_lr_scale = (model_dim / D_MODEL_REF) ** -0.5
    return {
        "lm_head": unembedding_lr * dmodel_lr_scale,
        "embedding": embedding_lr * dmodel_lr_scale,
        "value_embeds": embedding_lr * dmodel_lr_scale * 0.5,
        "resid": scalar_lr * 0.01,
        "x0": scalar_lr,
        "smear": SMEAR_LR,
        "muon": matrix_lr,
    }


# --- the schedules (base_train), of the step's iteration number: ints or tracers


def warmdown_iters(num_iterations, warmdown_ratio):
    """The warmdown's length: Python's round (half to even) of warmdown_ratio x num_iterations."""
    return round(warmdown_ratio * num_iterations)


def lr_multiplier(it, num_iterations, warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05):
    """get_lr_multiplier: (it + 1) / warmup_steps, 1, then linearly from 1 towards final_lr_frac
    over the last warmdown_iters (reaching it at num_iterations)."""
    it = jnp.asarray(it, jnp.float32)
    warmdown = warmdown_iters(num_iterations, warmdown_ratio)
    progress = (num_iterations - it) / max(warmdown, 1)
    return jnp.where(
        it < warmup_steps,
        (it + 1) / warmup_steps,
        jnp.where(
            it <= num_iterations - warmdown, 1.0, progress * 1.0 + (1 - progress) * final_lr_frac
        ),
    )


def muon_momentum(it, num_iterations, warmdown_ratio=0.65, warmup=MOMENTUM_WARMUP):
    """get_muon_momentum: 0.85 -> 0.97 over the first `warmup` steps, 0.97, then -> 0.90 over the
    LR's warmdown; the warmup wins where they overlap (a run shorter than it)."""
    it = jnp.asarray(it, jnp.float32)
    warmdown = warmdown_iters(num_iterations, warmdown_ratio)
    warmdown_start = num_iterations - warmdown
    frac = it / warmup
    progress = (it - warmdown_start) / max(warmdown, 1)
    return jnp.where(
        it < warmup,
        (1 - frac) * 0.85 + frac * 0.97,
        jnp.where(it >= warmdown_start, 0.97 * (1 - progress) + 0.90 * progress, 0.97),
    )


def muon_weight_decay(it, weight_decay, num_iterations):
    """get_weight_decay: Muon's weight decay, cosine from weight_decay to 0 at num_iterations."""
    it = jnp.asarray(it, jnp.float32)
    return weight_decay * 0.5 * (1 + jnp.cos(math.pi * it / num_iterations))


# --- AdamW (adamw_step_fused)


class AdamWState(NamedTuple):
    schedule: optax.ScaleByScheduleState  # the updates so far (train_step.schedule_count's)
    exp_avg: optax.Updates
    exp_avg_sq: optax.Updates
    # the moments' updates before this run (a warm start's: nanochat's 'step', which the bias
    # correction counts on from, as its load_state_dict keeps it); 0 for a fresh optimizer
    steps_before: jax.Array


def nanochat_adamw(learning_rate, betas, eps, weight_decay):
    """adamw_step_fused: p *= 1 - lr wd (decoupled, first), both moments as lerps, then p -= lr /
    (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps), t the moments' 1-based update number
    (steps_before + the run's).
    learning_rate(count): the rate at the update's 0-based iteration."""
    b1, b2 = (jnp.float32(b) for b in betas)

    def init_fn(params):
        zeros, count = optax.tree.zeros_like(params), jnp.zeros([], jnp.int32)
        return AdamWState(optax.ScaleByScheduleState(count), zeros, zeros, count)

    def update_fn(updates, state, params):
        count = state.schedule.count
        t = (state.steps_before + count + 1).astype(jnp.float32)
        lr = jnp.asarray(learning_rate(count), jnp.float32)
        bias1, bias2 = 1 - b1**t, 1 - b2**t

        def one(g, p, m, v):
            m, v = lerp(m, g, 1 - b1), lerp(v, jnp.square(g), 1 - b2)
            new = p * (1 - lr * weight_decay) - (lr / bias1) * (m / (jnp.sqrt(v / bias2) + eps))
            return new - p, m, v

        out = jax.tree.map(one, updates, params, state.exp_avg, state.exp_avg_sq)
        pick = lambda i: jax.tree.map(lambda _, o: o[i], updates, out)  # noqa: E731
        schedule = optax.ScaleByScheduleState(optax.safe_increment(count))
        return pick(0), AdamWState(schedule, pick(1), pick(2), state.steps_before)

    return optax.GradientTransformation(init_fn, update_fn)


# --- Muon (muon_step_fused), in torch's (..., rows, cols) = (..., out, in)


def matmul(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def frobenius(x):
    """Each matrix's Frobenius norm, kept (..., 1, 1)."""
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))


def polar_express(g, steps=5, dtype=jnp.float32):
    """MuonEq, then Polar Express on g (..., rows, cols) in `dtype`; returns float32. The norms
    are float32, each elementwise expression rounded to `dtype` once (torch.compile fuses them)."""
    f32 = jnp.float32
    rows, cols = g.shape[-2:]
    X = g.astype(dtype)
    # MuonEq: each row to the mean row norm, a better-conditioned spectrum to orthogonalise
    target = frobenius(X.astype(f32)) / rows**0.5
    row_norm = jnp.maximum(jnp.linalg.norm(X.astype(f32), axis=-1, keepdims=True), 1e-6)
    X = X * (target / row_norm).astype(dtype)
    norm = frobenius(X.astype(f32)).astype(dtype)
    X = (X.astype(f32) / (norm.astype(f32) * 1.01 + 1e-6)).astype(dtype)  # top singular value < 1
    tall = rows > cols
    for a, b, c in POLAR_EXPRESS[:steps]:
        XT = jnp.swapaxes(X, -1, -2)
        A = matmul(XT, X) if tall else matmul(X, XT)
        B = (b * A.astype(f32) + c * matmul(A, A).astype(f32)).astype(dtype)
        BX = matmul(X, B) if tall else matmul(B, X)
        X = (a * X.astype(f32) + BX.astype(f32)).astype(dtype)
    return X.astype(f32)


def reduced_axis(rows, cols):
    """The axis the second moment averages over: each row's (-1) when rows >= cols, else each
    column's (-2)."""
    return -1 if rows >= cols else -2


def muon_step(grad, param, momentum_buffer, second_moment, momentum, lr, wd, beta2, steps, dtype):
    """One update of matrices (..., rows, cols), torch's layout: (the param's update, the new
    momentum buffer, the new second moment). lr: the group's, before the shape's scale."""
    rows, cols = grad.shape[-2:]
    momentum_buffer = lerp(momentum_buffer, grad, 1 - momentum)
    g = lerp(grad, momentum_buffer, momentum)  # Nesterov
    # whole matrices on every device of a mesh, as one device computes them (archs/muon.py)
    g = on_every_device(lambda g: polar_express(g, steps, dtype))(g)
    # Muon+: the norm of an exactly semi-orthogonal matrix, undoing under-convergence
    g = g * (min(rows, cols) ** 0.5 / jnp.maximum(frobenius(g), 1e-6))
    # NorMuon: per-row (or column) second moment; the update renormalised to its own norm
    axis = reduced_axis(rows, cols)
    size = g.shape[axis]
    v_mean = jnp.mean(jnp.square(g), axis=axis, keepdims=True)
    v_norm = jnp.sqrt(jnp.sum(v_mean, axis=(-2, -1), keepdims=True) * size)
    second_moment = lerp(second_moment, v_mean, 1 - beta2)
    step_size = jax.lax.rsqrt(jnp.maximum(second_moment, 1e-10))
    v_norm_new = jnp.sqrt(
        jnp.sum((v_mean * size) * jnp.square(step_size), axis=(-2, -1), keepdims=True)
    )
    g = g * (step_size * (v_norm / jnp.maximum(v_norm_new, 1e-10)))
    lr = lr * update_scale(rows, cols)
    return -(lr * g + cautious_decay(g, param, lr, wd)), momentum_buffer, second_moment


def update_scale(rows, cols):
    """The rate's multiplier of a (rows, cols) matrix: sqrt(max(1, rows / cols)), 2 for c_fc."""
    return max(1.0, rows / cols) ** 0.5


def cautious_decay(g, param, lr, wd):
    """Cautious weight decay: lr wd param, only where the update and the param agree in sign."""
    return lr * wd * param * (g * param >= 0).astype(g.dtype)


class MuonState(NamedTuple):
    schedule: optax.ScaleByScheduleState  # the updates so far
    momentum_buffer: optax.Updates  # like the params
    second_moment: optax.Updates  # each kernel's shape with its reduced axis 1


def torch_layout(x):
    """(..., in, out) <-> (..., out, in)."""
    return jnp.swapaxes(x, -1, -2)


def nanochat_muon(learning_rate, momentum, weight_decay, beta2=MUON_BETA2, steps=5, dtype=None):
    """muon_step_fused on each (in, out) kernel (or stack of them), every hyperparameter a
    function of the update's 0-based iteration. dtype: Polar Express's (None: float32, nanochat's
    on a CPU)."""
    dtype = jnp.float32 if dtype is None else dtype

    def second_moment_like(p):
        rows, cols = p.shape[-1], p.shape[-2]  # torch's (out, in) from our (in, out)
        shape = list(p.shape)
        shape[-1 if reduced_axis(rows, cols) == -2 else -2] = 1  # ours: the torch axis, swapped
        return jnp.zeros(shape, p.dtype)

    def init_fn(params):
        count = optax.ScaleByScheduleState(jnp.zeros([], jnp.int32))
        return MuonState(
            count, optax.tree.zeros_like(params), jax.tree.map(second_moment_like, params)
        )

    def update_fn(updates, state, params):
        count = state.schedule.count
        hyper = [
            jnp.asarray(f(count), jnp.float32) for f in (momentum, learning_rate, weight_decay)
        ]

        def one(g, p, buf, v):
            out = muon_step(
                *map(torch_layout, (g, p, buf, v)), *hyper, jnp.float32(beta2), steps, dtype
            )
            return tuple(map(torch_layout, out))

        out = jax.tree.map(one, updates, params, state.momentum_buffer, state.second_moment)
        pick = lambda i: jax.tree.map(lambda _, o: o[i], updates, out)  # noqa: E731
        schedule = optax.ScaleByScheduleState(optax.safe_increment(count))
        return pick(0), MuonState(schedule, pick(1), pick(2))

    return optax.GradientTransformation(init_fn, update_fn)


# --- the whole optimizer


def muon_adamw(rates, lr_multiplier, momentum, weight_decay, dtype=None):
    """MuonAdamW on a nanochat model's params (param_labels): each group at rates[group] (
    group_rates) times lr_multiplier(count); Muon's momentum and weight decay momentum(count),
    weight_decay(count) (base_train's schedules: schedules()). AdamW computes in float32 on any
    param dtype, as adamw_step_fused (the bf16 embeddings); dtype: Polar Express's."""

    def scheduled(rate):
        return lambda count: rate * lr_multiplier(count)

    transforms = {
        group: in_float32(nanochat_adamw(scheduled(rates[group]), betas, eps, wd))
        for group, (betas, eps, wd) in ADAM_GROUPS.items()
    }
    transforms["muon"] = nanochat_muon(
        scheduled(rates["muon"]), momentum, weight_decay, dtype=dtype
    )
    return optax.partition(transforms, param_labels)


def schedules(
    num_iterations,
    weight_decay,
    warmup_steps=40,
    warmdown_ratio=0.65,
    final_lr_frac=0.05,
    momentum_warmup=MOMENTUM_WARMUP,
):
    """base_train's three schedules for a run of num_iterations, as muon_adamw takes them:
    (lr_multiplier, momentum, weight_decay), each a function of the 0-based iteration."""
    return (
        lambda it: lr_multiplier(it, num_iterations, warmup_steps, warmdown_ratio, final_lr_frac),
        lambda it: muon_momentum(it, num_iterations, warmdown_ratio, momentum_warmup),
        lambda it: muon_weight_decay(it, weight_decay, num_iterations),
    )


def for_run(c, lr_multiplier):
    """optimizer='muonadamw' for the settings of a run (train.py's `c`, its rates and weight decay
    as the depth dial left them): the head at learning_rate, the embeddings at
    embed_learning_rate, the scalars at scalar_learning_rate, the blocks' matrices at
    muon_learning_rate (group_rates), each times lr_multiplier(count); Muon's momentum and weight
    decay on base_train's schedules over max_iters (lr_schedule='sft': chat_sft's momentum, and
    weight_decay constant: its 0, or what a warm start's file holds, which its load keeps). Polar
    Express in the compute dtype, as nanochat runs it in its COMPUTE_DTYPE."""
    rates = group_rates(
        c["n_embd"],
        c["learning_rate"],
        c["embed_learning_rate"],
        c["muon_learning_rate"],
        c["scalar_learning_rate"],
    )
    if c["lr_schedule"] == "sft":  # chat_sft's: its momentum warmup, Muon's weight decay fixed
        momentum, weight_decay = nanochat_sft.muon_momentum, lambda it: c["weight_decay"]
    else:
        _, momentum, weight_decay = schedules(
            c["max_iters"], c["weight_decay"], c["warmup_iters"], c["cooldown_frac"]
        )
    dtype = jnp.bfloat16 if c["dtype"] == "bfloat16" else None
    return muon_adamw(rates, lr_multiplier, momentum, weight_decay, dtype=dtype)
