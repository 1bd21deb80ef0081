"""
nanochat's GPT (arch='nanochat'; karpathy/nanochat, nanochat/gpt.py; its torch side in
parity/nanochat_reference.py): the normed token embedding smeared with the previous token's, blocks
of nanochat's attention (archs/nanochat_attention.py: GQA, rotary, QK-norm, value embeddings on
alternate layers, sliding windows) and a ReLU² MLP, each layer's input a mix of the stream and the
embedding by per-layer lambdas, half-way's output backed out before the final norm, and an untied
head padded to a multiple of 64, sliced to the vocabulary and soft-capped at 15. Its params carry
nanochat's state-dict names (NANOCHAT_NAMES), so a nanochat checkpoint loads into it
(from_nanochat) and it saves as one (nanochat_state). Its model serves the rest of the project
through GPT's interface, its Arch answers what the rest asks (docs/model.md); archs/models.py
registers it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from archs import nanochat_attention, nanochat_recipe
from archs.arch import Arch
from archs.nanochat_attention import (
    NanochatAttention,
    has_ve,
    kv_heads,
    matrix_bound,
    uniform,
    window_sizes,
)
from archs.nanochat_recipe import SMEAR_CHANNELS, VOCAB_MULTIPLE
from archs.record5 import ZERO, Record5MLP
from compute.layers import (
    REMAT,
    apply_block,
    chunked_terms,
    embedding,
    linear,
    rms_norm,
    tied_head,
)
from configurator import UsageError
from dataio import nanochat_checkpoint, weights
from model import GPT, MLP, GPTConfig, check_tokens, cropped, normal

SOFTCAP = 15.0  # logits = 15 * tanh(logits / 15), in float32
WTE_STD = 0.8  # nanochat's init_weights (its docstring says 1.0; its code draws 0.8)
LM_HEAD_STD = 0.001
MLP_SCALE = 0.4  # c_fc's bound is 0.4 of the other matrices'
BACKOUT = 0.2  # backout_lambda's init

# our path (regex) -> nanochat's state-dict name, and whether it is a torch nn.Linear weight (out,
# in), the transpose of our kernel (in, out); the value embeddings are keyed by their layer
NANOCHAT_NAMES = [
    (r"wte\.embedding", "transformer.wte.weight", False),
    (
        r"h\.(\d+)\.attn\.(c_q|c_k|c_v|c_proj|ve_gate)\.kernel",
        r"transformer.h.\1.attn.\2.weight",
        True,
    ),
    (r"h\.(\d+)\.mlp\.(c_fc|c_proj)\.kernel", r"transformer.h.\1.mlp.\2.weight", True),
    (r"lm_head", "lm_head.weight", False),
    (r"value_embeds\.(\d+)\.embedding", r"value_embeds.\1.weight", False),
    (r"smear_gate\.kernel", "smear_gate.weight", True),
    (r"resid_lambdas|x0_lambdas|smear_lambda|backout_lambda", r"\g<0>", False),
]


def padded_vocab(vocab_size):
    """The embedding's and the head's rows: vocab_size up to the next multiple of 64."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def layer_lambdas(n_layer):
    """nanochat's init of (resid_lambdas, x0_lambdas): the stream's weight from 1.15 down to 1.05,
    the embedding's from 0.20 down to 0.05, over the layers (float64, rounded to float32 once)."""
    d = max(n_layer - 1, 1)
    resid = [1.15 - 0.10 * i / d for i in range(n_layer)]
    return jnp.array(resid, jnp.float32), jnp.array([0.20 - 0.15 * i / d for i in range(n_layer)])


def config_from_nanochat(model_config, **settings):
    """GPTConfig from nanochat's GPTConfig fields (its meta_*.json's model_config: the format's
    mapping, nanochat_checkpoint.config_args). settings: the run's choices."""
    return GPTConfig(**{**nanochat_checkpoint.config_args(model_config), **settings})


class NanochatMLP(Record5MLP):  # ReLU², no biases
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        s = MLP_SCALE * matrix_bound(config.n_embd)
        MLP.__init__(self, config, rngs, uniform(-s, s), ZERO)


class NanochatBlock(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs, layer, window):
        self.attn = NanochatAttention(config, rngs, layer, window)
        self.mlp = NanochatMLP(config, rngs)

    def __call__(self, x, key, ve):
        x = x + self.attn(rms_norm(x), ve)
        return x + self.mlp(rms_norm(x))

    def decode(self, x, ve, kv, pos):
        y, kv = self.attn.decode(rms_norm(x), ve, kv, pos)
        x = x + y
        return x + self.mlp(rms_norm(x)), kv


class NanochatGPT(GPT):
    arch = "nanochat"
    title = "nanochat's GPT"
    exports = ("nanochat",)  # nanochat's checkpoint directory (nanochat_state)

    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.check_config(config)
        self.config = config
        C, V, n = config.n_embd, padded_vocab(config.vocab_size), config.n_layer
        s = matrix_bound(C)
        self.wte = embedding(V, C, rngs, normal(WTE_STD))
        self.h = nnx.List(
            [NanochatBlock(config, rngs, i, w) for i, w in enumerate(window_sizes(config))]
        )
        self.lm_head = nnx.Param(normal(LM_HEAD_STD)(rngs.params(), (V, C)))  # untied
        resid, x0 = layer_lambdas(n)
        self.resid_lambdas, self.x0_lambdas = nnx.Param(resid), nnx.Param(x0)
        # smear: the previous token's embedding mixed into each (cheap bigram information)
        self.smear_gate = linear(SMEAR_CHANNELS, 1, config, rngs, uniform(0.0, 0.02))
        self.smear_lambda = nnx.Param(jnp.zeros(1))
        # backout: the half-way stream taken out before the final norm (its low-level features)
        self.backout_lambda = nnx.Param(jnp.full(1, BACKOUT))
        kv = kv_heads(config) * (C // config.n_head)
        # a table for each layer with a value embedding (has_ve), None for the others
        self.value_embeds = nnx.List(
            [embedding(V, kv, rngs, uniform(-s, s)) if has_ve(i, n) else None for i in range(n)]
        )

    @classmethod
    def check_config(cls, config: GPTConfig):
        hs = config.n_embd // config.n_head
        kv = config.n_kv_head
        pattern = config.window_pattern
        problem = (
            "has no biases: set bias=False"
            if config.bias
            else f"rotates the halves of each head: n_embd / n_head must be even, got {hs}"
            if hs % 2
            else f"needs n_kv_head (0: n_head) dividing n_head={config.n_head}, got {kv!r}"
            if not (isinstance(kv, int) and kv >= 0) or (kv and config.n_head % kv)
            else f"needs window_pattern of the letters S and L, got {pattern!r}"
            if not (isinstance(pattern, str) and pattern and set(pattern.upper()) <= set("SL"))
            else f"gates by the embedding's first {SMEAR_CHANNELS} channels: n_embd >= "
            f"{SMEAR_CHANNELS}, got {config.n_embd}"
            if config.n_embd < SMEAR_CHANNELS
            else "runs its layers one by one (they differ): set scan_layers=False"
            if config.scan_layers
            else "has no dropout: set dropout=0.0"
            if config.dropout
            else None
        )
        if problem:
            raise ValueError(f"arch='nanochat' (nanochat's GPT) {problem}")

    def embed(self, idx, positions):
        """Token ids (B, T) -> their RMS-normed embeddings (B, T, C) in the compute dtype (no
        position embedding: rotary acts in attention)."""
        return rms_norm(self.wte(idx).astype(self.config.compute_dtype))

    def smear(self, x, before=None):
        """x (B, T, C) the normed embeddings -> each plus the one before it, times smear_lambda *
        sigmoid(smear_gate(its own first 24 channels)). before (B, 1, C): the embedding before x's
        first (decoding; zeros at position 0); None: x's first has none (the whole sequence)."""
        previous = x[:, :-1] if before is None else jnp.concatenate([before, x[:, :-1]], axis=1)
        current = x[:, 1:] if before is None else x
        lam = self.smear_lambda[...].astype(x.dtype)
        gate = lam * jax.nn.sigmoid(self.smear_gate(current[..., :SMEAR_CHANNELS]))  # (B, T', 1)
        y = current + gate * previous
        return y if before is not None else jnp.concatenate([x[:, :1], y], axis=1)

    def run_layers(self, idx, x, layer):
        """The blocks from x (B, T, C), the smeared embedding of idx (B, T): each takes resid_lambda
        * the stream + x0_lambda * x, and its value embedding of idx; the output of layer n_layer //
        2, times backout_lambda, is subtracted at the end. layer(block, x, ve) runs one -> (each
        layer's output, the normed last one)."""
        x0, n = x, self.config.n_layer
        resid, x0s = (p[...].astype(x.dtype) for p in (self.resid_lambdas, self.x0_lambdas))
        states = []
        for i, (block, table) in enumerate(zip(self.h, self.value_embeds)):
            x = resid[i] * x + x0s[i] * x0
            x = layer(block, x, None if table is None else table(idx).astype(x.dtype))
            states.append(x)
        x = x - self.backout_lambda[...].astype(x.dtype) * states[n // 2]
        return states, rms_norm(x)

    def hidden_states(self, idx, key=None):
        """Token ids (B, T) -> (each layer's output, the normed stream the head reads)."""
        check_tokens(idx, self.config)
        remat = REMAT[self.config.remat]
        x = self.smear(self.embed(idx, None))

        def layer(block, x, ve):
            return apply_block(block, x, key, remat, ve)

        return self.run_layers(idx, x, layer)

    def head(self, weight, x):
        """The padded head `weight` on x (..., C) -> (..., vocab_size) float32: the matmul in the
        compute dtype, sliced to the vocabulary, soft-capped at 15 in float32."""
        cdt = self.config.compute_dtype
        logits = tied_head(x, weight, cdt, cdt)[..., : self.config.vocab_size]
        return SOFTCAP * jnp.tanh(logits.astype(jnp.float32) / SOFTCAP)

    def logits(self, x):
        return self.head(self.lm_head[...], x)

    def loss_terms(self, x, targets):
        """As GPT's (loss_chunk: layers.chunked_terms), through the soft-capped head."""
        return chunked_terms(x, targets, self.config.loss_chunk, self.lm_head[...], self.head)

    def init_cache(self, batch_size, length):
        """{'kv': [(k, v)] per layer, zeros (B, S, n_kv_head, hs) in the compute dtype; 'tokens':
        (B, S) int32, the ids fed so far: the smear's previous embedding is the previous token's,
        recomputed, so a prefill chunk's padding rows never stand in for it}."""
        c = self.config
        shape = (batch_size, length, kv_heads(c), c.n_embd // c.n_head)
        kv = [(jnp.zeros(shape, c.compute_dtype),) * 2 for _ in range(c.n_layer)]
        return {"kv": kv, "tokens": jnp.zeros((batch_size, length), jnp.int32)}

    def decode(self, idx, cache, pos):
        """As GPT's: idx (B, T) at positions pos..pos+T-1 through the cache -> (the normed stream
        (B, T, C), the cache). The first token is smeared with the embedding of the token at
        pos - 1 (the cache's), as the whole sequence's forward does; the windowed layers attend to
        their window of the cache."""
        tokens = jax.lax.dynamic_update_slice_in_dim(
            cache["tokens"], idx.astype(jnp.int32), pos, axis=1
        )
        before = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(pos - 1, 0), 1, axis=1)
        before = jnp.where(pos > 0, self.embed(before, None), 0)  # (B, 1, C): none at position 0
        kvs, new_kvs = iter(cache["kv"]), []

        def layer(block, x, ve):
            x, kv = block.decode(x, ve, next(kvs), pos)
            new_kvs.append(kv)
            return x

        _, x = self.run_layers(idx, self.smear(self.embed(idx, None), before), layer)
        return x, {"kv": new_kvs, "tokens": tokens}

    def num_params(self, non_embedding=True):
        """Every parameter; non_embedding leaves out the input tables (the token and value
        embeddings), which are looked up, not multiplied."""
        n = sum(p.size for p in jax.tree.leaves(nnx.state(self, nnx.Param)))
        tables = sum(t.embedding.size for t in [self.wte, *self.value_embeds] if t is not None)
        return n - tables if non_embedding else n

    def num_matmul_params(self):
        """The params multiplied with the token stream: every Linear's and the head's (nanochat's
        num_matmul_params)."""
        kernels = nnx.state(self, nnx.Param)
        sizes = [v.size for p, v in nnx.to_flat_state(kernels) if p[-1] == "kernel"]
        return sum(sizes) + self.lm_head.size

    def flops_per_token(self):
        """nanochat's estimate_flops: 6 x the matmul params + 12·H·hs·min(window, block_size) per
        layer (the keys a query sees at most)."""
        c = self.config
        T, hs = c.block_size, c.n_embd // c.n_head
        attention = sum(12 * c.n_head * hs * min(b.attn.window, T) for b in self.h)
        return 6 * self.num_matmul_params() + attention

    def crop_block_size(self, block_size):
        # the layers keep the windows they were built with (nanochat's come from sequence_len)
        self.config = cropped(self.config, block_size)

    def weight_rows(self):  # its layers differ (value embeddings on alternate ones): by pattern
        return weights.rows_matching(self, NANOCHAT_NAMES)

    def nanochat_state(self):
        """Our params as nanochat's state dict: {its name: float32 numpy, its layout}, what its
        GPT.load_state_dict takes."""
        linear = {name for name, _, is_linear in self.weight_rows() if is_linear}
        state = weights.state_dict(self)
        return {k: (v.T if k in linear else v).copy(order="C") for k, v in state.items()}

    @classmethod
    def from_state(cls, config: GPTConfig, state, mesh=None):
        """A model holding nanochat's state dict `state` ({its name: array} in its layout: an
        nn.Linear's weight (out, in), the transpose of our kernel), as GPT.from_state holds HF's."""
        model = nnx.eval_shape(lambda: cls(config, nnx.Rngs(0)))
        linear = {name for name, _, is_linear in model.weight_rows() if is_linear}
        ours = {k: np.asarray(v).T if k in linear else v for k, v in state.items()}
        return super().from_state(config, ours, mesh)

    @classmethod
    def from_nanochat(cls, model_config, state, mesh=None, **settings):
        """A model holding nanochat's state dict `state` ({its name: torch tensor or numpy}, as its
        model_*.pt; torch.compile's '_orig_mod.' prefix dropped, bf16 tables read as float32), of
        its GPTConfig fields `model_config` (config_from_nanochat; settings: the run's). Without
        resid_lambdas or x0_lambdas (nanochat's older checkpoints) they are 1 and 0."""
        config = config_from_nanochat(model_config, **settings)
        return cls.from_state(config, nanochat_checkpoint.as_read(state, config.n_layer), mesh)


class Nanochat(Arch):
    model = NanochatGPT
    own_settings = {
        "n_kv_head": "nanochat's key/value heads (GQA)",
        "window_pattern": "nanochat's attention windows",
    }
    own_optimizers = {"muonadamw": "nanochat's MuonAdamW (its head, embeddings, scalars, matrices)"}
    own_run_settings = {"depth": (0, "nanochat's depth dial")}
    scans = False  # its layers differ (value embeddings on alternate ones, windows)

    @classmethod
    def dial(cls, c, vocab_size, shards):
        """depth > 0: base_train's settings from it (nanochat_recipe.resolve, with the run's names:
        learning_rate the head's, embed_/scalar_/muon_learning_rate, warmup_iters, cooldown_frac
        the warmdown's ratio; 0 leaves max_iters and total_batch_size to its rules)."""
        if not c["depth"]:
            return None
        for key in ("n_layer", "n_head", "n_embd"):
            if c[key] != getattr(GPTConfig, key):
                raise UsageError(
                    f"depth={c['depth']} sets {key} (nanochat's dial): leave {key} out, or set "
                    "depth=0 to give the model's shape"
                )
        recipe = nanochat_recipe.resolve(
            depth=c["depth"],
            aspect_ratio=c["aspect_ratio"],
            head_dim=c["head_dim"],
            max_seq_len=c["block_size"],
            vocab_size=c["vocab_size"] or vocab_size,
            window_pattern=c["window_pattern"],
            num_iterations=c["max_iters"] or -1,
            target_flops=c["target_flops"] or -1,
            target_param_data_ratio=c["target_param_data_ratio"] or -1,
            device_batch_size=c["batch_size"],
            total_batch_size=c["total_batch_size"] or -1,
            devices=shards,
            embedding_lr=c["embed_learning_rate"],
            unembedding_lr=c["learning_rate"],
            matrix_lr=c["muon_learning_rate"],
            scalar_lr=c["scalar_learning_rate"],
            weight_decay=c["weight_decay"],
            warmup_steps=c["warmup_iters"],
            warmdown_ratio=c["cooldown_frac"],
            final_lr_frac=c["final_lr_frac"],
        )
        shape = recipe.model
        c.update({k: shape[k] for k in ("n_layer", "n_head", "n_embd")})
        c["max_iters"], c["total_batch_size"] = recipe.num_iterations, recipe.total_batch_size
        c["weight_decay"] = recipe.weight_decay
        for what in ("learning_rate", "embed_", "muon_", "scalar_"):
            key = what if what == "learning_rate" else f"{what}learning_rate"
            c[key] *= recipe.batch_lr_scale
        return recipe.summary()

    @classmethod
    def check_run(cls, config, device):
        nanochat_attention.check_run(config)

    @classmethod
    def kernel(cls, config, device):
        return f"windows-{NanochatAttention.KERNEL}"
