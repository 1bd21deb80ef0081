"""
nanochat's MuonAdamW for one device, in PyTorch, written by reading nanochat/optim.py (its AdamW
and Muon steps, the Muon groups stacked by shape) and gpt.py's setup_optimizer (param_groups: the
six AdamW groups and the Muon ones, by state-dict name); eager, float32, as nanochat's optimizer
computes when COMPUTE_DTYPE is float32 (a CPU). The reference that archs/nanochat_optim.py is
held to in CI (tests/test_nanochat_optim.py), where no nanochat checkout is at hand.
"""

import torch

# Polar Express, 5 iterations, safety factor 2e-2, cushion 2 (Amsel, Persson, Musco, Gower 2025)
COEFFICIENTS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def param_groups(named, unembedding_lr, embedding_lr, matrix_lr, weight_decay, scalar_lr):
    """setup_optimizer's groups over `named` ({nanochat's state-dict name: param}): AdamW on the
    head, the token and value embeddings and the three kinds of scalars, each with its betas,
    eps, weight decay and rate (the head's and embeddings' scaled by sqrt(768 / n_embd)); Muon on
    the blocks' matrices, a group per shape (sorted). Each group's initial_lr is its lr."""
    n_embd = named["transformer.wte.weight"].shape[1]
    width_scale = (n_embd / 768) ** -0.5

    def named_as(*names, prefix=None):
        return [p for n, p in named.items() if n in names or (prefix and n.startswith(prefix))]

    head, wte = named_as("lm_head.weight"), named_as("transformer.wte.weight")
    value_embeds = named_as(prefix="value_embeds.")
    smear = named_as("smear_gate.weight", "smear_lambda", "backout_lambda")
    adamw = [  # params, lr, betas, weight decay
        (head, unembedding_lr * width_scale, (0.8, 0.96), 0.01),
        (wte, embedding_lr * width_scale, (0.8, 0.995), 0.001),
        (value_embeds, embedding_lr * width_scale * 0.5, (0.8, 0.995), 0.01),
        (named_as("resid_lambdas"), scalar_lr * 0.01, (0.8, 0.95), 0.05),
        (named_as("x0_lambdas"), scalar_lr, (0.96, 0.95), 0.0),
        (smear, 0.2, (0.8, 0.95), 0.0),
    ]
    groups = [
        dict(kind="adamw", params=ps, lr=lr, betas=betas, eps=1e-10, weight_decay=wd)
        for ps, lr, betas, wd in adamw
    ]
    blocks = named_as(prefix="transformer.h.")
    for shape in sorted({p.shape for p in blocks}):
        groups.append(
            dict(
                kind="muon",
                params=[p for p in blocks if p.shape == shape],
                lr=matrix_lr,
                momentum=0.95,
                ns_steps=5,
                beta2=0.9,
                weight_decay=weight_decay,
            )
        )
    assert sum(len(g["params"]) for g in groups) == len(named), "a param in no group"
    for group in groups:
        group["initial_lr"] = group["lr"]
    return groups


def adamw_(p, grad, state, lr, betas, eps, weight_decay):
    """One AdamW step in place: decoupled decay first, the moments as lerps, bias-corrected."""
    beta1, beta2 = betas
    state["step"] += 1
    p.mul_(1 - lr * weight_decay)
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
    corrected_sq = state["exp_avg_sq"] / (1 - beta2 ** state["step"])
    step_size = lr / (1 - beta1 ** state["step"])
    p.sub_(step_size * (state["exp_avg"] / (corrected_sq.sqrt() + eps)))


def orthogonalized(X, steps):
    """MuonEq's row equilibration, then Polar Express on each matrix of X (K, rows, cols)."""
    rows = X.size(-2)
    mean_row_norm = X.norm(dim=(-2, -1), keepdim=True) / rows**0.5
    X = X * (mean_row_norm / X.norm(dim=-1, keepdim=True).clamp_min(1e-6))
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    for a, b, c in COEFFICIENTS[:steps]:
        if X.size(-2) > X.size(-1):  # tall: the Gram matrix on the short side
            A = X.mT @ X
            X = a * X + X @ (b * A + c * (A @ A))
        else:
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
    return X


def muon_(params, grads, state, lr, momentum, weight_decay, beta2, steps):
    """One Muon step in place on a group of same-shape matrices, stacked (K, rows, cols)."""
    P, G = torch.stack(params), torch.stack(grads)
    K, rows, cols = P.shape
    row_wise = rows >= cols  # the second moment per row (else per column)
    if not state:
        state["momentum"] = torch.zeros_like(P)
        state["second"] = torch.zeros((K, rows, 1) if row_wise else (K, 1, cols))
    state["momentum"].lerp_(G, 1 - momentum)
    update = G.lerp(state["momentum"], momentum)  # Nesterov
    update = orthogonalized(update, steps)
    norm = update.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)
    update = update * (min(rows, cols) ** 0.5 / norm)  # Muon+: a semi-orthogonal matrix's norm
    # NorMuon's variance reduction, the update's norm kept
    dim = -1 if row_wise else -2
    mean_sq = update.square().mean(dim=dim, keepdim=True)
    norm_before = (mean_sq.sum(dim=(-2, -1), keepdim=True) * update.size(dim)).sqrt()
    state["second"].lerp_(mean_sq, 1 - beta2)
    inv_root = state["second"].clamp_min(1e-10).rsqrt()
    scaled_sq = (mean_sq * update.size(dim)) * inv_root.square()
    norm_after = scaled_sq.sum(dim=(-2, -1), keepdim=True).sqrt()
    update = update * (inv_root * (norm_before / norm_after.clamp_min(1e-10)))
    # cautious weight decay, at the shape-scaled rate
    lr = lr * max(1.0, rows / cols) ** 0.5
    agree = (update * P) >= 0
    P.sub_(lr * update + lr * weight_decay * P * agree)
    for p, new in zip(params, P.unbind(0)):
        p.copy_(new)


class MuonAdamW:
    """The optimizer over param_groups' groups (kind 'adamw' or 'muon'), stepped by step() after
    each param's .grad is set; the loop sets each group's lr, and Muon's momentum and
    weight_decay, before the step, as base_train does."""

    def __init__(self, groups):
        self.param_groups = groups
        self.state = {}  # AdamW: per param; Muon: per group, under its first param

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            if group["kind"] == "adamw":
                for p in group["params"]:
                    state = self.state.setdefault(p, {})
                    if not state:
                        state.update(step=0, exp_avg=torch.zeros_like(p))
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    hyper = (group["lr"], group["betas"], group["eps"], group["weight_decay"])
                    adamw_(p, p.grad, state, *hyper)
            else:
                params = group["params"]
                muon_(
                    params,
                    [p.grad for p in params],
                    self.state.setdefault(params[0], {}),
                    group["lr"],
                    group["momentum"],
                    group["weight_decay"],
                    group["beta2"],
                    group["ns_steps"],
                )
