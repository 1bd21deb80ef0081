"""
GPT-2 in JAX (flax nnx), numerically GPT-2's: tanh GELU (or nanoGPT's exact one), LayerNorm eps
1e-5, tied lm_head. arch='speedrun' is modded-nanogpt's record 5 in the same modules: rotary,
QK-norm, weightless RMSNorm, ReLU^2, zero-initialised projections, no position embedding, no biases.
References:
1) OpenAI's GPT-2 TensorFlow implementation:
   https://github.com/openai/gpt-2/blob/master/src/model.py
2) huggingface/transformers GPT2LMHeadModel (the parity reference), and karpathy/nanoGPT's model.py.
3) KellerJordan/modded-nanogpt's records/track_1_short/2024-10-14_ModernArch/train_gpt2.py, the
   speedrun's (in parity/speedrun_reference.py).
"""

import math
from dataclasses import asdict, dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import attention
import generate
import pretrained
import sharding
import weights
from attention import explicit_attention
from configurator import UsageError
from layers import (
    REMAT,
    RMSNorm,
    block_fn,
    cross_entropy,
    cross_entropy_terms,
    dropout,
    fusion_barrier_in_grad,
    mean_of,
    rms_norm,
    rotary,
    rotary_tables,
    run_block,
    stack_blocks,
    tied_head,
)


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length (HF: n_positions)
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # residual, embedding and attention dropout (HF: resid/embd/attn_pdrop)
    bias: bool = True  # biases in Linears and LayerNorms (GPT-2: True)
    # 'tanh': GPT-2's approximation (HF gelu_new) | 'exact': erf, nanoGPT's F.gelu (HF gelu)
    gelu: str = "tanh"
    dtype: str = "float32"  # compute dtype, 'float32' | 'bfloat16'; params are always float32
    # 'gpt2' | 'speedrun': modded-nanogpt's record 5 (rotary, QK-norm, RMSNorm, ReLU^2; bias=False)
    arch: str = "gpt2"
    # how the run computes, not what it computes (a checkpoint's are ignored on restore, see
    # RUNTIME_FIELDS): 'xla' | 'cudnn' (NVIDIA) | 'splash' (TPU) | 'auto': the fused kernel where it
    # runs
    attention: str = "auto"
    # recompute in the backward pass instead of storing: 'none' | 'block' | 'dots' (see REMAT)
    remat: str = "none"
    # the loss computes the logits this many positions at a time (all rows); 0: all at once
    loss_chunk: int = 0
    # the blocks' params stacked on a leading n_layer axis, run by one lax.scan
    scan_layers: bool = False

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.gelu not in ("tanh", "exact"):
            raise ValueError(f"gelu must be 'tanh' (GPT-2) or 'exact' (nanoGPT), got {self.gelu!r}")
        if self.arch not in ARCHS:
            raise ValueError(
                f"arch must be 'gpt2' or 'speedrun' (modded-nanogpt's record 5), got {self.arch!r}"
            )
        if self.arch == "speedrun" and self.bias:
            raise ValueError(
                "arch='speedrun' has no biases (modded-nanogpt's record 5): set bias=False"
            )
        if self.arch == "speedrun" and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                "arch='speedrun' rotates the halves of each head: the head size n_embd / n_head "
                f"must be even, got {self.n_embd // self.n_head}"
            )
        if self.attention not in attention.SETTINGS:
            raise ValueError(
                f"attention must be one of {', '.join(map(repr, attention.SETTINGS))}, "
                f"got {self.attention!r}"
            )
        if self.remat not in REMAT:
            raise ValueError(
                f"remat must be one of {', '.join(map(repr, REMAT))}, got {self.remat!r}"
            )
        if not (isinstance(self.loss_chunk, int) and self.loss_chunk >= 0):
            raise ValueError(
                f"loss_chunk must be >= 0, an integer (0: no chunks), got {self.loss_chunk!r}"
            )
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be True or False, got {self.scan_layers!r}")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


DTYPES = ("float32", "bfloat16")
ARCHS = ("gpt2", "speedrun")


def resolve_dtype(dtype, platform):
    """A dtype setting ('auto' or one of DTYPES) -> the compute dtype on `platform`
    (sharding.platform_of a mesh): 'auto' is bfloat16 on GPU/TPU, float32 on CPU."""
    if dtype == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise UsageError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
    return dtype


# GPTConfig's fields that are choices of the run, not the architecture: a restored checkpoint takes
# them from the current settings (checkpoint.model_config_from_meta), so a run saved on a GPU
# resumes on a CPU
RUNTIME_FIELDS = ("dtype", "dropout", "attention", "remat", "loss_chunk", "scan_layers")


def normal(std):
    return nnx.initializers.normal(stddev=std)


def torch_linear_init(fan_in):
    """torch nn.Linear's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)): record 5's, which keeps
    torch's inits."""
    bound = 1 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound
    )


def layer_norm(config: GPTConfig, rngs: nnx.Rngs):
    if config.arch == "speedrun":  # F.rms_norm without a weight (record 5): no params
        return RMSNorm()
    # nnx's defaults differ from torch's: eps 1e-6 (GPT-2: 1e-5) and the E[x^2]-E[x]^2 "fast"
    # variance. LayerNorm runs in float32 even in bf16 mode.
    return nnx.LayerNorm(
        config.n_embd,
        epsilon=1e-5,
        use_fast_variance=False,
        use_bias=config.bias,
        dtype=jnp.float32,
        rngs=rngs,
    )


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
    """An embedding table gathered whole for the lookup (float32, as nnx.Embed's default)."""
    return tuple(sharding.constrain(a, P(None, None)) for a in args)


def linear(n_in, n_out, config: GPTConfig, rngs: nnx.Rngs, std=0.02, row_parallel=False):
    # Kernels are (in, out), the layout of HF's Conv1D: weights copy across without a transpose.
    # Under tensor parallelism a kernel computes split by output columns, or by input rows
    # (row_parallel). speedrun: torch's default init, and the residual projections (row_parallel)
    # zero, as record 5 (zero init suggested by @Grad62304977)
    init = (
        normal(std)
        if config.arch == "gpt2"
        else nnx.initializers.zeros_init()
        if row_parallel
        else torch_linear_init(n_in)
    )
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


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.rotary = config.arch == "speedrun"  # rotary positions and QK-norm (record 5)
        # the kernel is chosen per call shape, for the mesh in context
        self.attention = config.attention
        # q, k, v for all heads
        self.c_attn = linear(config.n_embd, 3 * config.n_embd, config, rngs)
        # residual projection: GPT-2's scaled init, 0.02/sqrt(2 * n_layer) (speedrun: zero, see
        # linear)
        self.c_proj = linear(
            config.n_embd,
            config.n_embd,
            config,
            rngs,
            std=0.02 / math.sqrt(2 * config.n_layer),
            row_parallel=True,
        )

    def qkv(self, x, pos=0, length=None):
        """x (B, T, C) at positions pos..pos+T-1 -> q, k, v (B, T, nh, hs). speedrun: q and k
        rotated (rotary_tables of `length` positions, default T, from which pos may be traced), then
        RMS-normed over the head (QK norm suggested by @Grad62304977); before the kernel, so that
        every kernel serves both archs."""
        B, T, C = x.shape
        q, k, v = jnp.split(checkpoint_name(self.c_attn(x), "qkv"), 3, axis=-1)  # (B, T, C) each
        # (B, T, nh, hs)
        q, k, v = (a.reshape(B, T, self.n_head, C // self.n_head) for a in (q, k, v))
        if self.rotary:
            cos, sin = (
                jax.lax.dynamic_slice_in_dim(jnp.asarray(t), pos, T)
                for t in rotary_tables(length or T, C // self.n_head)
            )  # (T, hs/2)
            q, k = rms_norm(rotary(q, cos, sin)), rms_norm(rotary(k, cos, sin))
        return q, k, v

    def __call__(self, x, key=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x)  # (B, T, nh, hs)
        if key is None or self.dropout == 0.0:
            # the target's device (the mesh's), not the host's: a GPU or TPU may be compiled for
            # without one
            device = sharding.target_device()
            kernel = attention.choose(
                self.attention,
                platform=sharding.target_platform(),
                dtype=q.dtype,
                seq_len=T,
                head_size=C // self.n_head,
                capability=attention.cuda_capability(device),
                device_kind=device.device_kind,
            )
            y = attention.causal_attention(q, k, v, kernel)  # (B, T, nh, hs)
        else:
            y = explicit_attention(q, k, v, self.dropout, key)
            key = jax.random.fold_in(key, 1)
        y = checkpoint_name(self.c_proj(y.reshape(B, T, C)), "attn_proj")
        return dropout(y, self.dropout, key)

    def decode(self, x, kv, pos):
        """x (B, T, C) at positions pos..pos+T-1, kv this layer's cache (k, v), each (B * nh, S,
        hs): write the new keys and values in at pos, attend to every cached position <= the
        query's."""
        B, T, C = x.shape
        hs = C // self.n_head
        # (B*nh, T, hs), at their positions
        q, k, v = (
            a.transpose(0, 2, 1, 3).reshape(B * self.n_head, T, hs)
            for a in self.qkv(x, pos, kv[0].shape[1])
        )
        k, v = (
            jax.lax.dynamic_update_slice_in_dim(c, a.astype(c.dtype), pos, axis=1)
            for c, a in zip(kv, (k, v))
        )
        # dot_product_attention's math, spelled out: with its (B, S, nh, hs) layout XLA:CPU copied
        # the whole cache every step; in this layout the cache feeds the dots as it is
        # (docs/benchmarks.md)
        att = jnp.einsum("zqd,zkd->zqk", q, k, preferred_element_type=jnp.float32) * (
            1.0 / math.sqrt(hs)
        )
        # (T, S): causal, absolute positions
        mask = jnp.arange(k.shape[1])[None, :] <= pos + jnp.arange(T)[:, None]
        # (B*nh, T, S), float32 softmax
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1).astype(v.dtype)
        # (B, T, nh, hs)
        y = jnp.einsum("zqk,zkd->zqd", att, v).reshape(B, self.n_head, T, hs).transpose(0, 2, 1, 3)
        return self.c_proj(y.reshape(B, T, C)), (k, v)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.dropout = config.dropout
        self.approximate_gelu = config.gelu == "tanh"
        # ReLU^2 (record 5: suggested by @SKYLINEZ007 and @Grad62304977)
        self.relu2 = config.arch == "speedrun"
        self.c_fc = linear(config.n_embd, 4 * config.n_embd, config, rngs)
        self.c_proj = linear(
            4 * config.n_embd,
            config.n_embd,
            config,
            rngs,
            std=0.02 / math.sqrt(2 * config.n_layer),
            row_parallel=True,
        )

    def __call__(self, x, key=None):
        # GPT-2's gelu is the tanh approximation (HF "gelu_new"); nanoGPT's is the exact erf GELU
        # (config.gelu)
        B, T, C = x.shape
        # 2-D matmuls: XLA:CPU fuses the GELU into a (B, T, C) matmul badly (docs/benchmarks.md);
        # free elsewhere
        h = self.c_fc(x.reshape(B * T, C))  # (B*T, 4C)
        h = (
            jnp.square(jax.nn.relu(h))
            if self.relu2
            else jax.nn.gelu(h, approximate=self.approximate_gelu)
        )
        return dropout(self.c_proj(h), self.dropout, key).reshape(B, T, C)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.ln_1 = layer_norm(config, rngs)
        self.attn = CausalSelfAttention(config, rngs)
        self.ln_2 = layer_norm(config, rngs)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, key=None):
        # the residual stream stays float32; each branch computes in the compute dtype
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        # rows over data x fsdp under a mesh: weights move, activations don't
        x = sharding.constrain_batch(x)
        # on GPU a conditional costs a host round trip; XLA:GPU needs no help
        if sharding.target_platform() == "cpu":
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
        speedrun = config.arch == "speedrun"
        # speedrun: the tied embedding is the record's lm_head, an nn.Linear(n_embd, vocab): its
        # init
        self.wte = nnx.Embed(
            config.vocab_size,
            config.n_embd,
            promote_dtype=_gathered_table,
            rngs=rngs,
            embedding_init=torch_linear_init(config.n_embd) if speedrun else normal(0.02),
        )
        # speedrun: no position embedding, rotary acts in attention
        self.wpe = (
            None
            if speedrun
            else nnx.Embed(
                config.block_size,
                config.n_embd,
                embedding_init=normal(0.02),
                promote_dtype=_gathered_table,
                rngs=rngs,
            )
        )
        # the same draws, scanned or not
        blocks = [Block(config, rngs) for _ in range(config.n_layer)]
        self.h = stack_blocks(blocks) if config.scan_layers else nnx.List(blocks)
        self.ln_f = layer_norm(config, rngs)
        # no lm_head parameter: the head is wte itself (weight tying), see logits()

    def hidden_states(self, idx, key=None):
        """Token ids (B, T) -> the residual stream after each block ([(B, T, C)] * n_layer, or
        (n_layer, B, T, C) with scan_layers), then ln_f's output."""
        # first: a shape that is not (B, T) is its line, not an unpacking error
        check_tokens(idx, self.config)
        x = self.embed(idx, jnp.arange(idx.shape[1]))  # (B, T, C), float32
        keys = (
            jax.random.split(key, self.config.n_layer + 1)
            if key is not None
            else [None] * (self.config.n_layer + 1)
        )
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
            x = (
                block(x, k)
                if self.config.remat == "none"
                else run_block(block, x, k, REMAT[self.config.remat])
            )
            states.append(x)
        return states, self.ln_f(x)

    def embed(self, idx, positions):
        """Token ids (B, T) at positions (T,) -> the residual stream's input (B, T, C), float32."""
        x = self.wte(idx)
        return x if self.wpe is None else x + self.wpe(positions)

    def logits(self, x):
        """(..., C) -> (..., vocab) float32, through the tied wte (bf16 matmul, float32
        accumulation)."""
        return tied_head(x, self.wte.embedding[...], self.config.compute_dtype)

    def loss_terms(self, x, targets):
        """ln_f's output x (B, T, C), targets (B, T) -> cross_entropy_terms of their logits. With
        loss_chunk > 0 the logits exist loss_chunk positions at a time, (B, loss_chunk, vocab), and
        each chunk's are recomputed in the backward pass: memory O(B x loss_chunk x vocab), not (B,
        T, vocab) logits and their gradient. Chunks cut the time axis only, every row in each, so
        the batch axis keeps its sharding."""
        B, T, C = x.shape
        n, cdt, embedding = (
            self.config.loss_chunk,
            self.config.compute_dtype,
            self.wte.embedding[...],
        )
        if n == 0 or n >= T:
            return cross_entropy_terms(tied_head(x, embedding, cdt, cdt), targets)
        pad = -T % n  # the last chunk's padding has target -1: ignored
        # (chunks, B, n, C)
        xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, n, C).swapaxes(0, 1)
        # (chunks, B, n)
        ys = (
            jnp.pad(targets, ((0, 0), (0, pad)), constant_values=-1)
            .reshape(B, -1, n)
            .swapaxes(0, 1)
        )

        # the float32 embedding goes in, cast inside: its gradient then sums over the chunks in
        # float32
        @jax.checkpoint  # saves the chunk's inputs only: the backward pass recomputes its logits
        def chunk_nll(embedding, x, y):
            return cross_entropy_terms(tied_head(x, embedding, cdt, cdt), y)[0]

        total, _ = jax.lax.scan(
            lambda total, xy: (total + chunk_nll(embedding, *xy), None), jnp.float32(0), (xs, ys)
        )
        return total, jnp.sum(targets != -1)

    def loss(self, idx, targets, *, key=None):
        """The mean cross-entropy of idx (B, T) against targets (B, T) (-1 ignored), without
        returning the logits: training's path, in chunks of loss_chunk positions (see loss_terms).
        `key` turns dropout on."""
        _, x = self.hidden_states(idx, key)
        return mean_of(*self.loss_terms(x, targets))

    def __call__(self, idx, targets=None, *, key=None):
        """idx (B, T) int -> logits (B, T, vocab), and the mean cross-entropy if targets (B, T) are
        given (targets == -1 are ignored). `key` turns dropout on (training); None means eval."""
        _, x = self.hidden_states(idx, key)
        logits = self.logits(x)  # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, cross_entropy(logits, targets)

    def decode(self, idx, cache, pos):
        """Forward token ids idx (B, T) at positions pos..pos+T-1 through the KV cache (one (k, v)
        per layer, see init_cache) -> (ln_f output (B, T, C), the cache with their keys and values
        written in)."""
        T = idx.shape[1]
        # positions past block_size only occur in the padding rows of a prefill chunk: clamp them
        # (an out-of-range take would give NaNs, and NaN * 0 attention weight is still NaN) (B, T,
        # C)
        x = self.embed(idx, jnp.minimum(pos + jnp.arange(T), self.config.block_size - 1))
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
        """[(k, v)] * n_layer, zeros of shape (B * nh, S, hs) in the compute dtype; with scan_layers
        one (k, v) of shape (n_layer, B * nh, S, hs)."""
        c = self.config
        shape = (batch_size * c.n_head, length, c.n_embd // c.n_head)
        if c.scan_layers:
            return tuple(jnp.zeros((c.n_layer, *shape), c.compute_dtype) for _ in "kv")
        return [
            (jnp.zeros(shape, c.compute_dtype), jnp.zeros(shape, c.compute_dtype))
            for _ in range(c.n_layer)
        ]

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, **options):
        """nanoGPT's generate, with a KV cache: see generate.generate."""
        return generate.generate(self, idx, max_new_tokens, temperature, top_k, top_p, **options)

    def num_params(self, non_embedding=True):
        """Parameter count. As nanoGPT, non_embedding subtracts the position embeddings only: the
        token embeddings are also the lm_head weights, so they stay counted."""
        n = sum(p.size for p in jax.tree.leaves(nnx.state(self, nnx.Param)))
        return n - self.wpe.embedding.size if non_embedding and self.wpe is not None else n

    def crop_block_size(self, block_size):
        """Shrink the context length, e.g. to finetune GPT-2 (1024) with a shorter block_size."""
        if block_size > self.config.block_size:
            raise ValueError(
                f"cannot grow block_size from {self.config.block_size} to {block_size}"
            )
        self.config = GPTConfig(**{**asdict(self.config), "block_size": block_size})
        if self.wpe is not None:  # speedrun's rotary serves any length
            self.wpe.embedding = nnx.Param(self.wpe.embedding[:block_size])
            self.wpe.num_embeddings = block_size

    def flops_per_token(self):
        """Training FLOPs (forward and backward) per token at full context (flops_per_token
        below)."""
        c = self.config
        return flops_per_token(self.num_params(), c.n_layer, c.n_head, c.n_embd, c.block_size)

    @classmethod
    def from_pretrained(cls, name_or_path, mesh=None, n_head=None, **settings):
        """GPT-2 weights from the HF hub by name (gpt2, gpt2-medium, gpt2-large, gpt2-xl; the local
        HF cache is used when present), a local HF directory (as `save_pretrained` writes it), a
        nanoGPT ckpt.pt (the file or its out_dir) or a modded-nanogpt state_step*.pt
        (arch='speedrun'; n_head: see pretrained.read_modded). No torch, except for a .pt or a
        pytorch_model.bin (pretrained.py). With a `mesh`, each tensor goes straight into its shards
        (sharding.PARAM_SPECS). settings: GPTConfig's run choices (RUNTIME_FIELDS: dtype, dropout,
        attention, remat, loss_chunk)."""
        return load_pretrained(name_or_path, mesh=mesh, n_head=n_head, **settings)[0]

    def save_pretrained(self, out_dir):
        """Write an HF GPT-2 directory (config.json + model.safetensors) that
        transformers.GPT2LMHeadModel.from_pretrained(out_dir) loads."""
        weights.save_hf(self, out_dir)


def model_from(config: GPTConfig, state, mesh=None):
    """A GPT holding `state` ({HF name: array}), with no random init on the way."""
    model = nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0)))
    weights.load_state_dict(model, state, mesh)
    return model


def load_pretrained(name_or_path, mesh=None, n_head=None, **settings):
    """(GPT, training config or None) from a GPT-2 hub name, an HF directory, a nanoGPT ckpt.pt (a
    file or a nanoGPT out_dir) or a modded-nanogpt state_step*.pt: the config carries a nanoGPT
    run's dataset, for its meta.pkl. n_head: a state_step*.pt's (pretrained.read_modded). settings:
    GPTConfig's run choices (RUNTIME_FIELDS)."""
    config_args, state, train_config = pretrained.read_pretrained(name_or_path, n_head=n_head)
    return model_from(replace(GPTConfig(**config_args), **settings), state, mesh), train_config


def check_tokens(idx, config: GPTConfig):
    """Bad input fails here, before any gather: JAX clamps out-of-range indices silently."""
    if idx.ndim != 2:
        raise ValueError(f"expected token ids of shape (batch, time), got shape {idx.shape}")
    if idx.shape[1] > config.block_size:
        raise ValueError(
            f"cannot forward a sequence of length {idx.shape[1]}: block_size is {config.block_size}"
        )
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"token ids must be integers, got {idx.dtype}")
    if not isinstance(idx, jax.core.Tracer) and idx.size:  # values are only known outside jit
        # numpy, so that a concrete array closed over by a jit stays concrete
        values = np.asarray(idx)
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(
                f"token ids must be in [0, {config.vocab_size}), got min {lo}, max {hi}"
            )


def flops_per_token(n_params, n_layer, n_head, n_embd, block_size):
    """Training FLOPs (forward and backward) per token at full context: nanoGPT's estimate (PaLM
    appendix B), 6N + 12·L·H·Q·T, N without the position embeddings."""
    return 6 * n_params + 12 * n_layer * n_head * (n_embd // n_head) * block_size
