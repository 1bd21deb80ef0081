"""
modded-nanogpt's record 5 in PyTorch (KellerJordan/modded-nanogpt,
records/track_1_short/2024-10-14_ModernArch/ train_gpt2.py), the reference that parity.check_train
--recipe=speedrun holds our speedrun to: its GPT (rotary with bfloat16 tables, QK-norm, weightless
RMSNorm, ReLU², zero-initialised projections, no position embedding, head tied to the embedding),
its Muon, its trapezoid schedule, its two optimizers and its sequential shard loader, written from
the record's code. Differences, each for a reason: the Newton-Schulz dtype is a parameter (the
record: bf16; parity: float32), forward() without targets returns every position's logits (the
record's only the last one, an inference shortcut), and nothing is compiled or distributed (CPU, one
process standing for the record's W ranks).
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the record's quintic: the slope at zero maximised


def zeropower_via_newtonschulz5(G, steps=5, eps=1e-7, dtype=torch.bfloat16):
    """The record's orthogonalisation of a 2-D G: ~U V^T of its SVD, by `steps` quintic
    Newton-Schulz iterations on the wide orientation, in `dtype`."""
    assert G.ndim == 2
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    X = X / (X.norm() + eps)  # the top singular value <= 1
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = A @ X
        X = a * X + b * B + c * A @ B
    return X.T if tall else X


class Muon(torch.optim.Optimizer):
    """The record's Muon: SGD momentum (buf = m*buf + g), Nesterov (g + m*buf), the update
    orthogonalised and scaled by sqrt(max(rows, cols)); a (3C, C) fused QKV weight as three (C, C)
    matrices, scaled by sqrt(C)."""

    def __init__(
        self,
        params,
        lr=3e-4,
        momentum=0.95,
        nesterov=True,
        backend_steps=5,
        ns_dtype=torch.bfloat16,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                backend_steps=backend_steps,
                ns_dtype=ns_dtype,
            ),
        )

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, momentum, steps = group["lr"], group["momentum"], group["backend_steps"]
            zeropower = lambda g: zeropower_via_newtonschulz5(g, steps, dtype=group["ns_dtype"])  # noqa: E731
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(g)
                if group["nesterov"]:
                    g = g.add(buf, alpha=momentum)
                if g.size(0) == 3 * g.size(1):  # grouped QKV
                    g = torch.cat([zeropower(g1) for g1 in g.split(g.size(1))])
                    scale = g.size(1) ** 0.5
                else:
                    g = zeropower(g)
                    scale = max(g.size(0), g.size(1)) ** 0.5  # the update's mean square 1
                p.add_(g, alpha=-lr * scale)  # a bf16 g is promoted: the param stays float32


def get_lr(it, num_iterations, warmup_iters, warmdown_iters):
    """The record's schedule, a multiplier of each optimizer's lr: linear warmup, constant, linear
    warmdown to 0."""
    assert it <= num_iterations
    if it < warmup_iters:
        return (it + 1) / warmup_iters
    if it < num_iterations - warmdown_iters:
        return 1.0
    return (num_iterations - it) / warmdown_iters


class Rotary(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x):
        t = torch.arange(x.shape[1]).type_as(self.inv_freq)
        freqs = torch.outer(t, self.inv_freq)
        # the record caches its tables in bfloat16, and applies them to float32 activations as they
        # are
        return freqs.cos().bfloat16()[None, :, None, :], freqs.sin().bfloat16()[None, :, None, :]


def apply_rotary_emb(x, cos, sin):
    """x (B, T, nh, hd): its two halves rotated against each other."""
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_k = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_v = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.c_proj.weight.data.zero_()  # zero init suggested by @Grad62304977
        self.rotary = Rotary(self.head_dim)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (
            f(x).view(B, T, self.n_head, self.head_dim) for f in (self.c_q, self.c_k, self.c_v)
        )
        cos, sin = self.rotary(q)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        # QK norm suggested by @Grad62304977
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.c_proj(y.transpose(1, 2).contiguous().view_as(x))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.c_proj.weight.data.zero_()  # zero init suggested by @Grad62304977

    def forward(self, x):
        # ReLU² suggested by @SKYLINEZ007 and @Grad62304977
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(F.rms_norm(x, (x.size(-1),)))
        return x + self.mlp(F.rms_norm(x, (x.size(-1),)))


@dataclass
class GPTConfig:  # the record's fields and defaults
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6  # head dim 128 suggested by @Grad62304977
    n_embd: int = 768


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # tied: the embedding is lm_head's Linear init
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        """idx (B, T) -> (logits (B, T, vocab) float32, the mean cross-entropy or None)."""
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(F.rms_norm(x, (x.size(-1),))).float()
        loss = (
            None
            if targets is None
            else F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        )
        return logits, loss


def make_optimizers(
    model, learning_rate, muon_learning_rate, momentum=0.95, ns_dtype=torch.bfloat16
):
    """The record's pair: Adam (AdamW without decay) on the head (= the tied embedding), Muon on the
    blocks."""
    adam = torch.optim.AdamW(
        model.lm_head.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0
    )
    muon = Muon(
        model.transformer.h.parameters(),
        lr=muon_learning_rate,
        momentum=momentum,
        ns_dtype=ns_dtype,
    )
    return [adam, muon]


class SequentialLoader:
    """The record's DistributedDataLoader for `world` ranks at once: rank r's batch k is B*T+1
    tokens from r*B*T of the k-th global window of world*B*T tokens; a shard's tail that cannot hold
    the next window (+1) is dropped, the next shard starts over. `shards`: the shards' token arrays.
    next_batch() -> (x, y) of every rank, ranks stacked: (world*B, T)."""

    def __init__(self, shards, B, T, world=1):
        self.shards, self.B, self.T, self.world = [np.asarray(s) for s in shards], B, T, world
        assert all(len(s) >= world * B * T + 1 for s in self.shards)
        self.reset()

    def reset(self):
        self.shard, self.position = 0, 0

    def next_batch(self):
        n = self.world * self.B * self.T
        buf = torch.tensor(
            self.shards[self.shard][self.position : self.position + n + 1].astype(np.int64)
        )
        self.position += n
        if self.position + n + 1 > len(self.shards[self.shard]):
            self.shard, self.position = (self.shard + 1) % len(self.shards), 0
        return buf[:-1].view(-1, self.T), buf[1:].view(-1, self.T)


class Trainer:
    """The record's training section on `model`: each micro-batch's loss backpropagated (under bf16
    autocast with autocast_bf16), the summed gradients divided by their number, no clipping, both
    optimizers stepped, then their LambdaLR(get_lr) schedulers. c: train.py's settings
    (learning_rate, muon_learning_rate, muon_momentum, muon_ns_dtype, max_iters, warmup_iters,
    warmdown_iters)."""

    def __init__(self, model, c, autocast_bf16=False):
        self.model, self.autocast_bf16 = model.train(), autocast_bf16
        ns_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[c["muon_ns_dtype"]]
        self.optimizers = make_optimizers(
            model, c["learning_rate"], c["muon_learning_rate"], c["muon_momentum"], ns_dtype
        )
        schedule = lambda it: get_lr(it, c["max_iters"], c["warmup_iters"], c["warmdown_iters"])  # noqa: E731
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(opt, schedule) for opt in self.optimizers
        ]

    def step(self, x, y):
        """x, y: (accum, B, T) int arrays -> {"loss": mean micro-batch loss, "grad_norm", "lr":
        Adam's}."""
        from parity.torch_reference import global_norm

        accum, lr = x.shape[0], self.optimizers[0].param_groups[0]["lr"]
        losses = []
        for X, Y in zip(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast_bf16):
                _, loss = self.model(
                    torch.from_numpy(np.asarray(X, np.int64)),
                    torch.from_numpy(np.asarray(Y, np.int64)),
                )
            loss.backward()
            losses.append(loss.item())
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            p.grad /= accum
        grad_norm = global_norm([p.grad for p in params])
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
        self.model.zero_grad(set_to_none=True)
        return {"loss": float(np.mean(losses)), "grad_norm": float(grad_norm), "lr": lr}

    def state_dict(self):
        """{the record's name: float32 numpy}, without the tied lm_head.weight
        (transformer.wte.weight holds it)."""
        return {
            k: v.detach().float().numpy().copy()
            for k, v in self.model.state_dict().items()
            if k != "lm_head.weight"
        }
