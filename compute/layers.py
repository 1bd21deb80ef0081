"""
The models' pieces that know the mesh and the platform, shared by GPT-2 (model.py) and the
speedrun's records (archs/record5.py, archs/record20.py): how the stack of blocks runs (a Python
loop, or one lax.scan over their params stacked on a leading layer axis, scan_layers), each block's
input pinned to its rows, with or without remat, and the conditionals XLA:CPU needs in the backward
pass; the Linear and embedding whose tables compute/sharding.py lays out. Also the parameter-free
pieces: dropout, record 5's RMSNorm and rotary embedding, and the tied head and its cross-entropy.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from compute import sharding

# remat: what each Block keeps from its forward pass for the backward (the rest is recomputed
# there), as a jax.checkpoint policy
REMAT = {
    "none": None,  # no checkpointing: everything is kept
    # only the block's input: the whole block is recomputed
    "block": jax.checkpoint_policies.nothing_saveable,
    # the Linear layers' outputs (matmuls without batch dimensions); attention, GELU, LayerNorm are
    # recomputed
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the attention branch's matmul outputs only (q, k, v and its projection: 4C a token, dots keeps
    # 9C); the MLP's c_fc is recomputed, an extra 8C^2 FLOPs a token a layer (~11% of the step's
    # 72C^2)
    "qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv", "attn_proj"),
}


@jax.custom_vjp
def fusion_barrier_in_grad(x):
    """Identity whose backward passes the cotangent through a conditional, a fusion boundary XLA:CPU
    keeps, so that it is computed once, into a buffer. At each block's input that is the residual
    stream's gradient, the sum of every later block's contribution: left alone, XLA:CPU fuses that
    sum into each consumer and recomputes it there, a cost quadratic in depth
    (docs/benchmarks.md)."""
    return x


def _barrier_bwd(_, g):
    # both branches give g; the predicate depends on the data, so XLA cannot fold the conditional
    # away
    return (jax.lax.cond(g.ravel()[0] > 0, lambda a, b: a, lambda a, b: b, g, g),)


fusion_barrier_in_grad.defvjp(lambda x: (x, None), _barrier_bwd)


def remat(f, policy):
    """jax.checkpoint(f, policy=policy): the backward pass recomputes what the policy does not save.
    On XLA:CPU that alone saves nothing: its pipeline drops jax's optimization barriers early, CSE
    merges the recomputation back into the forward pass, and without CSE the scheduler still runs it
    there. So on CPU the backward runs inside a conditional on the output's cotangent, as
    fusion_barrier_in_grad: a boundary CSE does not cross, which cannot start before the backward
    pass reaches it."""
    f = jax.checkpoint(f, policy=policy)
    # jax's remat as used on GPU/TPU; a conditional costs a host round trip
    if sharding.target_platform() != "cpu":
        return f

    @jax.custom_vjp
    def g(*args):
        return f(*args)

    # f_vjp holds what the policy saved; both branches recompute the rest, then backpropagate
    def bwd(f_vjp, ct):
        return jax.lax.cond(ct.ravel()[0] > 0, lambda f, g: f(g), lambda f, g: f(g), f_vjp, ct)

    g.defvjp(lambda *args: jax.vjp(f, *args), bwd)
    return g


def block_input(x):
    """The residual stream as each block takes it: rows over data x fsdp under a mesh (weights
    move, activations don't), and on CPU through fusion_barrier_in_grad (on GPU a conditional costs
    a host round trip; XLA:GPU needs no help)."""
    x = sharding.constrain_batch(x)
    return fusion_barrier_in_grad(x) if sharding.target_platform() == "cpu" else x


def apply_block(block, x, key, remat_policy, *args):
    """block(x, key, *args) as the stack runs it (block_input first); remat_policy, an entry of
    REMAT, has the block's forward pass recomputed in the backward (None: everything kept). args:
    arrays (or None) a block takes besides x (record 20's x0, value embedding and mask)."""
    if remat_policy is None:
        return block(block_input(x), key, *args)
    graphdef, state = nnx.split(block)
    return block_fn(graphdef, remat_policy)(state, x, key, *args)


def block_fn(graphdef, remat_policy):
    """(block state, x, key, *args) -> the block's output, as apply_block runs it; the scanned
    stack's body (scan_layers)."""

    def f(state, x, key, *args):
        return nnx.merge(graphdef, state)(block_input(x), key, *args)

    return f if remat_policy is None else remat(f, remat_policy)


def stack_blocks(blocks):
    """One Block whose every param has a leading layer axis (scan_layers), from a list of Blocks."""
    graphdef = nnx.split(blocks[0])[0]
    return nnx.merge(
        graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.split(b)[1] for b in blocks))
    )


def relayout_blocks(tree, template):
    """`tree` (params, or an optimizer state holding them) in the layout of the blocks in `template`
    (the same tree with the blocks stacked, or not: scan_layers): h.{i}.x <-> row i of h.x, each
    leaf cast to the template's dtype (embed_dtype). A checkpoint saved with one scan_layers value
    restores into the other this way; jit it with the template's shardings."""

    def path_of(key_path):
        return jax.tree_util.keystr(key_path, simple=True, separator=".")

    flat = {path_of(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}

    def leaf(key_path, t):
        path = path_of(key_path)
        if path in flat:  # not a block's, or the same layout
            return flat[path]
        if m := re.search(r"(^|\.)h\.(\d+)\.", path):  # layer i of a stacked source
            return flat[f"{path[: m.end(1)]}h.{path[m.end() :]}"][int(m.group(2))]
        m = sharding.STACKED.search(path)  # stacked from one source per layer
        return jnp.stack(
            [flat[f"{path[: m.end()]}{i}.{path[m.end() :]}"] for i in range(t.shape[0])]
        )

    return jax.tree_util.tree_map_with_path(lambda p, t: leaf(p, t).astype(t.dtype), template)


class Linear(nnx.Linear):
    """nnx.Linear whose bias is added in float32, then cast to the compute dtype: a bf16 bias would
    have its gradient summed over B*T rows in bf16 (10x worse than torch autocast's,
    parity.check_train)."""

    def __call__(self, x):
        return super().__call__(x).astype(self.dtype)


def _promote_keep_bias_f32(args, dtype, specs):
    """Cast x and the kernel to the compute dtype, keep the bias float32; under a mesh, gather the
    kernel over fsdp in the compute dtype (half the bytes in bf16), keeping its tensor-parallel
    split."""
    x, kernel, bias = args
    kernel = sharding.constrain(kernel.astype(dtype), specs[0])
    return x.astype(dtype), kernel, bias if bias is None else sharding.constrain(bias, specs[1])


# module-level functions, not partials: a module's graphdef (jit's cache key) compares them by
# identity
def _promote_column(args, dtype=None):
    return _promote_keep_bias_f32(args, dtype, sharding.COLUMN)


def _promote_row(args, dtype=None):
    return _promote_keep_bias_f32(args, dtype, sharding.ROW)


def _gathered_table(args, dtype=None, inexact=False):
    """An embedding table gathered whole for the lookup, its rows read as float32: a bf16 table's
    gradient is then summed over the tokens in float32 and rounded once, as torch's CUDA embedding
    backward sums it."""
    return tuple(sharding.constrain(a, P(None, None)).astype(jnp.float32) for a in args)


def linear(n_in, n_out, config, rngs, init, row_parallel=False):
    """A Linear of `config`'s compute dtype and biases, its kernel (in, out), the layout of HF's
    Conv1D: weights copy across without a transpose. Under tensor parallelism its kernel computes
    split by output columns, or by input rows (row_parallel: the projections back into the
    residual stream)."""
    return Linear(
        n_in,
        n_out,
        use_bias=config.bias,
        dtype=config.compute_dtype,
        kernel_init=init,
        bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
        promote_dtype=_promote_row if row_parallel else _promote_column,
    )


def embedding(n, dim, rngs, init, dtype="float32"):
    """An nnx.Embed whose table is gathered whole for the lookup under a mesh. A bfloat16 table
    (record 20's) is drawn in float32 and rounded, as torch's .bfloat16() of an initialised one."""

    def table_init(key, shape, param_dtype):
        return init(key, shape, jnp.float32).astype(param_dtype)

    return nnx.Embed(
        n,
        dim,
        embedding_init=table_init,
        param_dtype=dtype,
        promote_dtype=_gathered_table,
        rngs=rngs,
    )


def dropout(x, rate, key):
    """Inverted dropout with an explicit key; identity when key is None (eval) or rate is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# the speedrun's record 5 (archs/record5.py, GPTConfig.arch='speedrun'): modded-nanogpt's
# 2024-10-14_ModernArch

ROTARY_BASE = 10000


def rms_norm(x):
    """torch's F.rms_norm(x, (C,)) without a weight, as record 5 calls it: x / sqrt(mean(x^2) + eps)
    over the last axis, computed in float32 (torch upcasts 16-bit inputs) with eps that type's
    machine epsilon (torch's default, 1.19e-7 for float32 and bfloat16 inputs alike), returned in
    x's dtype."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)  # (..., 1)
    return (xf * jax.lax.rsqrt(ms + jnp.finfo(xf.dtype).eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """The speedrun's norm before attention, the MLP and the head: rms_norm, no params (record 5 has
    no weight)."""

    def __call__(self, x):
        return rms_norm(x)


@functools.cache
def rotary_tables(n, hs):
    """Record 5's rotary tables for positions 0..n-1 and head size hs: (cos, sin), each (n, hs/2)
    bfloat16 numpy, constants of the program. The record's float32 frequencies position *
    base^(-2j/hs), their cos and sin rounded to float32 from float64 on the host, then to bfloat16
    (the record caches them so): XLA's fused cos and sin miss the float32 value by an ulp now and
    then, which moves a bf16 entry by one of its ulps (36 of the record's 65536 did); these equal
    torch's tables, entry for entry, at the record's head size 128."""
    exponents = np.arange(0, hs, 2, dtype=np.float32) / np.float32(hs)
    # (hs/2,)
    inv_freq = np.float32(1) / (float(ROTARY_BASE) ** exponents.astype(np.float64)).astype(
        np.float32
    )
    freqs = np.arange(n, dtype=np.float32)[:, None] * inv_freq  # (n, hs/2), float32
    return tuple(
        f(freqs.astype(np.float64)).astype(np.float32).astype(jnp.bfloat16)
        for f in (np.cos, np.sin)
    )


def rotary(x, cos, sin):
    """Rotary position embedding as record 5 applies it: x (B, T, nh, hs), cos and sin (T, hs/2)
    (rotary_tables' rows of x's positions) -> (B, T, nh, hs) in x's dtype. The head's halves x1, x2
    turn against each other: (x1 cos + x2 sin, -x1 sin + x2 cos). The bf16 tables act as they are:
    bf16 activations rotate in bf16, float32 ones in float32."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hs/2)
    x1, x2 = jnp.split(x, 2, axis=-1)  # (B, T, nh, hs/2) each
    return jnp.concatenate([x1 * cos + x2 * sin, x1 * -sin + x2 * cos], axis=-1).astype(x.dtype)


@functools.cache
def half_truncated_rotary_tables(n, hs):
    """Record 20's rotary tables for positions 0..n-1 and head size hs: (cos, sin), each (n, hs/2)
    float32 numpy. hs/4 frequencies (1/1024)^(j/(hs/4-1)), then hs/4 zeros (half-truncated RoPE:
    those dimensions never turn); the angles position * frequency in float32, as the record's, and
    their cos and sin rounded once from float64."""
    theta = np.arange(n, dtype=np.float32)[:, None] * half_truncated_frequencies(hs)  # float32
    return tuple(f(theta.astype(np.float64)).astype(np.float32) for f in (np.cos, np.sin))


def half_truncated_frequencies(hs):
    """Record 20's hs/2 rotary frequencies, float32, each rounded once from float64. The record's
    torch.linspace(0, 1) on its host's CPU rounds some points the other way (how, depends on the
    CPU's vector width), which moves a frequency by up to ln(1024) ≈ 7 of its ulps: at position p
    the angle by up to p times that (tests/test_speedrun20_parity.py)."""
    freq = (1 / 1024) ** np.linspace(0, 1, hs // 4, dtype=np.float64)
    return np.concatenate([freq.astype(np.float32), np.zeros(hs // 4, np.float32)])


# ------------------------------------------------------------------------------------------------
# the tied head and the loss


def tied_head(x, embedding, dtype, logits_dtype=jnp.float32):
    """(..., C) -> (..., vocab) logits through the token embedding (vocab, C): a matmul in the
    compute dtype with float32 accumulation, its output in `logits_dtype`; under a mesh, the
    embedding split by vocabulary over 'tensor'. The model's loss takes them in the compute dtype,
    as autocast's Linear gives them: the matmul's gradient then runs in it too, where float32 logits
    made both backward matmuls float32 (a fifth of the 124M step on an H100, docs/benchmarks.md).
    Sampling and the scorers take float32."""
    head = sharding.constrain(embedding.astype(dtype), sharding.VOCAB)
    return jnp.einsum("...c,vc->...v", x.astype(dtype), head, preferred_element_type=logits_dtype)


# record 20's FP8 head (by @YouJiacheng): x and the head's weight in e4m3 at scales 2 and 32, the
# logits' gradient in e5m2 at 2^29, each product rescaled by the inverse scales
FP8_SCALES = (2.0, 32.0, 2.0**29)


def _dequantized(a, dtype, scale):
    """a * scale rounded to an FP8 `dtype`, divided back by the scale: the values the FP8 matmul
    multiplies, held exactly in bfloat16 (an FP8 value times a power of two is a bfloat16 value)."""
    scaled = (a * jnp.asarray(scale, a.dtype)).astype(dtype).astype(jnp.bfloat16)
    return scaled * jnp.asarray(1.0 / scale, jnp.bfloat16)


def _fp8_products(spec, a, b):
    """The FP8 matmul on bfloat16 operands with float32 sums: each product of two FP8 values is
    exact in float32, so this is float32's matmul of the same values (up to the order of the sums)
    at bfloat16's speed on an MXU or a GPU's tensor cores (float32 at HIGHEST multiplies on a GPU's
    CUDA cores and in six bfloat16 passes on a TPU's MXU)."""
    # DEFAULT whatever jax_default_matmul_precision says: the operands are exact in one bf16 pass
    return jnp.einsum(
        spec, a, b, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32
    )


def fp8_head(x, w):
    """x (N, C) @ w (V, C)^T through FP8, record 20's lm_head_fp8: x and w rounded to e4m3 (x*2,
    w*32), products summed in float32, the logits in bfloat16; the backward rounds their gradient to
    e5m2 (*2^29), grad x in bfloat16 (then x's dtype, as torch's autograd casts it), grad w in
    float32. Every platform rounds the same and multiplies in bfloat16 (_fp8_products)."""
    return _fp8_matmul(jnp.dtype(x.dtype))(x, w)


@functools.cache
def _fp8_matmul(x_dtype):
    def forward(x, w):
        xs, ws, _ = FP8_SCALES
        x8, w8 = _dequantized(x, jnp.float8_e4m3fn, xs), _dequantized(w, jnp.float8_e4m3fn, ws)
        return _fp8_products("nc,vc->nv", x8, w8).astype(jnp.bfloat16), (x8, w8)

    def backward(residuals, g):
        x8, w8 = residuals
        g8 = _dequantized(g, jnp.float8_e5m2, FP8_SCALES[2])
        grad_x = _fp8_products("nv,vc->nc", g8, w8).astype(jnp.bfloat16)
        return grad_x.astype(x_dtype), _fp8_products("nc,nv->vc", x8, g8)

    matmul = jax.custom_vjp(lambda x, w: forward(x, w)[0])
    matmul.defvjp(forward, backward)
    return matmul


def cross_entropy_terms(logits, targets):
    """(sum of the cross-entropies, their number) in float32 over the targets that are not -1
    (nanoGPT's ignore_index). Logits in a lower dtype are upcast, as torch's cross_entropy does
    under autocast."""
    valid = targets != -1
    nll = token_nll(logits, jnp.where(valid, targets, 0))
    return jnp.sum(jnp.where(valid, nll, 0.0)), jnp.sum(valid)


@jax.custom_vjp
def token_nll(logits, targets):
    """(..., vocab) logits, (...) targets -> (...) float32 cross-entropies, logsumexp - the target's
    logit. Its gradient, softmax - onehot, is written once in the logits' dtype from the logits as
    they are (autodiff would keep a float32 copy of bf16 logits and pass over it several times: 13
    GB a 65,536-token batch)."""
    return token_nll_forward(logits, targets)[0]


def token_nll_forward(logits, targets):
    x = logits.astype(jnp.float32)
    peak = jnp.max(x, axis=-1)
    total = jnp.sum(jnp.exp(x - peak[..., None]), axis=-1)
    target_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    return peak + jnp.log(total) - target_logit, (logits, targets, peak, total)


def token_nll_backward(residuals, g):
    # the softmax as exp(x - max) / sum, as autodiff's: exp(x - logsumexp) carries logsumexp's
    # rounding into every probability (5x the error at logits of scale 5)
    logits, targets, peak, total = residuals
    scaled = jnp.exp(logits.astype(jnp.float32) - peak[..., None]) * (g / total)[..., None]
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]
    return (scaled - jnp.where(onehot, g[..., None], 0.0)).astype(logits.dtype), None


token_nll.defvjp(token_nll_forward, token_nll_backward)


def chunked_terms(x, targets, n, weight, logits_of):
    """cross_entropy_terms of logits_of(weight, x) for x (B, T, C), targets (B, T); with n > 0 the
    logits exist n positions at a time, (B, n, vocab), each chunk's recomputed in the backward pass:
    memory O(B x n x vocab), not (B, T, vocab) logits and their gradient. Chunks cut the time axis
    only, every row in each, so the batch axis keeps its sharding. `weight` (the head's, float32)
    goes in whole and is cast inside: its gradient sums over the chunks in float32."""
    B, T, C = x.shape
    if n == 0 or n >= T:
        return cross_entropy_terms(logits_of(weight, x), targets)
    pad = -T % n  # the last chunk's padding has target -1: ignored
    xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, n, C).swapaxes(0, 1)
    ys = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=-1).reshape(B, -1, n).swapaxes(0, 1)

    @jax.checkpoint  # saves the chunk's inputs only: the backward pass recomputes its logits
    def chunk_nll(weight, x, y):
        return cross_entropy_terms(logits_of(weight, x), y)[0]

    total, _ = jax.lax.scan(
        lambda total, xy: (total + chunk_nll(weight, *xy), None), jnp.float32(0), (xs, ys)
    )
    return total, jnp.sum(targets != -1)


def mean_of(total, count):
    """cross_entropy_terms -> their mean (0 when every target is ignored)."""
    return total / jnp.maximum(count, 1)


def cross_entropy(logits, targets):
    """Mean cross-entropy in float32 over the targets that are not -1 (nanoGPT's ignore_index)."""
    return mean_of(*cross_entropy_terms(logits, targets))
