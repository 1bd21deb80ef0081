"""
GPT-2 in JAX (flax nnx), numerically GPT-2's: tanh GELU, LayerNorm eps 1e-5, tied lm_head.
References:
1) OpenAI's GPT-2 TensorFlow implementation: https://github.com/openai/gpt-2/blob/master/src/model.py
2) huggingface/transformers GPT2LMHeadModel (the parity reference), and karpathy/nanoGPT's model.py.
"""

import json
import math
import os
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length (HF: n_positions)
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # residual, embedding and attention dropout (HF: resid/embd/attn_pdrop)
    bias: bool = True  # biases in Linears and LayerNorms (GPT-2: True)
    dtype: str = "float32"  # compute dtype, 'float32' | 'bfloat16'; params are always float32

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


def normal(std):
    return nnx.initializers.normal(stddev=std)


def layer_norm(config: GPTConfig, rngs: nnx.Rngs):
    # nnx's defaults differ from torch's: eps 1e-6 (GPT-2: 1e-5) and the E[x^2]-E[x]^2 "fast" variance.
    # LayerNorm runs in float32 even in bf16 mode.
    return nnx.LayerNorm(config.n_embd, epsilon=1e-5, use_fast_variance=False, use_bias=config.bias,
                         dtype=jnp.float32, rngs=rngs)


def linear(n_in, n_out, config: GPTConfig, rngs: nnx.Rngs, std=0.02):
    # Kernels are (in, out), the layout of HF's Conv1D: weights copy across without a transpose.
    return nnx.Linear(n_in, n_out, use_bias=config.bias, dtype=config.compute_dtype,
                      kernel_init=normal(std), bias_init=nnx.initializers.zeros_init(), rngs=rngs)


def dropout(x, rate, key):
    """Inverted dropout with an explicit key; identity when key is None (eval) or rate is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = linear(config.n_embd, 3 * config.n_embd, config, rngs)  # q, k, v for all heads
        # residual projection: GPT-2's scaled init, 0.02/sqrt(2 * n_layer)
        self.c_proj = linear(config.n_embd, config.n_embd, config, rngs, std=0.02 / math.sqrt(2 * config.n_layer))

    def __call__(self, x, key=None):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)  # (B, T, C) each
        q, k, v = (a.reshape(B, T, self.n_head, hs) for a in (q, k, v))  # (B, T, nh, hs)
        if key is None or self.dropout == 0.0:
            # XLA (or cuDNN flash attention on GPU); scale 1/sqrt(hs), scores and softmax in float32
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # (B, T, nh, hs)
        else:
            # dropout on the attention probabilities needs them materialized
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hs)
            att = jnp.where(jnp.tril(jnp.ones((T, T), bool)), att, -jnp.inf)
            att = dropout(jax.nn.softmax(att, axis=-1), self.dropout, key).astype(v.dtype)  # (B, nh, T, T)
            key = jax.random.fold_in(key, 1)
            y = jnp.einsum("bhqk,bkhd->bqhd", att, v)
        y = self.c_proj(y.reshape(B, T, C))
        return dropout(y, self.dropout, key)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.dropout = config.dropout
        self.c_fc = linear(config.n_embd, 4 * config.n_embd, config, rngs)
        self.c_proj = linear(4 * config.n_embd, config.n_embd, config, rngs, std=0.02 / math.sqrt(2 * config.n_layer))

    def __call__(self, x, key=None):
        # GPT-2's gelu is the tanh approximation (HF "gelu_new"); nanoGPT's exact erf GELU is not GPT-2
        x = jax.nn.gelu(self.c_fc(x), approximate=True)
        return dropout(self.c_proj(x), self.dropout, key)


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


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
        self.config = config
        self.wte = nnx.Embed(config.vocab_size, config.n_embd, embedding_init=normal(0.02), rngs=rngs)
        self.wpe = nnx.Embed(config.block_size, config.n_embd, embedding_init=normal(0.02), rngs=rngs)
        self.h = nnx.List([Block(config, rngs) for _ in range(config.n_layer)])
        self.ln_f = layer_norm(config, rngs)
        # no lm_head parameter: the head is wte itself (weight tying), see logits()

    def hidden_states(self, idx, key=None):
        """Token ids (B, T) -> the residual stream after each block [(B, T, C)] * n_layer, then ln_f's output."""
        B, T = idx.shape
        check_tokens(idx, self.config)
        x = self.wte(idx) + self.wpe(jnp.arange(T))  # (B, T, C), float32
        keys = jax.random.split(key, self.config.n_layer + 1) if key is not None else [None] * (self.config.n_layer + 1)
        x = dropout(x, self.config.dropout, keys[0])
        states = []
        for block, k in zip(self.h, keys[1:]):
            x = block(x, k)
            states.append(x)
        return states, self.ln_f(x)

    def logits(self, x):
        """(..., C) -> (..., vocab) float32, through the tied wte (bf16 matmul, float32 accumulation)."""
        cdt = self.config.compute_dtype
        return jnp.einsum("...c,vc->...v", x.astype(cdt), self.wte.embedding[...].astype(cdt),
                          preferred_element_type=jnp.float32)

    def __call__(self, idx, targets=None, *, key=None):
        """idx (B, T) int -> logits (B, T, vocab), and the mean cross-entropy if targets (B, T) are given
        (targets == -1 are ignored). `key` turns dropout on (training); None means eval."""
        _, x = self.hidden_states(idx, key)
        logits = self.logits(x)  # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, cross_entropy(logits, targets)

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
        c = self.config
        N, L, H, Q, T = self.num_params(), c.n_layer, c.n_head, c.n_embd // c.n_head, c.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        return flops_per_token * T * fwdbwd_per_iter / dt / sum(peak)

    @classmethod
    def from_pretrained(cls, name_or_path, dropout=0.0, dtype="float32"):
        """GPT-2 weights from the HF hub by name (gpt2, gpt2-medium, gpt2-large, gpt2-xl; the local HF
        cache is used when present) or from a local directory written by `save_pretrained`."""
        hf_config, state = load_hf_state_dict(name_or_path)
        config = config_from_hf(hf_config, dropout=dropout, dtype=dtype)
        model = nnx.eval_shape(lambda: cls(config, nnx.Rngs(0)))
        load_state_dict(model, state)
        return model

    def save_pretrained(self, out_dir):
        """Write an HF GPT-2 directory (config.json + model.safetensors) that
        transformers.GPT2LMHeadModel.from_pretrained(out_dir) loads."""
        import torch
        from transformers import GPT2LMHeadModel

        hf_model = GPT2LMHeadModel(hf_config_from(self.config))
        state = {k: torch.from_numpy(np.array(v)) for k, v in state_dict(self).items()}
        state["lm_head.weight"] = state["transformer.wte.weight"]
        missing, unexpected = hf_model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
        assert not missing and not unexpected, (missing, unexpected)
        hf_model.save_pretrained(out_dir)


def check_tokens(idx, config: GPTConfig):
    """Bad input fails here, before any gather: JAX clamps out-of-range indices silently."""
    if idx.ndim != 2:
        raise ValueError(f"expected token ids of shape (batch, time), got shape {idx.shape}")
    if idx.shape[1] > config.block_size:
        raise ValueError(f"cannot forward a sequence of length {idx.shape[1]}: block_size is {config.block_size}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"token ids must be integers, got {idx.dtype}")
    if not isinstance(idx, jax.core.Tracer) and idx.size:  # values are only known outside jit
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"token ids must be in [0, {config.vocab_size}), got min {lo}, max {hi}")


def cross_entropy(logits, targets):
    """Mean cross-entropy in float32 over the targets that are not -1 (nanoGPT's ignore_index)."""
    logits = logits.astype(jnp.float32)
    valid = targets != -1
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(valid, logz - target_logit, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


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


def peak_flops(device):
    kind = getattr(device, "device_kind", "")
    return next((flops for name, flops in PEAK_BF16_FLOPS if name in kind), None)


# ---------------------------------------------------------------------------------------------------
# HF GPT-2 <-> ours. The one weight map: (HF name, our path). HF's Conv1D stores weights as (in, out),
# the layout of nnx.Linear kernels, so nothing is transposed (a torch nn.Linear checkpoint, such as
# nanoGPT's, would need .T). HF's lm_head.weight is the same tensor as wte.weight: one row here.
# "{i}" is the layer index.
HF_WEIGHT_MAP = [
    ("transformer.wte.weight", "wte.embedding"),
    ("transformer.wpe.weight", "wpe.embedding"),
    ("transformer.h.{i}.ln_1.weight", "h.{i}.ln_1.scale"),
    ("transformer.h.{i}.ln_1.bias", "h.{i}.ln_1.bias"),
    ("transformer.h.{i}.attn.c_attn.weight", "h.{i}.attn.c_attn.kernel"),
    ("transformer.h.{i}.attn.c_attn.bias", "h.{i}.attn.c_attn.bias"),
    ("transformer.h.{i}.attn.c_proj.weight", "h.{i}.attn.c_proj.kernel"),
    ("transformer.h.{i}.attn.c_proj.bias", "h.{i}.attn.c_proj.bias"),
    ("transformer.h.{i}.ln_2.weight", "h.{i}.ln_2.scale"),
    ("transformer.h.{i}.ln_2.bias", "h.{i}.ln_2.bias"),
    ("transformer.h.{i}.mlp.c_fc.weight", "h.{i}.mlp.c_fc.kernel"),
    ("transformer.h.{i}.mlp.c_fc.bias", "h.{i}.mlp.c_fc.bias"),
    ("transformer.h.{i}.mlp.c_proj.weight", "h.{i}.mlp.c_proj.kernel"),
    ("transformer.h.{i}.mlp.c_proj.bias", "h.{i}.mlp.c_proj.bias"),
    ("transformer.ln_f.weight", "ln_f.scale"),
    ("transformer.ln_f.bias", "ln_f.bias"),
]
HF_TIED_KEY = "lm_head.weight"  # == transformer.wte.weight
HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def weight_map(n_layer, bias=True):
    """[(HF name, our path)] for a model with n_layer blocks."""
    rows = []
    for hf, ours in HF_WEIGHT_MAP:
        if not bias and hf.endswith(".bias"):
            continue
        for i in range(n_layer) if "{i}" in hf else [None]:
            rows.append((hf.format(i=i), ours.format(i=i)))
    return rows


def _variable(model, path):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def state_dict(model: GPT):
    """Our params as {HF name: numpy array}, HF's layout."""
    return {hf: np.asarray(_variable(model, ours)[...]) for hf, ours in weight_map(model.config.n_layer, model.config.bias)}


def load_state_dict(model: GPT, state):
    """Copy {HF name: array} into the model in place; key sets and shapes must match exactly."""
    rows = weight_map(model.config.n_layer, model.config.bias)
    expected = {hf for hf, _ in rows}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"GPT-2 weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for hf, ours in rows:
        var = _variable(model, ours)
        value = np.asarray(state[hf], dtype=np.float32)
        if value.shape != tuple(var.shape):
            raise ValueError(f"shape mismatch for {hf}: checkpoint {value.shape}, model {tuple(var.shape)}")
        var.set_value(jnp.asarray(value))


def config_from_hf(hf_config, dropout=0.0, dtype="float32"):
    """GPTConfig from a transformers GPT2Config; refuses the variants our model does not compute."""
    unsupported = {
        "activation_function": ("gelu_new", hf_config.activation_function),
        "layer_norm_epsilon": (1e-5, hf_config.layer_norm_epsilon),
        "n_inner": (None, hf_config.n_inner if hf_config.n_inner != 4 * hf_config.n_embd else None),
        "scale_attn_weights": (True, hf_config.scale_attn_weights),
        "scale_attn_by_inverse_layer_idx": (False, hf_config.scale_attn_by_inverse_layer_idx),
        "tie_word_embeddings": (True, hf_config.tie_word_embeddings),
    }
    bad = {k: got for k, (want, got) in unsupported.items() if got != want}
    if bad:
        raise ValueError(f"not a GPT-2 architecture this model computes: {bad}")
    return GPTConfig(block_size=hf_config.n_positions, vocab_size=hf_config.vocab_size, n_layer=hf_config.n_layer,
                     n_head=hf_config.n_head, n_embd=hf_config.n_embd, dropout=dropout, bias=True, dtype=dtype)


def hf_config_from(config: GPTConfig):
    from transformers import GPT2Config

    if not config.bias:
        raise ValueError("HF GPT-2 always has biases: a bias=False model cannot be exported")
    return GPT2Config(n_positions=config.block_size, vocab_size=config.vocab_size, n_layer=config.n_layer,
                      n_head=config.n_head, n_embd=config.n_embd, activation_function="gelu_new",
                      layer_norm_epsilon=1e-5, resid_pdrop=config.dropout, embd_pdrop=config.dropout,
                      attn_pdrop=config.dropout, tie_word_embeddings=True,
                      # <|endoftext|>, where the vocabulary has it (tiny test vocabularies do not)
                      bos_token_id=50256 if config.vocab_size > 50256 else None,
                      eos_token_id=50256 if config.vocab_size > 50256 else None)


def load_hf_model(name_or_path):
    """transformers.GPT2LMHeadModel (float32, eval) from a hub name or a local directory, with one-line
    errors for an unknown name, an incomplete directory, or no network."""
    from transformers import GPT2LMHeadModel

    if os.path.isdir(name_or_path):
        has_weights = any(os.path.exists(os.path.join(name_or_path, f))
                          for f in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
        if not os.path.exists(os.path.join(name_or_path, "config.json")) or not has_weights:
            raise FileNotFoundError(f"{name_or_path} is not an HF GPT-2 directory: it needs config.json and "
                                    "model.safetensors (as written by save_pretrained)")
        with open(os.path.join(name_or_path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "gpt2":
            raise ValueError(f"{name_or_path} holds a {model_type!r} model, not gpt2")
    elif name_or_path not in HF_NAMES:
        raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(HF_NAMES)} or a local HF directory")
    try:
        model = GPT2LMHeadModel.from_pretrained(name_or_path, dtype="float32", attn_implementation="eager")
    except OSError as e:
        if os.path.isdir(name_or_path):
            raise
        raise OSError(f"could not load {name_or_path!r} from the HF hub or the local HF cache (offline?); "
                      "pass a local directory written by save_pretrained instead") from e
    return model.eval()


def load_hf_state_dict(name_or_path):
    """(GPT2Config, {HF name: float32 numpy array}) without the attention-mask buffers."""
    hf_model = load_hf_model(name_or_path)
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()
             if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    lm_head = state.pop(HF_TIED_KEY, None)
    if lm_head is not None and not np.array_equal(lm_head, state["transformer.wte.weight"]):
        raise ValueError(f"{name_or_path}: lm_head.weight differs from wte.weight; GPT-2 ties them")
    return hf_model.config, state
