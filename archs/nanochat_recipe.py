"""
nanochat's one dial: a run's every setting from the model's depth, as scripts/base_train.py
resolves them. The model's shape (build_model_meta: width depth x aspect_ratio rounded up to whole
heads of head_dim), its parameter counts and FLOPs per token (gpt.py's num_scaling_params and
estimate_flops), the horizon (num_iterations, else target_flops, else target_param_data_ratio x
the scaling params: the blocks' matrices and the head), the batch from the Power Lines rule
against d12 (B_ref 2^19 tokens), the rates scaled by sqrt(B / B_ref) and, for AdamW's embeddings
and head, by 1/sqrt(n_embd / 768) (archs/nanochat_optim.group_rates), Muon's weight decay by
sqrt(B / B_ref) x D_ref / D, and the gradient accumulation steps. resolve() returns a Recipe;
Recipe.summary() prints what base_train prints of it.
"""

import math
from dataclasses import dataclass

from archs import nanochat_optim
from archs.nanochat_attention import VE_GATE_CHANNELS, has_ve, window_sizes
from configurator import UsageError
from dataio.nanochat_checkpoint import config_args
from model import GPTConfig

REF_DEPTH = 12  # the model the hyperparameters were tuned at (muP style, transferred by depth)
B_REF = 2**19  # d12's optimal batch in tokens (measured by nanochat)
BATCH_EXPONENT = 0.383  # Power Lines: B_opt ~ D^0.383 (Bergsma et al., arXiv 2505.13738)
# nanochat's GPT's (archs/nanochat.py, which imports this module, takes them from here): its
# vocabulary padded to a multiple of 64, its smear gate reading the embedding's first 24 channels
VOCAB_MULTIPLE = 64
SMEAR_CHANNELS = 24


def model_shape(
    depth, aspect_ratio=64, head_dim=128, max_seq_len=2048, vocab_size=32768, window_pattern="SSSL"
):
    """build_model_meta's GPTConfig fields: n_embd = depth x aspect_ratio rounded up to a multiple
    of head_dim (so every head is head_dim wide), n_head = n_kv_head = n_embd / head_dim."""
    n_embd = -(-depth * aspect_ratio // head_dim) * head_dim
    n_head = n_embd // head_dim
    return dict(
        sequence_len=max_seq_len,
        vocab_size=vocab_size,
        n_layer=depth,
        n_head=n_head,
        n_kv_head=n_head,
        n_embd=n_embd,
        window_pattern=window_pattern,
    )


def param_counts(shape):
    """num_scaling_params of a GPT of `shape` (model_shape): each group's params and the total."""
    n_layer, n_embd, n_head, n_kv_head = (
        shape[k] for k in ("n_layer", "n_embd", "n_head", "n_kv_head")
    )
    vocab = -(-shape["vocab_size"] // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    kv_dim = n_kv_head * (n_embd // n_head)
    with_ve = sum(has_ve(i, n_layer) for i in range(n_layer))
    attention = n_embd * n_embd + 2 * n_embd * kv_dim + n_embd * n_embd  # c_q, c_k, c_v, c_proj
    mlp = 2 * 4 * n_embd * n_embd  # c_fc, c_proj
    ve_gates = with_ve * VE_GATE_CHANNELS * n_kv_head
    counts = {
        "wte": vocab * n_embd,
        "value_embeds": with_ve * vocab * kv_dim,
        "lm_head": n_embd * vocab,
        "transformer_matrices": n_layer * (attention + mlp) + ve_gates,
        # resid and x0 lambdas, the smear gate, smear_lambda, backout_lambda
        "scalars": 2 * n_layer + SMEAR_CHANNELS + 2,
    }
    return counts | {"total": sum(counts.values())}


def scaling_params(counts):
    """The params the horizon scales with: the blocks' matrices and the head (nanochat's LOG,
    2026-01-27: the cleanest scaling laws)."""
    return counts["transformer_matrices"] + counts["lm_head"]


def flops_per_token(shape):
    """estimate_flops: 6 per matmul weight (the blocks, the head, the smear gate; embeddings are
    lookups), plus 12 x heads x head_dim x each layer's attended length."""
    counts = param_counts(shape)
    matmul = counts["transformer_matrices"] + counts["lm_head"] + SMEAR_CHANNELS
    head_dim = shape["n_embd"] // shape["n_head"]
    attention = sum(
        12 * shape["n_head"] * head_dim * min(w, shape["sequence_len"])
        for w in window_sizes(GPTConfig(**config_args(shape)))
    )
    return 6 * matmul + attention


@dataclass(frozen=True)
class Recipe:
    """A nanochat run's settings, resolved from its depth (resolve)."""

    depth: int
    model: dict  # GPTConfig's fields (model_shape)
    param_counts: dict  # num_scaling_params
    scaling_params: int  # the blocks' matrices + the head
    flops_per_token: int
    target_tokens: int  # target_param_data_ratio x scaling_params
    total_batch_size: int  # tokens a step
    batch_lr_scale: float  # sqrt(total_batch_size / B_REF)
    weight_decay: float  # Muon's, scaled; its schedule's start
    num_iterations: int
    horizon: str  # which rule set num_iterations
    rates: dict  # each optimizer group's initial rate (nanochat_optim.group_rates)
    device_batch_size: int
    devices: int
    grad_accum_steps: int
    warmup_steps: int
    warmdown_ratio: float
    final_lr_frac: float
    base_weight_decay: float  # the unscaled weight decay asked for

    def schedules(self):
        """base_train's (lr multiplier, Muon momentum, Muon weight decay) for this run."""
        return nanochat_optim.schedules(
            self.num_iterations,
            self.weight_decay,
            self.warmup_steps,
            self.warmdown_ratio,
            self.final_lr_frac,
        )

    def optimizer(self, dtype=None):
        """nanochat's MuonAdamW for this run (dtype: Polar Express's, None for float32)."""
        return nanochat_optim.muon_adamw(self.rates, *self.schedules(), dtype=dtype)

    def summary(self):
        """What base_train prints of these settings, line by line."""
        m, tokens = self.model, self.total_batch_size * self.num_iterations
        micro = self.device_batch_size * m["sequence_len"]
        lines = [
            f"Model: depth {self.depth}, n_embd {m['n_embd']}, n_head {m['n_head']}, "
            f"n_kv_head {m['n_kv_head']}, sequence_len {m['sequence_len']}, vocab_size "
            f"{m['vocab_size']}, window_pattern {m['window_pattern']}",
            "Parameter counts:",
            *(f"{k:24s}: {v:,}" for k, v in self.param_counts.items()),
            f"{'scaling (matrices+head)':24s}: {self.scaling_params:,}",
            f"Estimated FLOPs per token: {self.flops_per_token:e}",
            f"Batch size: {self.total_batch_size:,} tokens (reference: {B_REF:,})",
            f"Scaling LRs by {self.batch_lr_scale:.4f}; AdamW's embeddings and head also by "
            f"{(m['n_embd'] / nanochat_optim.D_MODEL_REF) ** -0.5:.6f} (1/sqrt(n_embd/768))",
            "Initial rates: " + ", ".join(f"{g} {r:.6g}" for g, r in self.rates.items()),
            f"Weight decay: {self.base_weight_decay:.6f} scaled to {self.weight_decay:.6f}",
            f"Number of iterations ({self.horizon}): {self.num_iterations:,}",
            f"Total number of training tokens: {tokens:,}",
            f"Tokens : Scaling params ratio: {tokens / self.scaling_params:.2f}",
            f"Total training FLOPs estimate: {self.flops_per_token * tokens:e}",
            f"Tokens / micro-batch / rank: {self.device_batch_size} x {m['sequence_len']} = "
            f"{micro:,}",
            f"Tokens / micro-batch: {micro * self.devices:,}",
            f"Total batch size {self.total_batch_size:,} => gradient accumulation steps: "
            f"{self.grad_accum_steps}",
        ]
        return "\n".join(lines)


def resolve(
    depth=20,
    aspect_ratio=64,
    head_dim=128,
    max_seq_len=2048,
    vocab_size=32768,
    window_pattern="SSSL",
    num_iterations=-1,
    target_flops=-1.0,
    target_param_data_ratio=12.0,
    device_batch_size=32,
    total_batch_size=-1,
    devices=1,
    embedding_lr=0.3,
    unembedding_lr=0.008,
    matrix_lr=0.02,
    scalar_lr=0.5,
    weight_decay=0.28,
    warmup_steps=40,
    warmdown_ratio=0.65,
    final_lr_frac=0.05,
):
    """base_train's settings for a model of `depth` (its command-line names and defaults; -1
    leaves a setting to the rules), in base_train's order and arithmetic -> Recipe. UsageError
    for no horizon, or a batch that is not whole micro-batches on every device."""
    dims = dict(
        aspect_ratio=aspect_ratio,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        vocab_size=vocab_size,
        window_pattern=window_pattern,
    )
    shape = model_shape(depth, **dims)
    counts = param_counts(shape)
    num_scaling = scaling_params(counts)
    flops = flops_per_token(shape)
    target_tokens = int(target_param_data_ratio * num_scaling)
    d_ref = target_param_data_ratio * scaling_params(param_counts(model_shape(REF_DEPTH, **dims)))
    if total_batch_size == -1:  # Power Lines, rounded to the nearest power of two
        predicted = B_REF * (target_tokens / d_ref) ** BATCH_EXPONENT
        total_batch_size = 2 ** round(math.log2(predicted))
    batch_ratio = total_batch_size / B_REF
    batch_lr_scale = 1.0 if batch_ratio == 1.0 else batch_ratio**0.5  # AdamW's sqrt rule
    # T_epoch = B / (lr wd D) kept constant (Wang & Aitchison, arXiv 2405.13698)
    weight_decay_scaled = (
        weight_decay * math.sqrt(total_batch_size / B_REF) * (d_ref / target_tokens)
    )
    if num_iterations > 0:
        horizon = "given"
    elif target_flops > 0:
        num_iterations, horizon = round(target_flops / (flops * total_batch_size)), "target FLOPs"
    elif target_param_data_ratio > 0:
        num_iterations, horizon = target_tokens // total_batch_size, "target data:param ratio"
    else:
        raise UsageError(
            "no training horizon: give num_iterations, target_flops or target_param_data_ratio"
        )
    world_tokens = device_batch_size * max_seq_len * devices
    if total_batch_size % world_tokens:
        raise UsageError(
            f"total_batch_size ({total_batch_size:,}) must be a multiple of device_batch_size x "
            f"max_seq_len x devices ({world_tokens:,})"
        )
    rates = nanochat_optim.group_rates(
        shape["n_embd"],
        unembedding_lr * batch_lr_scale,
        embedding_lr * batch_lr_scale,
        matrix_lr * batch_lr_scale,
        scalar_lr * batch_lr_scale,
    )
    return Recipe(
        depth=depth,
        model=shape,
        param_counts=counts,
        scaling_params=num_scaling,
        flops_per_token=flops,
        target_tokens=target_tokens,
        total_batch_size=total_batch_size,
        batch_lr_scale=batch_lr_scale,
        weight_decay=weight_decay_scaled,
        num_iterations=num_iterations,
        horizon=horizon,
        rates=rates,
        device_batch_size=device_batch_size,
        devices=devices,
        grad_accum_steps=total_batch_size // world_tokens,
        warmup_steps=warmup_steps,
        warmdown_ratio=warmdown_ratio,
        final_lr_frac=final_lr_frac,
        base_weight_decay=weight_decay,
    )
