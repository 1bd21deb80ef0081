"""
The speedrun records' Muon: modded-nanogpt's optimizer for the blocks' matrices (SGD momentum whose
update is orthogonalised by a Newton-Schulz iteration) beside Adam on everything else. Record 5's
(optimizer='muon': AdamW on the tied embedding) and record 20's (optimizer='muon20': Adam on the
head, the embeddings and the scalars, each group at its own rate; Muon's momentum warmed up), built
from optax's pieces and one transform of our own, orthogonalize. train_step.make_optimizer picks
one and hands it the learning-rate schedules.
"""

import math
import re
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from compute import sharding

# --- Muon (modded-nanogpt's record 5)
# ----------------------------------------------------------------
#
# The record steps its blocks' matrices with Muon and everything else (the embedding, tied to the
# head) with torch's AdamW (betas 0.9/0.95, eps 1e-8, its weight decay 0). Built here from optax's
# pieces: optax.partition for the two groups, optax.adamw for the second (the same AdamW as
# optimizer='adamw': weight_decay applies, as the record's AdamW(weight_decay=args.weight_decay)),
# optax.trace for Muon's momentum, optax.scale_by_learning_rate for its rate; and one transform of
# our own, orthogonalize, for the record's Newton-Schulz and scale. optax.contrib.muon computes a
# different update, where:
# - momentum: optax keeps an EMA, mu = b*mu + (1-b)*g, bias-corrected, and mixes Nesterov from the
#   corrected terms; the record keeps buf = m*buf + g and steps along g + m*buf (optax.trace(m,
#   nesterov=True) is exactly that);
# - scale: optax multiplies by sqrt(max(1, fan_out/fan_in)) (Keller Jordan's later Muon); the record
#   by sqrt(max(rows, cols)), and a fused QKV matrix is three (C, C) matrices, each orthogonalised
#   on its own;
# - Newton-Schulz: optax's iteration is c0 X + (c1 A + c2 A A) X with the coefficients cast to X's
#   dtype; the record's a X + b (A X) + c A (A X), its coefficients applied in float32 (in bfloat16
#   they round to other values, and optax's bf16 result lands further from the float32 one than the
#   record's). Both divide by the Frobenius norm + eps (the record's eps 1e-7, optax's default 1e-8)
#   and iterate on the wide orientation; ours also starts from torch's (out, in) layout, so that a
#   square matrix takes the record's orientation;
# - the auxiliary Adam: optax's is NAdam (nesterov=True) with b2 0.999 and Muon's eps; the record's
#   plain Adam(W);
# - grouping: optax's Muon takes every 2-D param (the embedding too, unless told); the record's, the
#   blocks' matrices. Under a mesh, each device orthogonalises every whole matrix, as each of the
#   record's ranks does (on_every_device).
#
# --- Record 20 (2025-01-16_Sub3Min) changed, in its Muon:
# - momentum: an EMA without bias correction, buf.lerp_(g, 1 - m) = m*buf + (1-m)*g, and Nesterov
#   as g.lerp_(buf, m) = (1-m)*g + m*buf; m warmed up linearly from 0.85 to 0.95 over the first 300
#   steps (record20_momentum, muon_momentum_at);
# - Newton-Schulz: B = b A + (c A) A, X = a X + B X: record 5's polynomial, rounded elsewhere in
#   bfloat16 (newton_schulz's record=20);
# - scale: sqrt(max(1, rows/cols)) in torch's (out, in) layout (optax's): c_fc's (4C, C) 2, the
#   others 1. Its qkv_w (3, C, C) is orthogonalised batched, each (C, C) on its own, as record 5's
#   three Linears (our fused (C, 3C) kernel, split);
# - Adam: torch.optim.Adam(fused=True) (no weight decay), eps 1e-10, in three groups at their own
#   rates. Its CUDA kernel computes in float32 whatever the params' dtype and stores each state in
#   theirs, rounded once a step: on its bf16 embedding tables (our embed_dtype), in_float32.

# the records' quintic, its slope at zero maximised (Keller Jordan)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
FUSED_QKV = re.compile(r"attn\.c_attn\.kernel")  # (C, 3C) = [q | k | v]: the record's c_q, c_k, c_v
BLOCKS = re.compile(r"(^|\.)h\.")  # the blocks' params, per layer (h.3.) or stacked (h.)
# record 20's small Adam eps (by @YouJiacheng): another fix of the world_size dependence that
# @fernbear.bsky.social found
RECORD20_ADAM_EPS = 1e-10
RECORD20_EMBEDDINGS = re.compile(r"^(wte|ve\.\d+)\.embedding$")  # the token and value embeddings


def newton_schulz(G, dtype, steps=5, eps=1e-7, record=5):
    """The record's zeropower_via_newtonschulz5 on G in torch's (out, in) layout: ~U V^T of G = U S
    V^T, by `steps` quintic iterations in `dtype` on the wide orientation (rows <= cols). The
    elementwise sums are float32, rounded to `dtype` once, as torch.compile fuses them in the
    record; the matmuls take `dtype` in and out. record: 5 or 20, whose iterations round apart."""
    a, b, c = NS_COEFFICIENTS
    f32, matmul = jnp.float32, partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    X = G.astype(dtype)
    norm = jnp.sqrt(jnp.sum(jnp.square(X.astype(f32)))).astype(dtype)  # torch's X.norm() in dtype
    X = (X.astype(f32) / (norm.astype(f32) + eps)).astype(dtype)  # the top singular value <= 1
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    for _ in range(steps):
        A = matmul(X, X.T)
        cA = (c * A.astype(f32)).astype(dtype)  # a matmul's input: rounded
        if record == 5:  # a X + b (A X) + c A (A X)
            B = matmul(A, X)
            X = (a * X.astype(f32) + b * B.astype(f32) + matmul(cA, B).astype(f32)).astype(dtype)
        else:  # B = b A + (c A) A, X = a X + B X
            B = (b * A.astype(f32) + matmul(cA, A).astype(f32)).astype(dtype)
            X = (a * X.astype(f32) + matmul(B, X).astype(f32)).astype(dtype)
    return X.T if tall else X


def update_scale(rows, cols, record=5):
    """The record's multiplier of an orthogonalised (rows, cols) update (torch's (out, in)): record
    5's sqrt(max(rows, cols)) (a mean square of ~1); record 20's sqrt(max(1, rows / cols))."""
    return math.sqrt(max(rows, cols) if record == 5 else max(1, rows / cols))


def orthogonalize_kernel(g, fused_qkv, dtype, record=5):
    """One (in, out) kernel's update: newton_schulz in torch's layout, back to ours, scaled
    (update_scale); a fused QKV kernel as its three (C, C) column blocks, as the records' separate
    c_q, c_k, c_v (record 5) or batched qkv_w (record 20)."""
    parts = jnp.split(g, 3, axis=1) if fused_qkv else [g]  # (C, C) x 3, or the whole (in, out)
    out = [
        newton_schulz(part.T, dtype, record=record).T.astype(jnp.float32)
        * update_scale(part.shape[1], part.shape[0], record)
        for part in parts
    ]
    return jnp.concatenate(out, axis=1) if fused_qkv else out[0]


def on_every_device(f):
    """f run whole on each device of the mesh in context (its arguments gathered), unpartitioned:
    the numbers one device computes. XLA would otherwise split f's matmuls, which changes their
    sums, or at least their blocking."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return f
    return jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def _path(key_path):
    """A param's path, 'h.0.mlp.c_fc.kernel' (nnx's trailing '.value' dropped)."""
    return jax.tree_util.keystr(key_path, simple=True, separator=".").removesuffix(".value")


def orthogonalize(ns_dtype, record=5):
    """Muon's update direction (stateless): each of the blocks' kernels orthogonalised
    (orthogonalize_kernel, as `record` does), the stacked ones (scan_layers: (n_layer, in, out))
    layer by layer. Newton-Schulz needs the whole matrix: under a mesh every device gathers it and
    computes it as one device would (the record: every rank all of them); the momentum stays split
    like its param, and so does the update once it meets the param."""
    dtype = NS_DTYPES[ns_dtype]

    def update_fn(updates, state, params=None):
        def one(path, g):
            path = _path(path)
            f = partial(
                orthogonalize_kernel,
                fused_qkv=bool(FUSED_QKV.search(path)),
                dtype=dtype,
                record=record,
            )
            return on_every_device(jax.vmap(f) if sharding.STACKED.search(path) else f)(g)

        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def matrix_dims(path, p):
    """A param's dimensions, the stacked blocks' (scan_layers) without their layer axis."""
    return p.ndim - bool(sharding.STACKED.search(path))


def muon_labels(params):
    """'muon' for each matrix of the blocks (the stacked ones counted without their layer axis),
    else 'adam'."""

    def label(path, p):
        path = _path(path)
        return "muon" if BLOCKS.search(path) and matrix_dims(path, p) == 2 else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def muon(c, adam, lr):
    """Record 5's pair: Muon (momentum muon_momentum, Nesterov, Newton-Schulz in muon_ns_dtype) at
    the schedule `lr` on the blocks' matrices, `adam` on the rest. No weight decay in Muon (the
    record's has none)."""
    return optax.partition(
        {
            "adam": adam,
            "muon": optax.chain(
                optax.trace(decay=c["muon_momentum"], nesterov=True),
                orthogonalize(c["muon_ns_dtype"]),
                optax.scale_by_learning_rate(lr),
            ),
        },
        muon_labels,
    )


# --- Muon (modded-nanogpt's record 20)


def muon_momentum_at(step, c):
    """Record 20's Muon momentum at iteration `step` (0-based, the update's): muon_momentum_start,
    linearly to muon_momentum over muon_momentum_warmup iterations, then muon_momentum."""
    step = jnp.asarray(step, jnp.float32)
    frac = jnp.minimum(step / c["muon_momentum_warmup"], 1.0) if c["muon_momentum_warmup"] else 1.0
    return (1 - frac) * c["muon_momentum_start"] + frac * c["muon_momentum"]


def lerp(start, end, weight):
    """torch.lerp's arithmetic, exact at either end: start + weight (end - start)."""
    return jnp.where(
        weight < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight)
    )


class Record20MomentumState(NamedTuple):
    count: jax.Array  # the updates made so far: the next one's iteration number
    buffer: optax.Updates  # the momentum, like the params


def record20_momentum(c):
    """Record 20's momentum at muon_momentum_at(count): buf.lerp_(g, 1 - m), then Nesterov's
    g.lerp_(buf, m)."""

    def init_fn(params):
        return Record20MomentumState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        m = muon_momentum_at(state.count, c)
        buffer = jax.tree.map(lambda buf, g: lerp(buf, g, 1 - m), state.buffer, updates)
        updates = jax.tree.map(lambda g, buf: lerp(g, buf, m), updates, buffer)
        return updates, Record20MomentumState(optax.safe_increment(state.count), buffer)

    return optax.GradientTransformation(init_fn, update_fn)


def muon20_labels(params):
    """Record 20's groups: 'muon' for each matrix of the blocks, 'head' (lm_head), 'embed' (wte and
    the value embeddings ve.*), 'scalar' for every param of fewer than 2 dimensions."""

    def label(path, p):
        path = _path(path)
        if matrix_dims(path, p) < 2:
            return "scalar"
        if BLOCKS.search(path):
            return "muon"
        if path == "lm_head":
            return "head"
        if RECORD20_EMBEDDINGS.search(path):
            return "embed"
        raise ValueError(f"{path} is in none of record 20's optimizer groups (arch='speedrun20')")

    return jax.tree_util.tree_map_with_path(label, params)


def in_float32(tx):
    """`tx` computing in float32 on params, gradients and state of any float dtype, each state
    leaf rounded once a step back to its own dtype; the updates stay float32 (optax.apply_updates
    rounds each param once). On float32 leaves, tx itself."""

    def upcast(tree):
        floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)  # noqa: E731 (not the count)
        return jax.tree.map(lambda x: x.astype(jnp.float32) if floating(x) else x, tree)

    def update_fn(updates, state, params=None):
        updates, new_state = tx.update(upcast(updates), upcast(state), upcast(params))
        return updates, jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)

    return optax.GradientTransformation(tx.init, update_fn)


def muon20(c, schedule):
    """Record 20's pair: Adam (beta1, beta2, eps 1e-10, no weight decay) on the head at
    learning_rate, the embeddings at embed_learning_rate, the scalars at scalar_learning_rate; Muon
    (record20_momentum, Newton-Schulz in muon_ns_dtype) at muon_learning_rate on the blocks'
    matrices. schedule(rate): the learning-rate schedule of a group whose max rate is `rate`."""

    def adam(rate):
        adam = optax.adam(schedule(rate), b1=c["beta1"], b2=c["beta2"], eps=RECORD20_ADAM_EPS)
        return in_float32(adam)  # the record's fused Adam

    return optax.partition(
        {
            "head": adam(c["learning_rate"]),
            "embed": adam(c["embed_learning_rate"]),
            "scalar": adam(c["scalar_learning_rate"]),
            "muon": optax.chain(
                record20_momentum(c),
                orthogonalize(c["muon_ns_dtype"], record=20),
                optax.scale_by_learning_rate(schedule(c["muon_learning_rate"])),
            ),
        },
        muon20_labels,
    )
