"""
nanochat's finetuning schedules (scripts/chat_sft.py), written for a jitted step: chat_sft sets
each step's learning rate from the fraction of its mixture consumed so far (its loader's progress,
read one micro-batch ahead), and stops when the mixture is consumed, so neither the horizon nor the
rates are known from the step's number. They are from the data, though: its packing depends only
on the rendered conversations' lengths. `progress_table` runs the loader once over the mixture
(dataio/sft_loader.py, the same code the run then reads its batches with) and returns each step's
progress and the number of steps; the step then looks its multiplier up by its count.

chat_sft's --num-iterations counts micro-batches and stops when its loader has fetched that many
(one read ahead of the step): our max_iters counts steps, and max_iters = N with A micro-batches a
step is its --num-iterations = N x A + 1.
"""

import jax.numpy as jnp

INIT_LR_FRAC = 0.8  # chat_sft's --init-lr-frac: each group starts at 0.8 of its base rate
WARMUP_RATIO, WARMDOWN_RATIO, FINAL_LR_FRAC = 0.0, 0.5, 0.0  # its defaults, fractions of progress
MOMENTUM_WARMUP = 300  # Muon's momentum 0.85 -> 0.95 over its first 300 steps


def lr_multiplier(progress, warmup_ratio=WARMUP_RATIO, warmdown_ratio=WARMDOWN_RATIO, final=0.0):
    """chat_sft's get_lr_multiplier of progress in [0, 1+]: a warmup over warmup_ratio (which a
    ratio of 0 skips), 1, then linearly to `final` over the last warmdown_ratio; past 1 (its loader
    counts a last micro-batch beyond the mixture) it keeps going, as its formula does."""
    progress = jnp.asarray(progress, jnp.float32)
    decay = (progress - (1.0 - warmdown_ratio)) / warmdown_ratio
    return jnp.where(
        progress < warmup_ratio,
        (progress + 1e-8) / max(warmup_ratio, 1e-30),
        jnp.where(progress <= 1.0 - warmdown_ratio, 1.0, (1 - decay) * 1.0 + decay * final),
    )


def muon_momentum(it, warmup=MOMENTUM_WARMUP):
    """chat_sft's get_muon_momentum: 0.85 -> 0.95 over the first `warmup` steps, then 0.95."""
    frac = jnp.minimum(jnp.asarray(it, jnp.float32) / warmup, 1.0)
    return (1 - frac) * 0.85 + frac * 0.95


def progress_table(loader, accum):
    """(steps, progress): the steps chat_sft's loop takes over `loader` (a fresh
    dataio.sft_loader.ConversationLoader of the run, built with num_iterations = max_iters x
    accum + 1 when max_iters is given) at `accum` micro-batches a step, and the progress its
    learning rate reads at each. The loader is consumed."""
    progress = []
    while not loader.last_step:  # chat_sft's loop: stop at the top when the last is fetched
        loader.next(accum)
        progress.append(loader.progress)
    return len(progress), progress
