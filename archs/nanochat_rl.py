"""
nanochat's reinforcement learning on GSM8K (karpathy/nanochat, scripts/chat_rl.py; its torch side in
parity/chat_rl_reference.py): the math of one step, from a question's sampled sequences. chat_rl
calls it "GRPO" in quotes, since what is left is close to REINFORCE:

- each sample's reward (1 for the right answer, else 0) minus the mean over the question's samples
  is its advantage (no division by the spread);
- the objective is the sum over the sampled tokens (mask 1: not the prompt, not the tool's forced
  output) of log p(token) times its sample's advantage, divided by the number of those tokens in
  the micro-batch of `device_batch_size` samples, by the micro-batches a question has and by the
  questions a step has (DAPO's token-level normalisation); the loss is its negative, and the
  gradients of every micro-batch of every question add up before one optimizer step;
- on policy: no ratio to an old policy, no clipping, no KL to a reference model;
- the optimizer is nanochat's MuonAdamW (archs/nanochat_optim.py) at setup_optimizer's rates times
  init_lr_frac (0.05), each falling linearly to 0 over the run (1 - step / num_steps); Muon's
  momentum stays at setup_optimizer's 0.95 and its weight decay at --weight-decay (chat_rl sets
  neither per step; its AdamW groups keep their own weight decays).

The functions are pure; RLStep holds them jitted for one model's structure.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from archs import nanochat_optim

SCALAR_LR = 0.5  # setup_optimizer's default: chat_rl does not pass one
MUON_MOMENTUM = 0.95  # setup_optimizer's; chat_rl never schedules it


def advantages(rewards):
    """A question's rewards (N,) -> their advantages: each minus their mean, float32."""
    rewards = jnp.asarray(rewards, jnp.float32)
    return rewards - jnp.mean(rewards)


def rollout_batch(sequences, masks, pad_id, length=None):
    """A question's samples (lists of ids: prompt + sampled, as the engine's generate_batch returns
    them) and their masks -> (inputs, targets), int32 numpy (N, T - 1): the rows padded with
    `pad_id` (chat_rl's <|assistant_end|>) and mask 0 to the longest (or to `length`, which causal
    attention and the ignored targets make invisible), inputs each row but its last id, targets
    each row but its first, -1 (ignored) wherever the target's mask is 0: the prompt, the tool's
    forced tokens and the padding."""
    longest = max(map(len, sequences))
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"rollout_batch: length {length} is shorter than a sample ({longest})")
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for row, (seq, m) in enumerate(zip(sequences, masks)):
        if len(seq) != len(m):
            raise ValueError(f"sample {row}: {len(seq)} ids but {len(m)} mask values")
        ids[row, : len(seq)], mask[row, : len(m)] = seq, m
    targets = np.where(mask[:, 1:] == 0, -1, ids[:, 1:]).astype(np.int32)
    return ids[:, :-1], targets


def token_logprobs(model, inputs, targets):
    """log p(target) (B, T) float32 under `model` (any of ours) for inputs, targets (B, T); 0 where
    the target is -1 (chat_rl's -cross_entropy(reduction='none', ignore_index=-1))."""
    _, x = model.hidden_states(inputs)  # (B, T, C)
    logits = model.logits(x).astype(jnp.float32)  # (B, T, V)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(targets >= 0, picked, 0.0)


def pass_loss(model, inputs, targets, advantages, passes):
    """chat_rl's loss of one micro-batch: -(sum of log p x its row's advantage) / (its targets that
    count (at least 1) x `passes`, the micro-batches of the whole step: micro-batches a question
    times questions a step)."""
    logp = token_logprobs(model, inputs, targets)  # (B, T)
    objective = jnp.sum(logp * advantages[:, None])
    valid = jnp.maximum(jnp.sum(targets >= 0), 1)
    return -objective / (valid * passes)


def lr_multiplier(it, num_steps):
    """chat_rl's get_lr_multiplier: 1 - it / num_steps, from 1 at step 0 towards 0."""
    return 1.0 - jnp.asarray(it, jnp.float32) / num_steps


def optimizer(
    n_embd,
    num_steps,
    embedding_lr=0.2,
    unembedding_lr=0.004,
    matrix_lr=0.02,
    weight_decay=0.0,
    init_lr_frac=0.05,
    dtype=None,
):
    """chat_rl's MuonAdamW: setup_optimizer's groups and rates (scalar_lr 0.5), every group's rate
    times init_lr_frac, then times lr_multiplier of the step; Muon's momentum 0.95 and weight decay
    `weight_decay` throughout. dtype: Polar Express's (None: float32)."""
    rates = nanochat_optim.group_rates(n_embd, unembedding_lr, embedding_lr, matrix_lr, SCALAR_LR)
    # in float64 as chat_rl's `group["lr"] * args.init_lr_frac`, rounded to float32 once
    rates = {group: rate * init_lr_frac for group, rate in rates.items()}
    return nanochat_optim.muon_adamw(
        rates,
        lambda count: lr_multiplier(count, num_steps),
        lambda count: MUON_MOMENTUM,
        lambda count: weight_decay,
        dtype=dtype,
    )


class RLStep:
    """One model's step, jitted for its structure: `gradients` of a micro-batch (its loss and its
    gradient, added to those so far), `update` (one optimizer step). The params are an nnx.State
    (nnx.split(model)[1]); a new row length compiles again (the command pads to buckets)."""

    def __init__(self, model, tx):
        self.graphdef, self.tx = nnx.graphdef(model), tx
        graphdef = self.graphdef

        def loss_and_grads(params, inputs, targets, adv, passes, so_far):
            def loss_of(params):
                return pass_loss(nnx.merge(graphdef, params), inputs, targets, adv, passes)

            loss, grads = jax.value_and_grad(loss_of)(params)
            return loss, jax.tree.map(jnp.add, so_far, grads)

        def update(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._loss_and_grads = jax.jit(loss_and_grads)
        self._update = jax.jit(update)

    def zero_grads(self, params):
        return jax.tree.map(jnp.zeros_like, params)

    def gradients(self, params, inputs, targets, adv, passes, so_far):
        """(the micro-batch's loss, so_far + its gradient): inputs, targets (B, T), adv (B,)."""
        return self._loss_and_grads(
            params,
            jnp.asarray(inputs, jnp.int32),
            jnp.asarray(targets, jnp.int32),
            jnp.asarray(adv, jnp.float32),
            jnp.float32(passes),
            so_far,
        )

    def update(self, params, opt_state, grads):
        """(params, opt_state) after one optimizer step on the summed gradients."""
        return self._update(params, opt_state, grads)
