"""
GPT-2 in JAX (flax nnx), numerically GPT-2's: tanh GELU (or nanoGPT's exact one), LayerNorm eps 1e-5, tied lm_head.
References:
1) OpenAI's GPT-2 TensorFlow implementation: https://github.com/openai/gpt-2/blob/master/src/model.py
2) huggingface/transformers GPT2LMHeadModel (the parity reference), and karpathy/nanoGPT's model.py.
"""

import functools
import math
import re
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import attention
import sharding


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length (HF: n_positions)
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # residual, embedding and attention dropout (HF: resid/embd/attn_pdrop)
    bias: bool = True  # biases in Linears and LayerNorms (GPT-2: True)
    gelu: str = "tanh"  # 'tanh': GPT-2's approximation (HF gelu_new) | 'exact': erf, nanoGPT's F.gelu (HF gelu)
    dtype: str = "float32"  # compute dtype, 'float32' | 'bfloat16'; params are always float32
    # how the run computes, not what it computes (a checkpoint's are ignored on restore, see RUNTIME_FIELDS):
    attention: str = "auto"  # 'xla' | 'cudnn' (NVIDIA) | 'splash' (TPU) | 'auto': the fused kernel where it runs
    remat: str = "none"  # recompute in the backward pass instead of storing: 'none' | 'block' | 'dots' (see REMAT)
    loss_chunk: int = 0  # the loss computes the logits this many positions at a time (all rows); 0: all at once
    scan_layers: bool = False  # the blocks' params stacked on a leading n_layer axis, run by one lax.scan

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.gelu not in ("tanh", "exact"):
            raise ValueError(f"gelu must be 'tanh' (GPT-2) or 'exact' (nanoGPT), got {self.gelu!r}")
        if self.attention not in attention.SETTINGS:
            raise ValueError(f"attention must be one of {', '.join(map(repr, attention.SETTINGS))}, "
                             f"got {self.attention!r}")
        if self.remat not in REMAT:
            raise ValueError(f"remat must be one of {', '.join(map(repr, REMAT))}, got {self.remat!r}")
        if not (isinstance(self.loss_chunk, int) and self.loss_chunk >= 0):
            raise ValueError(f"loss_chunk must be an integer >= 0 (0: no chunks), got {self.loss_chunk!r}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be True or False, got {self.scan_layers!r}")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


# GPTConfig's fields that are choices of the run, not the architecture: a restored checkpoint takes them from
# the current settings (checkpoint.model_config_from_meta), so a run saved on a GPU resumes on a CPU
RUNTIME_FIELDS = ("dtype", "dropout", "attention", "remat", "loss_chunk", "scan_layers")
# remat: what each Block keeps from its forward pass for the backward (the rest is recomputed there), as a
# jax.checkpoint policy
REMAT = {
    "none": None,  # no checkpointing: everything is kept
    "block": jax.checkpoint_policies.nothing_saveable,  # only the block's input: the whole block is recomputed
    # the Linear layers' outputs (matmuls without batch dimensions); attention, GELU, LayerNorm are recomputed
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the attention branch's matmul outputs only (q, k, v and its projection: 4C a token, dots keeps 9C); the MLP's
    # c_fc is recomputed, an extra 8C^2 FLOPs a token a layer (~11% of the step's 72C^2)
    "qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv", "attn_proj"),
}


def normal(std):
    return nnx.initializers.normal(stddev=std)


def layer_norm(config: GPTConfig, rngs: nnx.Rngs):
    # nnx's defaults differ from torch's: eps 1e-6 (GPT-2: 1e-5) and the E[x^2]-E[x]^2 "fast" variance.
    # LayerNorm runs in float32 even in bf16 mode.
    return nnx.LayerNorm(config.n_embd, epsilon=1e-5, use_fast_variance=False, use_bias=config.bias,
                         dtype=jnp.float32, rngs=rngs)


class Linear(nnx.Linear):
    """nnx.Linear whose bias is added in float32, then cast to the compute dtype: a bf16 bias would have its
    gradient summed over B*T rows in bf16 (10x worse than torch autocast's, parity.check_train)."""

    def __call__(self, x):
        return super().__call__(x).astype(self.dtype)


def _promote_keep_bias_f32(args, dtype, specs):
    """Cast x and the kernel to the compute dtype, keep the bias float32; under a mesh, gather the kernel over
    fsdp in the compute dtype (half the bytes in bf16), keeping its tensor-parallel split."""
    x, kernel, bias = args
    kernel = sharding.constrain(kernel.astype(dtype), specs[0])
    return x.astype(dtype), kernel, bias if bias is None else sharding.constrain(bias, specs[1])


# module-level functions, not partials: a module's graphdef (jit's cache key) compares them by identity
def _promote_column(args, dtype=None):
    return _promote_keep_bias_f32(args, dtype, sharding.COLUMN)


def _promote_row(args, dtype=None):
    return _promote_keep_bias_f32(args, dtype, sharding.ROW)


def _gathered_table(args, dtype=None, inexact=False):
    """An embedding table gathered whole for the lookup (float32, as nnx.Embed's default)."""
    return tuple(sharding.constrain(a, P(None, None)) for a in args)


def linear(n_in, n_out, config: GPTConfig, rngs: nnx.Rngs, std=0.02, row_parallel=False):
    # Kernels are (in, out), the layout of HF's Conv1D: weights copy across without a transpose.
    # Under tensor parallelism a kernel computes split by output columns, or by input rows (row_parallel)
    return Linear(n_in, n_out, use_bias=config.bias, dtype=config.compute_dtype, kernel_init=normal(std),
                  bias_init=nnx.initializers.zeros_init(), rngs=rngs,
                  promote_dtype=_promote_row if row_parallel else _promote_column)


def dropout(x, rate, key):
    """Inverted dropout with an explicit key; identity when key is None (eval) or rate is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def explicit_attention(q, k, v, dropout_rate, key):
    """Causal attention with the probabilities materialized, so that dropout can act on them.
    q, k, v (B, T, nh, hs) -> (B, T, nh, hs); scores and softmax in float32."""
    T, hs = q.shape[1], q.shape[3]
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hs)
    att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf)
    att = dropout(jax.nn.softmax(att, axis=-1), dropout_rate, key).astype(v.dtype)  # (B, nh, T, T)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v)


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.attention = config.attention  # the kernel is chosen per call shape, for the mesh in context
        self.c_attn = linear(config.n_embd, 3 * config.n_embd, config, rngs)  # q, k, v for all heads
        # residual projection: GPT-2's scaled init, 0.02/sqrt(2 * n_layer)
        self.c_proj = linear(config.n_embd, config.n_embd, config, rngs, std=0.02 / math.sqrt(2 * config.n_layer),
                             row_parallel=True)

    def qkv(self, x):
        B, T, C = x.shape
        q, k, v = jnp.split(checkpoint_name(self.c_attn(x), "qkv"), 3, axis=-1)  # (B, T, C) each
        return (a.reshape(B, T, self.n_head, C // self.n_head) for a in (q, k, v))  # (B, T, nh, hs)

    def __call__(self, x, key=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x)  # (B, T, nh, hs)
        if key is None or self.dropout == 0.0:
            platform = sharding.target_platform()
            # a GPU is compiled for on itself: its capability is the host's
            capability = attention.cuda_capability(jax.devices()[0]) if platform == "gpu" else None
            kernel = attention.choose(self.attention, platform=platform, dtype=q.dtype, seq_len=T,
                                      head_size=C // self.n_head, capability=capability)
            y = attention.causal_attention(q, k, v, kernel)  # (B, T, nh, hs)
        else:
            y = explicit_attention(q, k, v, self.dropout, key)
            key = jax.random.fold_in(key, 1)
        y = checkpoint_name(self.c_proj(y.reshape(B, T, C)), "attn_proj")
        return dropout(y, self.dropout, key)

    def decode(self, x, kv, pos):
        """x (B, T, C) at positions pos..pos+T-1, kv this layer's cache (k, v), each (B * nh, S, hs):
        write the new keys and values in at pos, attend to every cached position <= the query's."""
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = (a.transpose(0, 2, 1, 3).reshape(B * self.n_head, T, hs) for a in self.qkv(x))  # (B*nh, T, hs)
        k, v = (jax.lax.dynamic_update_slice_in_dim(c, a.astype(c.dtype), pos, axis=1) for c, a in zip(kv, (k, v)))
        # dot_product_attention's math, spelled out: with its (B, S, nh, hs) layout XLA:CPU copied the
        # whole cache every step (2x slower at batch 8); in this layout the cache feeds the dots as it is
        att = jnp.einsum("zqd,zkd->zqk", q, k, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(hs))
        mask = jnp.arange(k.shape[1])[None, :] <= pos + jnp.arange(T)[:, None]  # (T, S): causal, absolute positions
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1).astype(v.dtype)  # (B*nh, T, S), float32 softmax
        y = jnp.einsum("zqk,zkd->zqd", att, v).reshape(B, self.n_head, T, hs).transpose(0, 2, 1, 3)  # (B, T, nh, hs)
        return self.c_proj(y.reshape(B, T, C)), (k, v)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.dropout = config.dropout
        self.approximate_gelu = config.gelu == "tanh"
        self.c_fc = linear(config.n_embd, 4 * config.n_embd, config, rngs)
        self.c_proj = linear(4 * config.n_embd, config.n_embd, config, rngs, std=0.02 / math.sqrt(2 * config.n_layer),
                             row_parallel=True)

    def __call__(self, x, key=None):
        # GPT-2's gelu is the tanh approximation (HF "gelu_new"); nanoGPT's is the exact erf GELU (config.gelu)
        B, T, C = x.shape
        # 2-D matmuls: XLA:CPU fuses the GELU into a (B, T, C) matmul badly (4x slower); free elsewhere
        h = jax.nn.gelu(self.c_fc(x.reshape(B * T, C)), approximate=self.approximate_gelu)  # (B*T, 4C)
        return dropout(self.c_proj(h), self.dropout, key).reshape(B, T, C)


@jax.custom_vjp
def fusion_barrier_in_grad(x):
    """Identity whose backward passes the cotangent through a conditional, a fusion boundary XLA:CPU keeps,
    so that it is computed once, into a buffer. At each block's input that is the residual stream's gradient,
    the sum of every later block's contribution: left alone, XLA:CPU fuses that sum into each consumer and
    recomputes it there, a cost quadratic in depth (~10 ms a step for the 4-layer baby model, 1/8 of it)."""
    return x


def _barrier_bwd(_, g):
    # both branches give g; the predicate depends on the data, so XLA cannot fold the conditional away
    return (jax.lax.cond(g.ravel()[0] > 0, lambda a, b: a, lambda a, b: b, g, g),)


fusion_barrier_in_grad.defvjp(lambda x: (x, None), _barrier_bwd)


def remat(f, policy):
    """jax.checkpoint(f, policy=policy): the backward pass recomputes what the policy does not save. On XLA:CPU that
    alone saves nothing (measured: the same compiled temporaries): its pipeline drops jax's optimization barriers
    early, CSE merges the recomputation back into the forward pass, and without CSE the scheduler still runs it
    there. So on CPU the backward runs inside a conditional on the output's cotangent, as fusion_barrier_in_grad:
    a boundary CSE does not cross, which cannot start before the backward pass reaches it."""
    f = jax.checkpoint(f, policy=policy)
    if sharding.target_platform() != "cpu":  # jax's remat as used on GPU/TPU; a conditional costs a host round trip
        return f

    @jax.custom_vjp
    def g(*args):
        return f(*args)

    def bwd(f_vjp, ct):  # f_vjp holds what the policy saved; both branches recompute the rest, then backpropagate
        return jax.lax.cond(ct.ravel()[0] > 0, lambda f, g: f(g), lambda f, g: f(g), f_vjp, ct)

    g.defvjp(lambda *args: jax.vjp(f, *args), bwd)
    return g


def run_block(block, x, key, remat_policy):
    """block(x, key); remat_policy (an entry of REMAT, not 'none') has its forward pass recomputed in the backward."""
    graphdef, state = nnx.split(block)
    return block_fn(graphdef, remat_policy)(state, x, key)


def block_fn(graphdef, remat_policy):
    """(block state, x, key) -> the block's output; remat_policy None: everything kept for the backward."""
    def f(state, x, key):
        return nnx.merge(graphdef, state)(x, key)
    return f if remat_policy is None else remat(f, remat_policy)


def stack_blocks(blocks):
    """One Block whose every param has a leading layer axis (scan_layers), from a list of Blocks."""
    graphdef = nnx.split(blocks[0])[0]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.split(b)[1] for b in blocks)))


def relayout_blocks(tree, template):
    """`tree` (params, or an optimizer state holding them) in the layout of the blocks in `template` (the same tree
    with the blocks stacked, or not: scan_layers): h.{i}.x <-> row i of h.x. A checkpoint saved with one
    scan_layers value restores into the other this way; jit it with the template's shardings."""
    def path_of(key_path):
        return jax.tree_util.keystr(key_path, simple=True, separator=".")

    flat = {path_of(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}

    def leaf(key_path, t):
        path = path_of(key_path)
        if path in flat:  # not a block's, or the same layout
            return flat[path]
        if m := re.search(r"(^|\.)h\.(\d+)\.", path):  # layer i of a stacked source
            return flat[f"{path[:m.end(1)]}h.{path[m.end():]}"][int(m.group(2))]
        m = sharding.STACKED.search(path)  # stacked from one source per layer
        return jnp.stack([flat[f"{path[:m.end()]}{i}.{path[m.end():]}"] for i in range(t.shape[0])])

    return jax.tree_util.tree_map_with_path(leaf, template)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.ln_1 = layer_norm(config, rngs)
        self.attn = CausalSelfAttention(config, rngs)
        self.ln_2 = layer_norm(config, rngs)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, key=None):
        # the residual stream stays float32; each branch computes in the compute dtype
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        x = sharding.constrain_batch(x)  # rows over data x fsdp under a mesh: weights move, activations don't
        if sharding.target_platform() == "cpu":  # on GPU a conditional costs a host round trip; XLA:GPU needs no help
            x = fusion_barrier_in_grad(x)
        x = x + self.attn(self.ln_1(x), k_attn).astype(x.dtype)
        x = x + self.mlp(self.ln_2(x), k_mlp).astype(x.dtype)
        return x

    def decode(self, x, kv, pos):
        y, kv = self.attn.decode(self.ln_1(x), kv, pos)
        x = x + y.astype(x.dtype)
        return x + self.mlp(self.ln_2(x)).astype(x.dtype), kv


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.config = config
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, embedding_init=normal(0.02),
                             promote_dtype=_gathered_table, rngs=rngs)
        self.wpe = nnx.Embed(config.block_size, config.n_embd, embedding_init=normal(0.02),
                             promote_dtype=_gathered_table, rngs=rngs)
        blocks = [Block(config, rngs) for _ in range(config.n_layer)]  # the same draws, scanned or not
        self.h = stack_blocks(blocks) if config.scan_layers else nnx.List(blocks)
        self.ln_f = layer_norm(config, rngs)
        # no lm_head parameter: the head is wte itself (weight tying), see logits()

    def hidden_states(self, idx, key=None):
        """Token ids (B, T) -> the residual stream after each block ([(B, T, C)] * n_layer, or (n_layer, B, T, C)
        with scan_layers), then ln_f's output."""
        B, T = idx.shape
        check_tokens(idx, self.config)
        x = self.wte(idx) + self.wpe(jnp.arange(T))  # (B, T, C), float32
        keys = jax.random.split(key, self.config.n_layer + 1) if key is not None else [None] * (self.config.n_layer + 1)
        x = dropout(x, self.config.dropout, keys[0])
        if self.config.scan_layers:  # one block compiled, whatever the depth
            graphdef, stacked = nnx.split(self.h)
            block = block_fn(graphdef, REMAT[self.config.remat])

            def layer(x, state_key):
                x = block(state_key[0], x, state_key[1])
                return x, x
            x, states = jax.lax.scan(layer, x, (stacked, None if key is None else keys[1:]))
            return states, self.ln_f(x)
        states = []
        for block, k in zip(self.h, keys[1:]):
            x = block(x, k) if self.config.remat == "none" else run_block(block, x, k, REMAT[self.config.remat])
            states.append(x)
        return states, self.ln_f(x)

    def logits(self, x):
        """(..., C) -> (..., vocab) float32, through the tied wte (bf16 matmul, float32 accumulation)."""
        return tied_head(x, self.wte.embedding[...], self.config.compute_dtype)

    def loss_terms(self, x, targets):
        """ln_f's output x (B, T, C), targets (B, T) -> cross_entropy_terms of their logits. With loss_chunk > 0
        the logits exist loss_chunk positions at a time, (B, loss_chunk, vocab), and each chunk's are recomputed
        in the backward pass: memory O(B x loss_chunk x vocab), not (B, T, vocab) float32 logits and their
        gradient. Chunks cut the time axis only, every row in each, so the batch axis keeps its sharding."""
        B, T, C = x.shape
        n, cdt, embedding = self.config.loss_chunk, self.config.compute_dtype, self.wte.embedding[...]
        if n == 0 or n >= T:
            return cross_entropy_terms(tied_head(x, embedding, cdt), targets)
        pad = -T % n  # the last chunk's padding has target -1: ignored
        xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, n, C).swapaxes(0, 1)  # (chunks, B, n, C)
        ys = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=-1).reshape(B, -1, n).swapaxes(0, 1)  # (chunks, B, n)

        # the float32 embedding goes in, cast inside: its gradient then sums over the chunks in float32
        @jax.checkpoint  # saves the chunk's inputs only: the backward pass recomputes its logits
        def chunk_nll(embedding, x, y):
            return cross_entropy_terms(tied_head(x, embedding, cdt), y)[0]

        total, _ = jax.lax.scan(lambda total, xy: (total + chunk_nll(embedding, *xy), None), jnp.float32(0), (xs, ys))
        return total, jnp.sum(targets != -1)

    def loss(self, idx, targets, *, key=None):
        """The mean cross-entropy of idx (B, T) against targets (B, T) (-1 ignored), without returning the logits:
        training's path, in chunks of loss_chunk positions (see loss_terms). `key` turns dropout on."""
        _, x = self.hidden_states(idx, key)
        return mean_of(*self.loss_terms(x, targets))

    def __call__(self, idx, targets=None, *, key=None):
        """idx (B, T) int -> logits (B, T, vocab), and the mean cross-entropy if targets (B, T) are given
        (targets == -1 are ignored). `key` turns dropout on (training); None means eval."""
        _, x = self.hidden_states(idx, key)
        logits = self.logits(x)  # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, cross_entropy(logits, targets)

    def decode(self, idx, cache, pos):
        """Forward token ids idx (B, T) at positions pos..pos+T-1 through the KV cache (one (k, v) per
        layer, see init_cache) -> (ln_f output (B, T, C), the cache with their keys and values written in)."""
        T = idx.shape[1]
        # positions past block_size only occur in the padding rows of a prefill chunk: clamp them (an
        # out-of-range take would give NaNs, and NaN * 0 attention weight is still NaN)
        x = self.wte(idx) + self.wpe(jnp.minimum(pos + jnp.arange(T), self.config.block_size - 1))  # (B, T, C)
        if self.config.scan_layers:
            graphdef, stacked = nnx.split(self.h)

            def layer(x, state_kv):
                x, kv = nnx.merge(graphdef, state_kv[0]).decode(x, state_kv[1], pos)
                return x, kv
            x, cache = jax.lax.scan(layer, x, (stacked, cache))
            return self.ln_f(x), cache
        new_cache = []
        for block, kv in zip(self.h, cache):
            x, kv = block.decode(x, kv, pos)
            new_cache.append(kv)
        return self.ln_f(x), new_cache

    def init_cache(self, batch_size, length):
        """[(k, v)] * n_layer, zeros of shape (B * nh, S, hs) in the compute dtype; with scan_layers one (k, v) of
        shape (n_layer, B * nh, S, hs)."""
        c = self.config
        shape = (batch_size * c.n_head, length, c.n_embd // c.n_head)
        if c.scan_layers:
            return tuple(jnp.zeros((c.n_layer, *shape), c.compute_dtype) for _ in "kv")
        return [(jnp.zeros(shape, c.compute_dtype), jnp.zeros(shape, c.compute_dtype)) for _ in range(c.n_layer)]

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, *, key=None,
                 use_cache=True, vocab_limit=None, on_token=None, return_logits=False):
        """Take a conditioning sequence of indices idx (B, T) and complete it max_new_tokens times, feeding
        the predictions back in -> (B, T + max_new_tokens) numpy int32. As nanoGPT: logits / temperature,
        then top_k, then (ours) top_p; once the sequence outgrows block_size the model conditions on its
        last block_size tokens. temperature 0 is greedy (argmax, no key needed); otherwise `key` drives
        the sampling: same key, same tokens, cache or not. The prompt is prefilled into a KV cache once,
        then one token per step; use_cache=False runs the full forward every step instead (the reference).
        vocab_limit: sample only ids below it (a padded vocabulary's extra ids decode to nothing).
        on_token(ids (B,)) is called on the host as each step's tokens come (streaming).
        return_logits: also return each step's raw logits (B, max_new_tokens, vocab), float32."""
        idx = np.asarray(idx)
        V = self.config.vocab_size
        if idx.ndim != 2 or idx.shape[1] < 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"expected prompt token ids of shape (batch, time >= 1), got {idx.dtype} {idx.shape}")
        if idx.min() < 0 or idx.max() >= V:
            raise ValueError(f"prompt token ids must be in [0, {V}), got min {idx.min()}, max {idx.max()}")
        if not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        check_sampling(temperature, top_k, top_p)
        if key is None and temperature > 0:
            raise ValueError("sampling (temperature > 0) needs a PRNG key: key=jax.random.key(seed)")
        if vocab_limit is not None and not 0 < vocab_limit <= V:
            raise ValueError(f"vocab_limit must be in [1, {V}], got {vocab_limit}")
        B, T = idx.shape
        buf = np.zeros((B, T + max_new_tokens), np.int32)  # prompt, then the tokens as they are sampled
        buf[:, :T] = idx
        sampling = (float(temperature), top_k, None if top_p in (None, 1.0) else float(top_p), vocab_limit)
        out, logits = _generate(self, jnp.asarray(buf), jnp.int32(T), jax.random.key(0) if key is None else key,
                                sampling=sampling, use_cache=use_cache, on_token=on_token, return_logits=return_logits)
        return (np.asarray(out), np.asarray(logits[:, :max_new_tokens])) if return_logits else np.asarray(out)

    def num_params(self, non_embedding=True):
        """Parameter count. As nanoGPT, non_embedding subtracts the position embeddings only: the token
        embeddings are also the lm_head weights, so they stay counted."""
        n = sum(p.size for p in jax.tree.leaves(nnx.state(self, nnx.Param)))
        return n - self.wpe.embedding.size if non_embedding else n

    def crop_block_size(self, block_size):
        """Shrink the context length, e.g. to finetune GPT-2 (1024) with a shorter block_size."""
        if block_size > self.config.block_size:
            raise ValueError(f"cannot grow block_size from {self.config.block_size} to {block_size}")
        self.config = GPTConfig(**{**asdict(self.config), "block_size": block_size})
        self.wpe.embedding = nnx.Param(self.wpe.embedding[:block_size])
        self.wpe.num_embeddings = block_size

    def estimate_mfu(self, fwdbwd_per_iter, dt, devices=None):
        """Model FLOPs utilization: achieved FLOP/s over the bf16 peak of the devices in use (nanoGPT's
        formula, PaLM appendix B). `fwdbwd_per_iter` counts sequences over all devices. None when the
        peak of a device is unknown (CPU), rather than a made-up number."""
        devices = jax.devices() if devices is None else devices
        peak = [peak_flops(d) for d in devices]
        if None in peak:
            return None
        return self.flops_per_token() * self.config.block_size * fwdbwd_per_iter / dt / sum(peak)

    def flops_per_token(self):
        """Training FLOPs (forward and backward) per token at full context (flops_per_token below)."""
        c = self.config
        return flops_per_token(self.num_params(), c.n_layer, c.n_head, c.n_embd, c.block_size)

    @classmethod
    def from_pretrained(cls, name_or_path, mesh=None, **settings):
        """GPT-2 weights from the HF hub by name (gpt2, gpt2-medium, gpt2-large, gpt2-xl; the local HF
        cache is used when present), a local HF directory (as `save_pretrained` writes it) or a nanoGPT
        ckpt.pt (the file or its out_dir). No torch, except for a .pt or a pytorch_model.bin (weights.py). With a
        `mesh`, each tensor goes straight into its shards (sharding.PARAM_SPECS).
        settings: GPTConfig's run choices (RUNTIME_FIELDS: dtype, dropout, attention, remat, loss_chunk)."""
        from weights import load_pretrained

        return load_pretrained(name_or_path, mesh=mesh, **settings)[0]

    def save_pretrained(self, out_dir):
        """Write an HF GPT-2 directory (config.json + model.safetensors) that
        transformers.GPT2LMHeadModel.from_pretrained(out_dir) loads."""
        from weights import save_hf

        save_hf(self, out_dir)


def check_tokens(idx, config: GPTConfig):
    """Bad input fails here, before any gather: JAX clamps out-of-range indices silently."""
    if idx.ndim != 2:
        raise ValueError(f"expected token ids of shape (batch, time), got shape {idx.shape}")
    if idx.shape[1] > config.block_size:
        raise ValueError(f"cannot forward a sequence of length {idx.shape[1]}: block_size is {config.block_size}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"token ids must be integers, got {idx.dtype}")
    if not isinstance(idx, jax.core.Tracer) and idx.size:  # values are only known outside jit
        values = np.asarray(idx)  # numpy, so that a concrete array closed over by a jit stays concrete
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"token ids must be in [0, {config.vocab_size}), got min {lo}, max {hi}")


def tied_head(x, embedding, dtype):
    """(..., C) -> (..., vocab) float32 logits through the token embedding (vocab, C): a matmul in the compute
    dtype with float32 accumulation; under a mesh, the embedding split by vocabulary over 'tensor'."""
    head = sharding.constrain(embedding.astype(dtype), sharding.VOCAB)
    return jnp.einsum("...c,vc->...v", x.astype(dtype), head, preferred_element_type=jnp.float32)


def cross_entropy_terms(logits, targets):
    """(sum of the cross-entropies, their number) in float32 over the targets that are not -1 (nanoGPT's
    ignore_index)."""
    logits = logits.astype(jnp.float32)
    valid = targets != -1
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(valid, logz - target_logit, 0.0)), jnp.sum(valid)


def mean_of(total, count):
    """cross_entropy_terms -> their mean (0 when every target is ignored)."""
    return total / jnp.maximum(count, 1)


def cross_entropy(logits, targets):
    """Mean cross-entropy in float32 over the targets that are not -1 (nanoGPT's ignore_index)."""
    return mean_of(*cross_entropy_terms(logits, targets))


# ---------------------------------------------------------------------------------------------------
# Generation. One jit per (batch size, total length) and sampling settings: the prompt length is traced,
# the loop runs inside the jit, so neither a new prompt nor a new token recompiles anything.
PREFILL_CHUNK = 64  # prompt tokens per prefill step: prompts of any length share one compiled prefill


def check_sampling(temperature, top_k, top_p):
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not (isinstance(top_k, int) and top_k > 0):
        raise ValueError(f"top_k must be a positive integer (or None for no top-k), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 keeps everything), got {top_p}")


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """(B, V) logits -> logits / temperature with the tokens top_k and top_p remove set to -inf.
    top_k keeps the k largest (and ties with the k-th, as nanoGPT's torch.topk test); top_p then keeps
    the smallest set of most likely tokens whose probability reaches top_p: a token stays when the mass
    of the tokens more likely than it is < top_p (HF's TopPLogitsWarper rule)."""
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        # the k-th largest as the min of the top k: slicing the last one out of top_k made XLA:CPU sort the
        # whole vocabulary (~13 ms a step at 50257, against 0.2 ms)
        kth = jnp.min(jax.lax.top_k(logits, top_k)[0], axis=-1, keepdims=True)  # (B, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        desc = -jnp.sort(-logits, axis=-1)  # (B, V), most likely first
        probs = jax.nn.softmax(desc, axis=-1)
        n_keep = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)  # (B, 1), >= 1
        cutoff = jnp.take_along_axis(desc, n_keep - 1, axis=-1)  # (B, 1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


@functools.partial(nnx.jit, static_argnames=("sampling", "use_cache", "on_token", "return_logits"))
def _generate(model, buf, prompt_len, key, *, sampling, use_cache, on_token, return_logits):
    """buf (B, L): the prompt in buf[:, :prompt_len]; fills buf[:, prompt_len:]. See GPT.generate."""
    temperature, top_k, top_p, vocab_limit = sampling
    bs = model.config.block_size
    B, L = buf.shape
    W = min(L, bs)  # the longest context the model ever sees

    def logits_full(buf, n):
        """nanoGPT's step: forward the last <= block_size tokens before position n, keep the last logits."""
        start = jnp.maximum(n - W, 0)
        _, x = model.hidden_states(jax.lax.dynamic_slice_in_dim(buf, start, W, axis=1))  # (B, W, C)
        # past n sit padding or not-yet-sampled tokens: causal attention keeps them out of position n-1
        return model.logits(jax.lax.dynamic_index_in_dim(x, n - 1 - start, axis=1, keepdims=False))  # (B, V)

    def logits_cached(buf, cache, n):
        """feed token n-1 at position n-1 through the cache, which holds positions 0..n-2."""
        x, cache = model.decode(jax.lax.dynamic_slice_in_dim(buf, n - 1, 1, axis=1), cache, n - 1)
        return model.logits(x[:, 0]), cache  # (B, V)

    cache = None
    if use_cache:
        # prefill every prompt token but the last (the first step feeds that one), in fixed-size chunks;
        # the cache is a whole number of chunks long so no chunk's write is clipped
        C = min(PREFILL_CHUNK, W)
        S = -(-W // C) * C
        cache = model.init_cache(B, S)
        prompt = jnp.pad(buf[:, :W], ((0, 0), (0, S - W)))  # (B, S)
        n_prefill = jnp.where(prompt_len <= bs, prompt_len - 1, 0)  # a prompt longer than block_size never uses it

        def prefill(j, cache):
            return model.decode(jax.lax.dynamic_slice_in_dim(prompt, j * C, C, axis=1), cache, j * C)[1]
        cache = jax.lax.fori_loop(0, (n_prefill + C - 1) // C, prefill, cache)

    V = model.config.vocab_size if vocab_limit is None else vocab_limit
    all_logits = jnp.zeros((B, L if return_logits else 0, model.config.vocab_size), jnp.float32)

    def step(i, carry):
        buf, cache, all_logits = carry
        n = prompt_len + i  # the position this step samples
        if not use_cache:
            logits = logits_full(buf, n)
        elif L <= bs:
            logits, cache = logits_cached(buf, cache, n)
        else:  # the cache serves until the sequence outgrows block_size; then the window slides, positions shift
            logits, cache = jax.lax.cond(n <= bs, logits_cached, lambda b, c, n: (logits_full(b, n), c), buf, cache, n)
        if return_logits:
            all_logits = jax.lax.dynamic_update_slice_in_dim(all_logits, logits[:, None], i, axis=1)
        logits = logits[:, :V]
        if temperature == 0:
            tok = jnp.argmax(logits, axis=-1)  # (B,)
        else:
            tok = jax.random.categorical(jax.random.fold_in(key, i), filter_logits(logits, temperature, top_k, top_p))
        tok = tok.astype(buf.dtype)
        if on_token is not None:
            jax.debug.callback(on_token, tok, ordered=True)
        return jax.lax.dynamic_update_slice_in_dim(buf, tok[:, None], n, axis=1), cache, all_logits

    buf, _, all_logits = jax.lax.fori_loop(0, L - prompt_len, step, (buf, cache, all_logits))
    return buf, all_logits  # all_logits (B, L, vocab): step i's in row i


# bf16 dense peak FLOP/s per device, by substrings of jax's device_kind (first match wins)
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12),  # v6e (Trillium)
    ("TPU v6e", 918e12),
]


def flops_per_token(n_params, n_layer, n_head, n_embd, block_size):
    """nanoGPT's estimate (PaLM appendix B): 6N + 12·L·H·Q·T, N without the position embeddings."""
    return 6 * n_params + 12 * n_layer * n_head * (n_embd // n_head) * block_size


def peak_flops(device):
    """A JAX device's bf16 peak FLOP/s, or None where unknown (CPU)."""
    return peak_flops_of(getattr(device, "device_kind", ""))


def peak_flops_of(kind):
    """By a device's name (jax's device_kind, torch.cuda.get_device_name())."""
    return next((flops for name, flops in PEAK_BF16_FLOPS if name in kind), None)
