"""
nanochat's RL step in PyTorch on a CPU, written by reading its scripts/chat_rl.py: what its
get_batch makes of a question's samples (padding with <|assistant_end|>, targets -1 where the mask
is 0, advantages = rewards - their mean) and its training loop's step (the micro-batches of
device_batch_size samples, the loss -sum(log p x advantage) / (valid targets x micro-batches x
questions) backpropagated into the same .grad, then each group's rate set to initial_lr x (1 -
step / num_steps) and one optimizer step), over parity/nanochat_reference.py's GPT and
parity/nanochat_optim_reference.py's MuonAdamW with chat_rl's set-up (setup_optimizer's groups,
each rate times init_lr_frac; Muon's momentum left at 0.95). The samples are given: the sampling
is the engine's, checked on its own (parity/nanochat_engine_reference.py). Float32, eager.
archs/nanochat_rl.py is ours; tests/test_chat_rl.py holds it to this.
"""

import torch
import torch.nn.functional as F

from parity import nanochat_optim_reference

# chat_rl's defaults
RATES = dict(embedding_lr=0.2, unembedding_lr=0.004, matrix_lr=0.02, weight_decay=0.0)
INIT_LR_FRAC = 0.05
SCALAR_LR = 0.5  # setup_optimizer's default


def rollout_tensors(sequences, masks, rewards, pad_id):
    """get_batch's tensors of one question: (inputs, targets, rewards, advantages)."""
    longest = max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad_id] * (longest - len(s)) for s in sequences], dtype=torch.long)
    mask = torch.tensor([m + [0] * (longest - len(m)) for m in masks], dtype=torch.long)
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[mask[:, 1:] == 0] = -1
    rewards = torch.tensor(rewards, dtype=torch.float)
    return inputs, targets, rewards, rewards - rewards.mean()


def make_optimizer(model, rates=None, init_lr_frac=INIT_LR_FRAC):
    """setup_optimizer's MuonAdamW over the model's params, each group's lr (and initial_lr) times
    init_lr_frac, as chat_rl sets them."""
    rates = {**RATES, **(rates or {})}
    named = dict(model.named_parameters())
    groups = nanochat_optim_reference.param_groups(
        named,
        rates["unembedding_lr"],
        rates["embedding_lr"],
        rates["matrix_lr"],
        rates["weight_decay"],
        SCALAR_LR,
    )
    for group in groups:
        group["lr"] = group["lr"] * init_lr_frac
        group["initial_lr"] = group["lr"]
    return nanochat_optim_reference.MuonAdamW(groups)


def pass_loss(model, inputs, targets, advantages, num_passes, examples):
    """One micro-batch's loss: the PG objective over its valid targets, negated."""
    logits = model(inputs)  # (B, T, V) float32
    nll = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none"
    )
    logp = -nll.view_as(inputs)  # (B, T)
    objective = (logp * advantages.unsqueeze(-1)).sum()
    num_valid = (targets >= 0).sum().clamp(min=1)
    return -objective / (num_valid * num_passes * examples)


def rl_step(model, optimizer, questions, device_batch_size, step, num_steps, pad_id):
    """One step of chat_rl's loop: `questions` a list of (sequences, masks, rewards), one per
    example of the step -> (each micro-batch's loss, in order; each question's advantages). The
    model and the optimizer are updated in place."""
    losses, all_advantages = [], []
    model.train()
    for sequences, masks, rewards in questions:
        inputs_all, targets_all, _, advantages_all = rollout_tensors(
            sequences, masks, rewards, pad_id
        )
        all_advantages.append(advantages_all)
        assert inputs_all.size(0) % device_batch_size == 0
        num_passes = inputs_all.size(0) // device_batch_size
        for p in range(num_passes):
            rows = slice(p * device_batch_size, (p + 1) * device_batch_size)
            loss = pass_loss(
                model,
                inputs_all[rows],
                targets_all[rows],
                advantages_all[rows],
                num_passes,
                len(questions),
            )
            loss.backward()
            losses.append(loss.item())
    lrm = 1.0 - step / num_steps
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return losses, all_advantages
