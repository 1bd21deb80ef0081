"""
modded-nanogpt's record 20 (arch='speedrun20', records/track_1_short/2025-01-16_Sub3Min; its torch
side in parity/speedrun20_reference.py): record 5's pieces (archs/record5.py) plus value
embeddings, x0 lambdas, U-net skips, document-causal attention over block-wise long and short
sliding windows (archs/window_attention.py), no attention in layer 7, an untied zero-initialised
head and soft-capped logits. Its tables of layer roles are written for its 12 layers; other even
depths take the same shape (record20_layout). Its model serves the rest of the project through
GPT's interface, its Arch answers what the rest asks (docs/model.md); archs/models.py registers it.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from archs import window_attention
from archs.arch import Arch
from archs.record5 import ZERO, Record5MLP
from archs.window_attention import final_blocks
from compute.layers import (
    REMAT,
    apply_block,
    chunked_terms,
    cross_entropy,
    embedding,
    fp8_head,
    half_truncated_rotary_tables,
    linear,
    mean_of,
    rms_norm,
    rotary,
    tied_head,
)
from dataio import pretrained, weights
from model import GPT, MLP, GPTConfig, check_tokens, cropped

ATTN_SCALE = 0.12  # the record's attention scale (@leloykun), in place of 1/sqrt(head size)
SOFTCAP = 30.0  # logits = 30 * sigmoid(logits / 7.5): tanh soft-capping at 15, shifted by 15
SOFTCAP_SLOPE = 7.5
WINDOW_SIZE = GPTConfig.window_size  # the record's: the long window grows to 1728 tokens, 14 blocks
VALUE_EMBEDDINGS = 3  # tables, mixed into v by the first three layers and again by the last three
HEAD_MULTIPLE = 128  # the head's rows: the vocabulary padded to a multiple of this
NO_ATTENTION_LAYER = 7  # the record's layer without attention (@YouJiacheng)


def window_schedule(it, max_iters, window_size=WINDOW_SIZE):
    """Record 20's long window at iteration `it` of max_iters, in 128-token blocks: window_size *
    it / max_iters tokens rounded up to whole blocks, at least one (@fernbear.bsky.social;
    block-wise by @YouJiacheng): 1 block at the start, final_blocks at the end. Ints or tracers;
    integer arithmetic, which rounds as the record's float division does (no ratio of these sizes
    falls within a rounding of a multiple)."""
    blocks = -(-window_size * it // (window_attention.WINDOW_BLOCK * max_iters))
    return jnp.maximum(blocks, 1) if isinstance(blocks, jax.Array) else max(blocks, 1)


def record20_init(fan_in):
    """The record's init of its matrices (CastedLinear, qkv_w): uniform with std 0.5/sqrt(fan_in)
    (@YouJiacheng)."""
    bound = math.sqrt(3) * 0.5 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound
    )


def padded_vocab(vocab_size):
    """The head's rows: vocab_size up to the next multiple of 128 (50257 -> 50304)."""
    return -(-vocab_size // HEAD_MULTIPLE) * HEAD_MULTIPLE


def record20_layout(n_layer):
    """Each layer's role in record 20: (value embedding table or None, attends?, long window?), as
    the record's code indexes its lists. Its 12 layers: tables 0, 1, 2 in layers 0-2 and again in
    9-11; no attention in layer 7; the encoder's windows [long, short, short, short, long, short]
    and the decoder's that list reversed: long in layers 0, 4, 7 and 11. Another even depth: the
    tables in the encoder's first three layers and the last three (the encoder's win where they
    overlap: 4 layers take 0 1 1 2), attention everywhere below 8 layers, the window lists read
    the same way (6-periodic past 12 layers)."""
    half, encoder = n_layer // 2, [True, False, False, False, True, False]
    tables = [
        (i if i < VALUE_EMBEDDINGS else None)
        if i < half
        else (i - (n_layer - VALUE_EMBEDDINGS) if i >= n_layer - VALUE_EMBEDDINGS else None)
        for i in range(n_layer)
    ]
    longs = [encoder[i % 6] if i < half else encoder[::-1][(i - half) % 6] for i in range(n_layer)]
    return [(tables[i], i != NO_ATTENTION_LAYER, longs[i]) for i in range(n_layer)]


def softcap(logits):
    """The record's soft-capped logits, float32: 30 * sigmoid(logits / 7.5)."""
    return SOFTCAP * jax.nn.sigmoid(logits.astype(jnp.float32) / SOFTCAP_SLOPE)


class Record20Attention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs, band):
        C = config.n_embd
        self.n_head = config.n_head
        self.band = band  # the most blocks its window ever spans (window_attention)
        self.attention = config.attention  # the setting: record20_kernel picks per call shape
        # the record's qkv_w (3, C, C): one (C, 3C) kernel here, [q | k | v]
        self.c_attn = linear(C, 3 * C, config, rngs, record20_init(C))
        self.lambdas = nnx.Param(jnp.array([0.5, 0.5]))  # v's and the value embedding's weights
        self.c_proj = linear(C, C, config, rngs, ZERO, row_parallel=True)

    def qkv(self, x, ve, pos=0, length=None):
        """x (B, T, C) at positions pos..pos+T-1 of `length` (default T), ve its value embedding
        or None -> q, k, v (B, T, nh, hs): v mixed with ve by the lambdas (@KoszarskyB,
        @Grad62304977), q and k RMS-normed, then turned by the half-truncated rotary in float32."""
        B, T, C = x.shape
        q, k, v = (a.reshape(B, T, self.n_head, -1) for a in jnp.split(self.c_attn(x), 3, axis=-1))
        lambdas = self.lambdas[...].astype(v.dtype)  # torch's 0-dim lambdas take v's dtype
        v = lambdas[0] * v
        if ve is not None:
            v = v + lambdas[1] * ve.astype(v.dtype).reshape(v.shape)
        cos, sin = (
            jax.lax.dynamic_slice_in_dim(jnp.asarray(t), pos, T)
            for t in half_truncated_rotary_tables(length or T, q.shape[-1])
        )
        q, k = (rotary(rms_norm(a).astype(jnp.float32), cos, sin).astype(a.dtype) for a in (q, k))
        return q, k, v

    def __call__(self, x, ve, docs, window_blocks):
        """x (B, T, C), its document numbers (B, T) -> (B, T, C): attention over window_blocks."""
        q, k, v = self.qkv(x, ve)
        y = window_attention.record20_attention(
            q, k, v, docs, window_blocks, self.band, ATTN_SCALE, self.attention
        )
        return self.c_proj(y.reshape(x.shape))

    def decode(self, x, ve, kv, docs, pos, window_blocks):
        """x (B, T, C) at positions pos..pos+T-1; kv this layer's cache (k, v), each (B, S, nh,
        hs), docs (B, S) the cache's document numbers with this call's written in."""
        B, T, C = x.shape
        S = kv[0].shape[1]
        q, k, v = self.qkv(x, ve, pos, S)
        k, v = (
            jax.lax.dynamic_update_slice_in_dim(c, a.astype(c.dtype), pos, axis=1)
            for c, a in zip(kv, (k, v))
        )
        q_docs = jax.lax.dynamic_slice_in_dim(docs, pos, T, axis=1)
        mask = window_attention.window_mask(
            pos + jnp.arange(T), jnp.arange(S), q_docs, docs, window_blocks
        )
        y = window_attention.masked_attention(q, k, v, mask, ATTN_SCALE)
        return self.c_proj(y.reshape(x.shape)), (k, v)


class Record20MLP(Record5MLP):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        MLP.__init__(self, config, rngs, record20_init(config.n_embd), ZERO)


class Record20Block(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs, attends=True, long=True):
        self.lambdas = nnx.Param(jnp.array([1.0, 0.0]))  # the stream's and x0's weights
        self.long = long  # the long window, or the short one (half of it)
        # the short window is half the long one, and at least the query's own block (window_mask)
        band = max(final_blocks(config.window_size) // (1 if long else 2), 1)
        self.attn = Record20Attention(config, rngs, band) if attends else None
        self.mlp = Record20MLP(config, rngs)

    def mix(self, x, x0):
        lambdas = self.lambdas[...].astype(x.dtype)
        return lambdas[0] * x + lambdas[1] * x0

    def window(self, window_blocks):
        return window_blocks if self.long else window_blocks // 2

    def __call__(self, x, key, x0, ve, docs, window_blocks):
        """x, x0 (B, T, C) -> (B, T, C); the attention over this block's window of window_blocks
        (the long one) within each document of docs (B, T)."""
        x = self.mix(x, x0)
        if self.attn is not None:
            y = self.attn(rms_norm(x), ve, docs, self.window(window_blocks))
            x = x + y.astype(x.dtype)
        return x + self.mlp(rms_norm(x)).astype(x.dtype)

    def decode(self, x, x0, ve, kv, docs, pos, window_blocks):
        """As Record20Attention.decode, for the block: -> (B, T, C), its cache (None without
        attention)."""
        x = self.mix(x, x0)
        if self.attn is not None:
            y, kv = self.attn.decode(rms_norm(x), ve, kv, docs, pos, self.window(window_blocks))
            x = x + y.astype(x.dtype)
        return x + self.mlp(rms_norm(x)).astype(x.dtype), kv


class Record20GPT(GPT):
    arch = "speedrun20"
    title = "modded-nanogpt's record 20"
    exports = ("modded",)

    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.check_config(config)
        self.config = config
        C, V = config.n_embd, config.vocab_size
        self.layout = record20_layout(config.n_layer)
        table = partial(embedding, V, C, rngs, nnx.initializers.normal(1.0), config.embed_dtype)
        self.wte = table()  # torch's N(0, 1)
        self.ve = nnx.List([table() for _ in range(VALUE_EMBEDDINGS)])
        self.h = nnx.List([Record20Block(config, rngs, a, long) for _, a, long in self.layout])
        # the decoder's weights on the encoder's outputs (U-net, @brendanh0gan)
        self.skip_weights = nnx.Param(jnp.ones(config.n_layer - config.n_layer // 2))
        self.lm_head = nnx.Param(jnp.zeros((padded_vocab(V), C)))  # untied, zero (@Grad62304977)

    @classmethod
    def check_config(cls, config: GPTConfig):
        hs = config.n_embd // config.n_head
        problem = (
            "has no biases: set bias=False"
            if config.bias
            else f"needs an even n_layer (its U-net pairs the layers), got {config.n_layer}"
            if config.n_layer % 2
            else f"needs a head size (n_embd / n_head) that is a multiple of 4, got {hs}"
            if hs % 4
            else "takes sequences of whole 128-token blocks: block_size must be a multiple of "
            f"128, got {config.block_size}"
            if config.block_size % window_attention.WINDOW_BLOCK
            else "runs its layers one by one (they differ): set scan_layers=False"
            if config.scan_layers
            else "has no dropout: set dropout=0.0"
            if config.dropout
            else "attends over block-wise windows, which cuDNN's token-wise sliding window cannot "
            "express: set attention='auto', 'xla', 'splash' or 'flash'"
            if config.attention == "cudnn"
            else None
        )
        if problem:
            raise ValueError(f"arch='speedrun20' (modded-nanogpt's record 20) {problem}")

    def final_window(self):
        """The long window training ends with, in blocks (the record's: 14); the default of every
        call."""
        return final_blocks(self.config.window_size)

    def embed(self, idx, positions):
        x = rms_norm(self.wte(idx))  # normed (@Grad62304977); no position embedding
        return x.astype(self.config.compute_dtype)

    def run_layers(self, idx, layer):
        """The record's U-net from x0 = the normed embedding of idx (B, T): the encoder's outputs
        saved, each added back into its mirror in the decoder by a skip weight. layer(block, x, x0,
        ve) runs one block -> (each layer's output, the normed last one)."""
        x = x0 = self.embed(idx, None)
        half, states = self.config.n_layer // 2, []
        ves = [table(idx) for table in self.ve]
        skip_weights = self.skip_weights[...].astype(x.dtype)
        for i, (block, (table, _, _)) in enumerate(zip(self.h, self.layout)):
            if i >= half:
                x = x + skip_weights[i - half] * states[self.config.n_layer - 1 - i]
            x = layer(block, x, x0, None if table is None else ves[table])
            states.append(x)
        return states, rms_norm(x)

    def hidden_states(self, idx, key=None, window_blocks=None):
        """As GPT's, over the record's masks: documents split at <|endoftext|>, the long window
        window_blocks blocks (default final_window; may be traced), the short one half of it."""
        check_tokens(idx, self.config)
        w = jnp.int32(self.final_window() if window_blocks is None else window_blocks)
        docs, remat = window_attention.documents(idx), REMAT[self.config.remat]

        def layer(block, x, x0, ve):
            return apply_block(block, x, key, remat, x0, ve, docs, w)

        return self.run_layers(idx, layer)

    def logits(self, x):
        """(..., C) -> (..., padded vocab) float32, soft-capped: the head in the compute dtype, as
        the record's CastedLinear, then 30 * sigmoid(. / 7.5) in float32."""
        cdt = self.config.compute_dtype
        return softcap(tied_head(x, self.lm_head[...], cdt, cdt))

    def loss_terms(self, x, targets, training=False):
        """As GPT's (loss_chunk: layers.chunked_terms); training with fp8_head: the head through
        FP8, as the record's in training."""
        cdt = self.config.compute_dtype

        def logits_of(head, x):  # (B, n, C) -> (B, n, padded vocab), soft-capped
            if training and self.config.fp8_head:
                logits = fp8_head(x.reshape(-1, x.shape[-1]), head).reshape(*x.shape[:-1], -1)
                return softcap(logits)
            return softcap(tied_head(x, head, cdt, cdt))

        return chunked_terms(x, targets, self.config.loss_chunk, self.lm_head[...], logits_of)

    def loss(self, idx, targets, *, key=None, window_blocks=None):
        """As GPT's; a key means training (the record's model.train(): the FP8 head, fp8_head)."""
        _, x = self.hidden_states(idx, key, window_blocks)
        return mean_of(*self.loss_terms(x, targets, training=key is not None))

    def __call__(self, idx, targets=None, *, key=None, window_blocks=None):
        _, x = self.hidden_states(idx, key, window_blocks)
        logits = self.logits(x)
        return logits, None if targets is None else cross_entropy(logits, targets)

    def init_cache(self, batch_size, length):
        """{'kv': [(k, v)] for each attending layer, zeros (B, S, nh, hs) in the compute dtype;
        'docs': (B, S) int32, the cached positions' document numbers}."""
        c = self.config
        shape = (batch_size, length, c.n_head, c.n_embd // c.n_head)
        kv = [
            (jnp.zeros(shape, c.compute_dtype), jnp.zeros(shape, c.compute_dtype))
            for _, attends, _ in self.layout
            if attends
        ]
        return {"kv": kv, "docs": jnp.zeros((batch_size, length), jnp.int32)}

    def decode(self, idx, cache, pos):
        """As GPT's: idx (B, T) at positions pos..pos+T-1 through the cache, at the final window.
        A position's document number counts the <|endoftext|> tokens up to it, the earlier ones
        read from the cache."""
        before = jnp.where(pos > 0, cache["docs"][:, jnp.maximum(pos - 1, 0)], 0)  # (B,)
        docs = jax.lax.dynamic_update_slice_in_dim(
            cache["docs"], before[:, None] + window_attention.documents(idx), pos, axis=1
        )
        kvs, new_kvs, w = iter(cache["kv"]), [], self.final_window()

        def layer(block, x, x0, ve):
            kv = next(kvs) if block.attn is not None else None
            x, kv = block.decode(x, x0, ve, kv, docs, pos, w)
            if kv is not None:
                new_kvs.append(kv)
            return x

        _, x = self.run_layers(idx, layer)
        return x, {"kv": new_kvs, "docs": docs}

    def num_params(self, non_embedding=True):
        """Every parameter; non_embedding leaves out the input tables (the token and value
        embeddings), which are looked up, not multiplied."""
        n = sum(p.size for p in jax.tree.leaves(nnx.state(self, nnx.Param)))
        tables = self.wte.embedding.size * (1 + VALUE_EMBEDDINGS)
        return n - tables if non_embedding else n

    def flops_per_token(self):
        """6N (N without the input tables) + attention's 12·C·T per attending layer, T the keys a
        query sees at most: the final long window, or block_size if shorter."""
        c = self.config
        window = final_blocks(c.window_size) * window_attention.WINDOW_BLOCK
        keys = min(c.block_size, window)
        attending = sum(a for _, a, _ in self.layout)
        return 6 * self.num_params() + 12 * attending * c.n_embd * keys

    def crop_block_size(self, block_size):
        self.config = cropped(self.config, block_size)

    @property
    def n_logits(self):
        return self.lm_head.shape[0]  # the padded vocabulary

    def weight_rows(self):  # its layers differ (layer 7 has no attention): rows by pattern
        return weights.rows_matching(self, weights.RECORD20_NAMES)

    def modded_state(self):
        """(the record's state dict, the line of its script that builds this GPT)."""
        return pretrained.to_record20_state(self), pretrained.record20_code(self.config)


class Record20(Arch):
    model = Record20GPT
    own_settings = {
        "fp8_head": "record 20's FP8 head",
        "embed_dtype": "record 20's bf16 embedding tables",
        "window_size": "record 20's attention window",
    }
    own_optimizers = {"muon20": "record 20's (its head, embeddings, scalars and blocks' matrices)"}
    scans = False  # its layers differ
    loader = {"record20": True}  # its loader's steps: one contiguous span of the shard each

    @classmethod
    def check_run(cls, config, device):
        window_attention.check_run(config, device)

    @classmethod
    def kernel(cls, config, device):
        return f"windows-{window_attention.run_kernel(config, device)}"

    @classmethod
    def step_inputs(cls, c, sequences):
        """The long window at each step's count, and the gradient as the record forms it: each
        sequence's mean loss summed over a device's `sequences` a step (our mean, times that)."""
        windows = partial(window_schedule, max_iters=c["max_iters"], window_size=c["window_size"])
        return dict(inputs=lambda count: {"window_blocks": windows(count)}, grad_scale=sequences)

    @classmethod
    def eval_inputs(cls, it, c):
        """The long window at iteration `it`: the record evaluates with the window it trains
        with."""
        return {"window_blocks": jnp.int32(window_schedule(it, c["max_iters"], c["window_size"]))}
