"""
nanochat's attention (karpathy/nanochat, nanochat/gpt.py's CausalSelfAttention; archs/nanochat.py
builds its GPT from it, parity/nanochat_reference.py is its torch side): grouped key/value heads
(GQA), rotary positions at base 100000 turned by nanochat's sign, QK-norm and then both scaled by
1.2, a value embedding mixed into v by a gate per key/value head, and a causal sliding window per
layer as nanochat's SDPA fallback (nanochat/flash_attention.py) computes it: a query sees the keys
0 to `window` positions behind it. It runs in XLA with its scores materialised under the window's
mask; no fused kernel takes its windows yet (NanochatAttention.KERNEL).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from archs.record5 import ZERO
from compute.layers import linear, rms_norm, rotary
from configurator import UsageError
from model import GPTConfig

ROTARY_BASE = 100000  # nanochat's rotary base (GPT-2 era models: 10000)
QK_SCALE = 1.2  # q and k times 1.2 after the norm: sharper attention (nanochat's)
VE_GATE_CHANNELS = 12  # the value embedding's gate reads the block input's first 12 channels
VE_GATE_RANGE = 3.0  # the gate is 3 * sigmoid(.): in (0, 3), 1.5 at zero
WINDOW_TILE = 128  # the short window rounds up to FA3's tile: a multiple of 128 tokens


def kv_heads(config: GPTConfig):
    """The key/value heads: n_kv_head, or one per query head (0)."""
    return config.n_kv_head or config.n_head


def has_ve(layer, n_layer):
    """Whether `layer` mixes in a value embedding: every other layer, the last one always."""
    return layer % 2 == (n_layer - 1) % 2


def window_sizes(config: GPTConfig):
    """Each layer's window, the keys behind a query it sees, as nanochat's _compute_window_sizes:
    window_pattern (case-blind) tiled over the layers, L the whole block_size (nanochat's
    sequence_len), S a quarter of it rounded up to whole 128-token tiles (2048 -> 512 -> 512; 64 ->
    128), and the last layer always L."""
    long = config.block_size
    short = -(-long // 4 // WINDOW_TILE) * WINDOW_TILE
    pattern = config.window_pattern.upper()
    sizes = [long if pattern[i % len(pattern)] == "L" else short for i in range(config.n_layer)]
    return sizes[:-1] + [long]


def uniform(low, high):
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, low, high)


def matrix_bound(n_embd):
    """nanochat's bound for the blocks' matrices: U(-s, s) with s = sqrt(3 / n_embd), the std of
    N(0, 1/sqrt(n_embd)) without its outliers."""
    return math.sqrt(3) / math.sqrt(n_embd)


@functools.cache
def rotary_tables(n, hs):
    """nanochat's rotary tables for positions 0..n-1 and head size hs: (cos, sin), each (n, hs/2)
    float32 numpy. Frequencies 1 / 100000^(2j/hs) and the angles position * frequency in float32,
    as its _precompute_rotary_embeddings; each power, cos and sin rounded once from float64 (torch's
    float32 ones are within an ulp of it)."""
    exponents = np.arange(0, hs, 2, dtype=np.float32) / np.float32(hs)
    powers = (float(ROTARY_BASE) ** exponents.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1) / powers
    freqs = np.arange(n, dtype=np.float32)[:, None] * inv_freq  # (n, hs/2), float32
    return tuple(f(freqs.astype(np.float64)).astype(np.float32) for f in (np.cos, np.sin))


def window_attention(q, k, v, q_pos, k_pos, window):
    """q (B, Tq, H, hs), k and v (B, Tk, Hkv, hs) at positions q_pos (Tq,) and k_pos (Tk,) ->
    (B, Tq, H, hs) in v's dtype: softmax(q k^T / sqrt(hs)) v over the keys 0..window positions
    behind each query, scores and softmax in float32. Query head h reads key/value head h // (H /
    Hkv), as torch's scaled_dot_product_attention(enable_gqa=True)."""
    B, Tq, H, hs = q.shape
    Hkv = k.shape[2]
    behind = q_pos[:, None] - k_pos[None, :]  # (Tq, Tk)
    mask = (behind >= 0) & (behind <= window)
    q = q.reshape(B, Tq, Hkv, H // Hkv, hs)  # each key/value head's group of query heads
    att = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
    att = jax.nn.softmax(jnp.where(mask, att / math.sqrt(hs), -jnp.inf), axis=-1)
    y = jnp.einsum("bhgqk,bkhd->bqhgd", att.astype(v.dtype), v)  # (B, Tq, Hkv, G, hs)
    return y.reshape(B, Tq, H, hs)


class NanochatAttention(nnx.Module):
    KERNEL = "xla"  # the attention settings it runs: XLA's, under the window's mask

    def __init__(self, config: GPTConfig, rngs: nnx.Rngs, layer, window):
        C, H = config.n_embd, config.n_head
        hs, Hkv = C // H, kv_heads(config)
        self.n_head, self.n_kv_head, self.window = H, Hkv, window
        s = matrix_bound(C)
        self.c_q = linear(C, H * hs, config, rngs, uniform(-s, s))
        self.c_k = linear(C, Hkv * hs, config, rngs, uniform(-s, s))
        self.c_v = linear(C, Hkv * hs, config, rngs, uniform(-s, s))
        self.c_proj = linear(C, C, config, rngs, ZERO, row_parallel=True)  # zero, as nanochat's
        # a small positive init: the gates start a little above their midpoint
        gate = has_ve(layer, config.n_layer)
        self.ve_gate = (
            linear(VE_GATE_CHANNELS, Hkv, config, rngs, uniform(0.0, 0.02)) if gate else None
        )

    def qkv(self, x, ve, pos=0, length=None):
        """x (B, T, C) at positions pos..pos+T-1 of `length` (default T; pos may be traced), ve its
        value embedding (B, T, Hkv * hs) or None -> q (B, T, H, hs), k and v (B, T, Hkv, hs): v plus
        the gated ve (ResFormer's value residual), q and k rotated, RMS-normed, times 1.2."""
        B, T, C = x.shape
        hs = C // self.n_head
        q = self.c_q(x).reshape(B, T, self.n_head, hs)
        k, v = (a(x).reshape(B, T, self.n_kv_head, hs) for a in (self.c_k, self.c_v))
        if ve is not None:
            gate = VE_GATE_RANGE * jax.nn.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate[..., None] * ve.reshape(v.shape).astype(v.dtype)  # gate (B, T, Hkv)
        cos, sin = (  # (T, hs/2), in the compute dtype as nanochat's tables
            jax.lax.dynamic_slice_in_dim(jnp.asarray(t, x.dtype), pos, T)
            for t in rotary_tables(length or T, hs)
        )
        q, k = (rms_norm(rotary(a, cos, sin)) * QK_SCALE for a in (q, k))
        return q, k, v

    def __call__(self, x, ve):
        """x (B, T, C) -> (B, T, C): causal attention within this layer's window."""
        q, k, v = self.qkv(x, ve)
        positions = jnp.arange(x.shape[1])
        y = window_attention(q, k, v, positions, positions, self.window)
        return self.c_proj(y.reshape(x.shape))

    def decode(self, x, ve, kv, pos):
        """x (B, T, C) at positions pos..pos+T-1, kv this layer's cache (k, v), each (B, S, Hkv,
        hs): the new keys and values written in at pos, each query attending to the cached
        positions within its window -> ((B, T, C), the cache)."""
        T, S = x.shape[1], kv[0].shape[1]
        q, k, v = self.qkv(x, ve, pos, S)
        k, v = (
            jax.lax.dynamic_update_slice_in_dim(c, a.astype(c.dtype), pos, axis=1)
            for c, a in zip(kv, (k, v))
        )
        y = window_attention(q, k, v, pos + jnp.arange(T), jnp.arange(S), self.window)
        return self.c_proj(y.reshape(x.shape)), (k, v)


def check_run(config: GPTConfig):
    """One line for an attention setting its windows cannot run with."""
    if config.attention not in ("auto", NanochatAttention.KERNEL):
        raise UsageError(
            f"attention={config.attention!r} cannot run arch='nanochat': its sliding windows run "
            "in XLA under their mask for now; use attention='auto' or 'xla'"
        )
