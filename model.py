"""
GPT-2 in JAX (flax nnx), numerically GPT-2's: tanh GELU (or nanoGPT's exact one), LayerNorm eps
1e-5, tied lm_head. The speedrun's records are in archs/record5.py and archs/record20.py;
archs/models.py builds each from a GPTConfig. Platform choices and sharding constraints are not
here: compute/attention.py picks the kernel, compute/layers.py runs the stack of blocks and holds
the Linear that compute/sharding.py lays out.
References:
1) OpenAI's GPT-2 TensorFlow implementation:
   https://github.com/openai/gpt-2/blob/master/src/model.py
2) huggingface/transformers GPT2LMHeadModel (the parity reference), and karpathy/nanoGPT's model.py.
"""

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from compute import attention, generate
from compute.layers import (
    REMAT,
    apply_block,
    block_fn,
    chunked_terms,
    cross_entropy,
    dropout,
    embedding,
    linear,
    mean_of,
    stack_blocks,
    tied_head,
)
from configurator import UsageError
from dataio import pretrained, weights


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
    dtype: str = "float32"  # compute dtype, 'float32' | 'bfloat16'; params are float32 but for
    # record 20's embedding tables (and their Adam moments), stored in this dtype (the record: bf16)
    embed_dtype: str = "float32"
    # 'gpt2' | 'speedrun': modded-nanogpt's record 5 | 'speedrun20': its record 20
    # (archs/record5.py, archs/record20.py; archs/models.py registers each)
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
    # record 20's head in training through FP8 (layers.fp8_head; arch='speedrun20' only)
    fp8_head: bool = False
    # record 20's long window grows over training to this many tokens, rounded up to whole
    # 128-token blocks; the short one is half (arch='speedrun20' only; the record's 1728: 14 blocks)
    window_size: int = 1728
    # nanochat's key/value heads (GQA), 0: n_head (arch='nanochat' only, as window_pattern)
    n_kv_head: int = 0
    # nanochat's windows tiled over the layers, L long, S short (archs/nanochat.py), last one L
    window_pattern: str = "SSSL"

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        for field, value in (("dtype", self.dtype), ("embed_dtype", self.embed_dtype)):
            if value not in DTYPES:
                raise ValueError(f"{field} must be 'float32' or 'bfloat16', got {value!r}")
        if self.gelu not in ("tanh", "exact"):
            raise ValueError(f"gelu must be 'tanh' (GPT-2) or 'exact' (nanoGPT), got {self.gelu!r}")
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
        if self.fp8_head not in (False, True):
            raise ValueError(f"fp8_head must be True or False, got {self.fp8_head!r}")
        if not (isinstance(self.window_size, int) and self.window_size >= 1):
            raise ValueError(
                f"window_size must be an integer >= 1 (tokens), got {self.window_size!r}"
            )

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


DTYPES = ("float32", "bfloat16")


# GPTConfig's fields that are choices of the run, not the architecture: a restored checkpoint takes
# them from the current settings (checkpoint.model_config_from_meta), so a run saved on a GPU
# resumes on a CPU
RUNTIME_FIELDS = (
    "dtype",
    "dropout",
    "attention",
    "remat",
    "loss_chunk",
    "scan_layers",
    "fp8_head",
    "window_size",
    "embed_dtype",
)


def normal(std):
    return nnx.initializers.normal(stddev=std)


def layer_norm(config: GPTConfig, rngs: nnx.Rngs):
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


def residual_init(config: GPTConfig):
    """GPT-2's init of the projections back into the residual stream: 0.02/sqrt(2 * n_layer)."""
    return normal(0.02 / math.sqrt(2 * config.n_layer))


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs, init=None, proj_init=None):
        C = config.n_embd
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.attention = config.attention  # the kernel is chosen per call shape (attention.attend)
        # q, k, v for all heads
        self.c_attn = linear(C, 3 * C, config, rngs, init or normal(0.02))
        self.c_proj = linear(
            C, C, config, rngs, proj_init or residual_init(config), row_parallel=True
        )

    def qkv(self, x, pos=0, length=None):
        """x (B, T, C) at positions pos..pos+T-1 of `length` -> q, k, v (B, T, nh, hs)."""
        B, T, C = x.shape
        q, k, v = jnp.split(checkpoint_name(self.c_attn(x), "qkv"), 3, axis=-1)  # (B, T, C) each
        return tuple(a.reshape(B, T, self.n_head, C // self.n_head) for a in (q, k, v))

    def __call__(self, x, key=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x)  # (B, T, nh, hs)
        y = attention.attend(q, k, v, self.attention, self.dropout, key)  # (B, T, nh, hs)
        key = None if key is None else jax.random.fold_in(key, 1)
        y = checkpoint_name(self.c_proj(y.reshape(B, T, C)), "attn_proj")
        return dropout(y, self.dropout, key)

    def decode(self, x, kv, pos):
        """x (B, T, C) at positions pos..pos+T-1, kv this layer's cache (k, v), each (B * nh, S,
        hs): write the new keys and values in at pos, attend to every cached position <= the
        query's."""
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = (  # (B*nh, T, hs), at their positions
            a.transpose(0, 2, 1, 3).reshape(B * self.n_head, T, hs)
            for a in self.qkv(x, pos, kv[0].shape[1])
        )
        k, v = (
            jax.lax.dynamic_update_slice_in_dim(c, a.astype(c.dtype), pos, axis=1)
            for c, a in zip(kv, (k, v))
        )
        y = attention.cached_attention(q, k, v, pos)  # (B*nh, T, hs)
        y = y.reshape(B, self.n_head, T, hs).transpose(0, 2, 1, 3)  # (B, T, nh, hs)
        return self.c_proj(y.reshape(B, T, C)), (k, v)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs, init=None, proj_init=None):
        C = config.n_embd
        self.dropout = config.dropout
        self.approximate_gelu = config.gelu == "tanh"
        self.c_fc = linear(C, 4 * C, config, rngs, init or normal(0.02))
        self.c_proj = linear(
            4 * C, C, config, rngs, proj_init or residual_init(config), row_parallel=True
        )

    def activation(self, h):
        # GPT-2's gelu is the tanh approximation (HF "gelu_new"); nanoGPT's is the exact erf GELU
        return jax.nn.gelu(h, approximate=self.approximate_gelu)

    def __call__(self, x, key=None):
        B, T, C = x.shape
        # 2-D matmuls: XLA:CPU fuses the GELU into a (B, T, C) matmul badly; free elsewhere
        h = self.activation(self.c_fc(x.reshape(B * T, C)))  # (B*T, 4C)
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
        x = x + self.attn(self.ln_1(x), k_attn).astype(x.dtype)
        x = x + self.mlp(self.ln_2(x), k_mlp).astype(x.dtype)
        return x

    def decode(self, x, kv, pos):
        y, kv = self.attn.decode(self.ln_1(x), kv, pos)
        x = x + y.astype(x.dtype)
        return x + self.mlp(self.ln_2(x)).astype(x.dtype), kv


class GPT(nnx.Module):
    arch = "gpt2"  # the GPTConfig.arch this class builds (archs/models.py registers it)
    title = "GPT-2"  # how a message names it
    exports = ("hf", "nanogpt")  # the formats export.py writes it in (dataio/weights.py)

    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.config = config
        self.wte = embedding(config.vocab_size, config.n_embd, rngs, normal(0.02))
        self.wpe = embedding(config.block_size, config.n_embd, rngs, normal(0.02))
        self.h = stack(config, [Block(config, rngs) for _ in range(config.n_layer)])
        self.ln_f = layer_norm(config, rngs)
        # no lm_head parameter: the head is wte itself (weight tying), see logits()

    @classmethod
    def check_config(cls, config: GPTConfig):
        """ValueError if this architecture cannot take `config` (GPTConfig checks the rest)."""

    def embed(self, idx, positions):
        """Token ids (B, T) at positions (T,) -> the residual stream's input (B, T, C), float32."""
        return self.wte(idx) + self.wpe(positions)

    def hidden_states(self, idx, key=None):
        """Token ids (B, T) -> the residual stream after each block ([(B, T, C)] * n_layer, or
        (n_layer, B, T, C) with scan_layers), then ln_f's output."""
        # first: a shape that is not (B, T) is its line, not an unpacking error
        check_tokens(idx, self.config)
        x = self.embed(idx, jnp.arange(idx.shape[1]))  # (B, T, C), float32
        n = self.config.n_layer
        keys = jax.random.split(key, n + 1) if key is not None else [None] * (n + 1)
        x = dropout(x, self.config.dropout, keys[0])
        remat = REMAT[self.config.remat]
        if self.config.scan_layers:  # one block compiled, whatever the depth
            graphdef, stacked = nnx.split(self.h)
            block = block_fn(graphdef, remat)

            def layer(x, state_key):
                x = block(state_key[0], x, state_key[1])
                return x, x

            x, states = jax.lax.scan(layer, x, (stacked, None if key is None else keys[1:]))
            return states, self.ln_f(x)
        states = []
        for block, k in zip(self.h, keys[1:]):
            x = apply_block(block, x, k, remat)
            states.append(x)
        return states, self.ln_f(x)

    def logits(self, x):
        """(..., C) -> (..., vocab) float32, through the tied wte (bf16 matmul, float32
        accumulation)."""
        return tied_head(x, self.wte.embedding[...], self.config.compute_dtype)

    def loss_terms(self, x, targets):
        """ln_f's output x (B, T, C), targets (B, T) -> cross_entropy_terms of their logits. With
        loss_chunk > 0 the logits exist loss_chunk positions at a time (layers.chunked_terms):
        memory O(B x loss_chunk x vocab), not (B, T, vocab) logits and their gradient."""
        cdt = self.config.compute_dtype
        return chunked_terms(
            x,
            targets,
            self.config.loss_chunk,
            self.wte.embedding[...],
            lambda embedding, x: tied_head(x, embedding, cdt, cdt),
        )

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
        return logits, None if targets is None else cross_entropy(logits, targets)

    def decode(self, idx, cache, pos):
        """Forward token ids idx (B, T) at positions pos..pos+T-1 through the KV cache (one (k, v)
        per layer, see init_cache) -> (ln_f output (B, T, C), the cache with their keys and values
        written in)."""
        T = idx.shape[1]
        # positions past block_size only occur in the padding rows of a prefill chunk: clamp them
        # (an out-of-range take would give NaNs, and NaN * 0 attention weight is still NaN)
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
        """[(k, v)] * n_layer, zeros of shape (B * nh, S, hs) in the compute dtype; with
        scan_layers one (k, v) of shape (n_layer, B * nh, S, hs)."""
        c = self.config
        shape = (batch_size * c.n_head, length, c.n_embd // c.n_head)
        if c.scan_layers:
            return tuple(jnp.zeros((c.n_layer, *shape), c.compute_dtype) for _ in "kv")
        return [
            (jnp.zeros(shape, c.compute_dtype), jnp.zeros(shape, c.compute_dtype))
            for _ in range(c.n_layer)
        ]

    @property
    def n_logits(self):
        """The logits' last axis: vocab_size (record 20's head pads it)."""
        return self.config.vocab_size

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, **options):
        """nanoGPT's generate, with a KV cache: see generate.generate."""
        return generate.generate(self, idx, max_new_tokens, temperature, top_k, top_p, **options)

    def num_params(self, non_embedding=True):
        """Parameter count. As nanoGPT, non_embedding subtracts the position embeddings only: the
        token embeddings are also the lm_head weights, so they stay counted."""
        n = sum(p.size for p in jax.tree.leaves(nnx.state(self, nnx.Param)))
        return n - self.wpe.embedding.size if non_embedding else n

    def crop_block_size(self, block_size):
        """Shrink the context length, e.g. to finetune GPT-2 (1024) with a shorter block_size."""
        self.config = cropped(self.config, block_size)
        self.wpe.embedding = nnx.Param(self.wpe.embedding[:block_size])
        self.wpe.num_embeddings = block_size

    def flops_per_token(self):
        """Training FLOPs (forward and backward) per token at full context (flops_per_token
        below)."""
        c = self.config
        return flops_per_token(self.num_params(), c.n_layer, c.n_head, c.n_embd, c.block_size)

    def weight_rows(self):
        """[(outside name, our path, nn.Linear weight?)] for each param: the names the formats it
        is read from and written in give them (dataio/weights.py's table)."""
        return weights.weight_map(self.config.n_layer, self.config.bias)

    @classmethod
    def from_state(cls, config: GPTConfig, state, mesh=None):
        """A model of this class holding `state` ({HF name: array}), with no random init on the
        way; with a `mesh`, each tensor goes straight into its shards (sharding.PARAM_SPECS)."""
        if config.arch != cls.arch:
            raise UsageError(
                f"these weights are arch={config.arch!r}, which {cls.__name__} does not compute: "
                "load them with models.load_pretrained"
            )
        model = nnx.eval_shape(lambda: cls(config, nnx.Rngs(0)))
        weights.load_state_dict(model, state, mesh)
        return model

    @classmethod
    def from_pretrained(cls, name_or_path, mesh=None, n_head=None, **settings):
        """GPT-2 weights from the HF hub by name (gpt2, gpt2-medium, gpt2-large, gpt2-xl; the local
        HF cache is used when present), a local HF directory (as `save_pretrained` writes it) or a
        nanoGPT ckpt.pt (the file or its out_dir); on the records' classes, a modded-nanogpt
        state_step*.pt (n_head: see pretrained.read_modded). No torch, except for a .pt or a
        pytorch_model.bin (dataio/pretrained.py). settings: GPTConfig's run choices
        (RUNTIME_FIELDS)."""
        config_args, state, _ = pretrained.read_pretrained(name_or_path, n_head=n_head)
        return cls.from_state(replace(GPTConfig(**config_args), **settings), state, mesh)

    def save_pretrained(self, out_dir):
        """Write an HF GPT-2 directory (config.json + model.safetensors) that
        transformers.GPT2LMHeadModel.from_pretrained(out_dir) loads."""
        weights.save_hf(self, out_dir)


def stack(config: GPTConfig, blocks):
    """The blocks as GPT.h: an nnx.List, or one Block with every param stacked (scan_layers)."""
    return stack_blocks(blocks) if config.scan_layers else nnx.List(blocks)


def cropped(config: GPTConfig, block_size):
    """`config` with a shorter block_size."""
    if block_size > config.block_size:
        raise ValueError(f"cannot grow block_size from {config.block_size} to {block_size}")
    return replace(config, block_size=block_size)


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
