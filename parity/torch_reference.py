"""
nanoGPT's training step in PyTorch: the reference that parity.check_train holds train.py's jitted
step to. transformers' GPT2LMHeadModel (tied head) + torch.optim.AdamW with nanoGPT's two parameter
groups, nanoGPT's get_lr, gradient accumulation by loss / K, clip_grad_norm_ (its clipping, around
an accurately summed norm: see global_norm), optional bf16 autocast. Runs on CPU.
"""

import math
import os
import tempfile

import numpy as np


def get_lr(it, c):
    """nanoGPT's learning rate decay scheduler (cosine with warmup), verbatim, in python floats."""
    if not c["decay_lr"]:
        return c["learning_rate"]
    # 1) linear warmup for warmup_iters steps
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > c["lr_decay_iters"]:
        return c["min_lr"]
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return c["min_lr"] + coeff * (c["learning_rate"] - c["min_lr"])


def configure_optimizers(model, c):
    """nanoGPT's GPT.configure_optimizers: every >=2-D tensor (matmul weights, embeddings) decays,
    biases and LayerNorms don't. named_parameters() yields the tied wte / lm_head tensor once."""
    import torch

    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay_params = [p for p in param_dict.values() if p.dim() >= 2]
    nodecay_params = [p for p in param_dict.values() if p.dim() < 2]
    optim_groups = [
        {"params": decay_params, "weight_decay": c["weight_decay"]},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    # eps: torch's default 1e-8, as nanoGPT (and train_step.make_optimizer)
    return torch.optim.AdamW(
        optim_groups, lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]), eps=1e-8
    )


def global_norm(tensors):
    """The norm of all tensors as one vector: clip_grad_norm_'s total_norm, summed accurately. On
    CPU, torch's vector_norm (and _foreach_norm, which clip_grad_norm_ uses) accumulates a tensor's
    squares in one float32 (pytorch/pytorch#169237): measured -2.7e-3 relative on a 50257 x 768
    random gradient (GPT-2's wte), 3.7e-4 on the global norm of a gpt2-sized step; sum() is a
    cascade sum (~1e-8). CUDA, where nanoGPT runs, sums in a tree."""
    import torch

    return torch.stack([t.pow(2).sum(dtype=torch.float64) for t in tensors]).sum().sqrt().float()


class TorchTrainer:
    """The model and optimizer of nanoGPT's train.py on an HF GPT-2 directory; step() is one
    iteration."""

    def __init__(self, model_dir, c, autocast_bf16=False):
        from dataio.weights import load_hf_model

        self.c, self.autocast_bf16 = c, autocast_bf16
        # float32; c["dropout"] must be 0: RNGs differ across frameworks
        self.model = load_hf_model(model_dir).train()
        self.optimizer = configure_optimizers(self.model, c)
        self.iter_num = 0

    def step(self, x, y):
        """x, y: (accum, B, T) int arrays -> {"loss": mean micro-batch loss, "grad_norm": pre-clip,
        "lr"}."""
        import torch
        import torch.nn.functional as F

        c, accum = self.c, x.shape[0]
        lr = get_lr(self.iter_num, c)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        losses = []
        for micro_step in range(accum):
            X = torch.from_numpy(np.asarray(x[micro_step], np.int64))  # (B, T)
            Y = torch.from_numpy(np.asarray(y[micro_step], np.int64))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast_bf16):
                logits = self.model(X).logits  # (B, T, vocab)
            # the loss in float32 (as CUDA autocast runs log_softmax / nll_loss, and as our model
            # does)
            loss = F.cross_entropy(logits.float().flatten(0, 1), Y.flatten(), ignore_index=-1)
            losses.append(loss.item())
            # scale the loss to account for gradient accumulation: the grads sum, we want their mean
            (loss / accum).backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = global_norm([p.grad for p in params])
        if c["grad_clip"] != 0.0:
            # clip_grad_norm_ is total_norm + clip_grads_with_norm_; only the norm is computed
            # differently (global_norm)
            torch.nn.utils.clip_grads_with_norm_(params, c["grad_clip"], grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iter_num += 1
        return {"loss": float(np.mean(losses)), "grad_norm": float(grad_norm), "lr": lr}

    def state_dict(self):
        """{HF name: float32 numpy}, without the tied lm_head.weight and the attention-mask
        buffers."""
        return {
            k: v.detach().float().numpy().copy()
            for k, v in self.model.state_dict().items()
            if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))
        }


def nanogpt_train_loop(model, r, data_dir):
    """nanoGPT's train.py loop on `model` with the settings `r` (bench.train_workers.MAIN_RUN): the
    random windows of get_batch, get_lr, clip_grad_norm_, an eval of eval_iters batches per split
    every eval_interval iterations, a checkpoint (torch.save) when val improves, loss.item() every
    iteration. Returns the last eval's losses."""
    import torch

    def get_batch(split):
        data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - r["block_size"], (r["batch_size"],))
        x = torch.stack(
            [torch.from_numpy(data[i : i + r["block_size"]].astype(np.int64)) for i in ix]
        )
        y = torch.stack(
            [torch.from_numpy(data[i + 1 : i + 1 + r["block_size"]].astype(np.int64)) for i in ix]
        )
        return x, y

    opt = configure_optimizers(model, r)

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {
            split: float(
                torch.stack([model(*get_batch(split))[1] for _ in range(r["eval_iters"])]).mean()
            )
            for split in ("train", "val")
        }
        model.train()
        return out

    best_val, losses = 1e9, None
    X, Y = get_batch("train")
    with tempfile.TemporaryDirectory() as out_dir:
        for it in range(r["max_iters"] + 1):
            for group in opt.param_groups:
                group["lr"] = get_lr(it, r)
            if it % r["eval_interval"] == 0:
                losses = estimate_loss()
                if losses["val"] < best_val and it > 0:
                    best_val = losses["val"]
                    torch.save(
                        {"model": model.state_dict(), "optimizer": opt.state_dict()},
                        os.path.join(out_dir, "ckpt.pt"),
                    )
            if it == r["max_iters"]:
                break
            _, loss = model(X, Y)
            X, Y = get_batch("train")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
    return losses
