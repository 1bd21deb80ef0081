"""
The training half of the record-20 reference (parity/speedrun20_reference.py holds the model): Muon
with batched Newton-Schulz, the record's optimizer groups, its lr schedule, momentum and window
warmups as pure functions of the step, one training step, and the sharded llm.c loader, written from
modded-nanogpt's records/track_1_short/2025-01-16_Sub3Min/ for one CPU process (no dist: the
record's per-rank split of Muon's params and its all-gathers change no param's update).
"""

import glob
import os
from pathlib import Path

import numpy as np
import torch

from parity.speedrun20_reference import next_multiple_of_n

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic, the slope at zero maximised


# ----------------------------------------------------------------------------- Muon
def zeropower_via_newtonschulz5(G, steps=5, dtype=torch.bfloat16):
    """~U V^T of each matrix in G (..., m, n), batched (by @scottjmaddox, put in the record by
    @YouJiacheng): `steps` quintic iterations in `dtype` on the wide orientation, from G over its
    Frobenius norm. Its singular values land in ~(0.5, 1.5), which trains as well as U V^T."""
    assert G.ndim >= 2
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # the top singular value <= 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A  # quintic strategy from @jxbz, @leloykun and @YouJiacheng
        X = a * X + B @ X
    return X.mT if tall else X


class Muon(torch.optim.Optimizer):
    """The record's Muon in one process: buf lerps to the grad by 1 - momentum, Nesterov lerps the
    grad to buf by momentum, the result orthogonalised and applied with -lr·sqrt(max(1, rows/cols))
    (qkv_w (3, d, d): three square matrices, scale 1). The record splits params across ranks by
    size and all-gathers the bf16 updates; each param's update is independent of that."""

    def __init__(
        self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=torch.bfloat16
    ):
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                g = p.grad
                assert g is not None
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - momentum)
                g = g.lerp(buf, momentum) if group["nesterov"] else buf
                g = zeropower_via_newtonschulz5(g, group["ns_steps"], group["ns_dtype"])
                p.add_(g, alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)


# ----------------------------------------------------------------------------- training
def gpt_sizes(c):
    """The record's GPT's arguments for train.py's settings c."""
    return dict(
        vocab_size=c["vocab_size"],
        num_layers=c["n_layer"],
        num_heads=c["n_head"],
        model_dim=c["n_embd"],
    )


def make_optimizers(model, ns_dtype=torch.bfloat16):
    """[Adam, Muon] with the record's groups: Adam (fused; betas (0.8, 0.95), eps 1e-10 by
    @YouJiacheng) on the head (lr 0.008), the embeddings (0.6) and every param of ndim < 2 (0.04);
    Muon (0.05, momentum 0.95) on the blocks' params of ndim >= 2. Each group's initial_lr is its
    base lr, as LambdaLR sets it."""
    hidden_matrix_params = [p for p in model.blocks.parameters() if p.ndim >= 2]
    embed_params = [model.embed.weight, *model.value_embeds.parameters()]
    scalar_params = [p for p in model.parameters() if p.ndim < 2]
    adam_groups = [
        dict(params=[model.lm_head.weight], lr=0.008),
        dict(params=embed_params, lr=0.6),
        dict(params=scalar_params, lr=0.04),
    ]
    adam = torch.optim.Adam(adam_groups, betas=(0.8, 0.95), eps=1e-10, fused=True)
    muon = Muon(hidden_matrix_params, lr=0.05, momentum=0.95, ns_dtype=ns_dtype)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
    return [adam, muon]


def get_lr(it, num_iterations, cooldown_frac=0.4):
    """The lr multiplier: 1 until the last cooldown_frac of the run, then linear to 0.1."""
    t = 1 - it / num_iterations  # time remaining
    assert 1 >= t >= 0
    w = min(t / cooldown_frac, 1.0)  # 1 -> 0
    return w * 1.0 + (1 - w) * 0.1


def muon_momentum(step, warmup_steps=300):
    """Muon's momentum, warmed up linearly from 0.85 to 0.95 over warmup_steps."""
    frac = min(step / warmup_steps, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def window_size(step, num_iterations, span=1728, block_size=128):
    """The sliding window in tokens, grown linearly by `span` over the run in whole blocks (128 ->
    1792; growth by @fernbear.bsky.social, block-wise by @YouJiacheng)."""
    return next_multiple_of_n(span * step / num_iterations, n=block_size)


def grad_norm(model):
    """The global norm of the model's gradients, in float64: torch's float32 norm of a 1.6M-entry
    table is 2e-5 off."""
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def train_step(
    model,
    optimizers,
    inputs,
    targets,
    step,
    num_iterations,
    seq_len,
    world_size=1,
    cooldown_frac=0.4,
    span=1728,
    warmup_steps=300,
    grad_norms=None,
):
    """The record's loop body at `step`: each seq_len sequence of inputs (1-D, the step's tokens)
    backpropagated, the gradients summed; divided by world_size (the all-reduce AVG: inputs as the
    concatenation of world_size ranks' batches); Muon's momentum warmed up; both optimizers stepped
    at lr = initial_lr * get_lr(step), as LambdaLR would set it; grads set to None. grad_norms: a
    list to append the gradient's global norm to, as the optimizers take it.
    -> (sequences,) the per-sequence losses."""
    sw = window_size(step, num_iterations, span, model.block_size) // model.block_size
    losses = []
    for input_seq, target_seq in zip(inputs.split(seq_len), targets.split(seq_len)):
        loss = model(input_seq, target_seq, sw)
        loss.backward()
        losses.append(loss.detach())
    if world_size > 1:
        for p in model.parameters():
            p.grad /= world_size
    if grad_norms is not None:
        grad_norms.append(grad_norm(model))
    for group in optimizers[1].param_groups:
        group["momentum"] = muon_momentum(step, warmup_steps)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * get_lr(step, num_iterations, cooldown_frac)
        opt.step()
    model.zero_grad(set_to_none=True)
    return torch.stack(losses)


# ----------------------------------------------------------------------------- the loader
def load_shard(path):
    """An llm.c shard: 256 int32 (magic 20240520, version 1, token count, ...), then uint16
    tokens -> np.uint16 (count,)."""
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    num_tokens = int(header[2])  # claimed
    tokens = np.fromfile(path, dtype=np.uint16, count=num_tokens, offset=256 * 4)
    assert len(tokens) == num_tokens, "number of tokens read does not match header"
    return tokens


def data_generator(files, batch_size, rank, world_size):
    """The record's loader: files (a glob pattern or paths) read once in sorted order; each step
    takes batch_size tokens (+1), rank r's share the r-th local_batch_size of them -> (inputs
    int32, targets int64), each (local_batch_size,). A shard moves on when pos + batch_size + 1 >=
    its length (a tail that would just fit is dropped too). Ends when the files do (the record's
    raises)."""
    if isinstance(files, (str, os.PathLike)):
        files = glob.glob(os.fspath(files))
    assert batch_size % world_size == 0
    local_batch_size = batch_size // world_size
    file_iter = iter(sorted(Path(f) for f in files))
    tokens, pos = load_shard(next(file_iter)), 0
    while True:
        if pos + batch_size + 1 >= len(tokens):
            path = next(file_iter, None)
            if path is None:
                return
            tokens, pos = load_shard(path), 0
        buf = torch.from_numpy(tokens[pos + rank * local_batch_size :][: local_batch_size + 1])
        pos += batch_size
        yield buf[:-1].to(torch.int32), buf[1:].to(torch.int64)
