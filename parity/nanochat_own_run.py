"""
nanochat's own side of parity/check_nanochat_run.py, each part a process of its own over a
checkout's code (its modules fix their dtype and base directory at import, from NANOCHAT_DTYPE and
NANOCHAT_BASE_DIR, which the caller sets):

- start: its GPT at the run's shape, its own init_weights, the zero output projections then drawn
  N(0, PROJECTION_STD) (unless --own_start), saved by its own save_checkpoint as step 0; with
  --optimizer_steps N, then N steps of its own MuonAdamW (setup_optimizer at base_train's rates,
  base_train's cosine weight decay over the N) on random tokens, saved as step N with its
  optimizer state (optim_N_rank0.pt, what chat_sft warm-starts from);
- train: its scripts/base_train.py (or --script: chat_sft) run as its command, with two things
  added and none changed: GPT.init_weights ends by loading that step-0 file (base_train has no
  init-from; its resume would also want an optimizer state; chat_sft loads its base checkpoint
  itself, no --start), and every training forward's loss is recorded to --losses;
- compare: two or three checkpoint directories read by its own checkpoint_manager.build_model,
  every tensor's largest difference from the first;
- gradients: the first gradient of the residual, x0 and backout lambdas from the step-0 file on
  one batch of its loader, in float32 and in float64, which says why its own start is
  ill-conditioned.

    python -m parity.nanochat_own_run start --checkout ../nanochat --out DIR --depth 2 ...
    python -m parity.nanochat_own_run train --checkout ../nanochat --start FILE --losses FILE \
        -- --depth=2 ...   # base_train's own flags after --
"""

import argparse
import json
import math
import os
import runpy
import sys

import torch

PROJECTION_STD = 0.02  # the drawn start's output projections: GPT-2's init scale
LAMBDAS = ("resid_lambdas", "x0_lambdas", "backout_lambda")


def import_nanochat(checkout):
    """Its modules, from the checkout (as its scripts see them: run from its root)."""
    sys.path.insert(0, os.path.abspath(checkout))
    from nanochat import checkpoint_manager, gpt

    return gpt, checkpoint_manager


def model_config(args):
    """base_train's build_model_meta: the width rounded up to whole heads of head_dim."""
    width = -(-args.depth * args.aspect_ratio // args.head_dim) * args.head_dim
    heads = width // args.head_dim
    return dict(
        sequence_len=args.seq,
        vocab_size=args.vocab,
        n_layer=args.depth,
        n_head=heads,
        n_kv_head=heads,
        n_embd=width,
        window_pattern=args.window,
    )


def start(args):
    gpt, checkpoint_manager = import_nanochat(args.checkout)
    torch.manual_seed(args.seed)
    config = model_config(args)
    model = gpt.GPT(gpt.GPTConfig(**config))
    model.init_weights()
    if not args.own_start:
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):  # its init's zeros
                torch.nn.init.normal_(p, std=PROJECTION_STD)
    optimizer = pretrained(model, config, args.optimizer_steps) if args.optimizer_steps else None
    step = args.optimizer_steps
    meta = {"step": step, "model_config": config, "val_bpb": None}
    state = None if optimizer is None else optimizer.state_dict()
    checkpoint_manager.save_checkpoint(args.out, step, model.state_dict(), state, meta)


BASE_TRAIN_RATES = dict(unembedding_lr=0.008, embedding_lr=0.3, matrix_lr=0.02, weight_decay=0.28)


def pretrained(model, config, steps, rows=2):
    """`steps` of its MuonAdamW on random tokens (seeded), the loop setting Muon's weight decay as
    base_train's get_weight_decay does over a run of `steps`: the optimizer, its state that of a
    pretraining's end."""
    optimizer = model.setup_optimizer(**BASE_TRAIN_RATES)
    model.train()
    for it in range(steps):
        tokens = torch.randint(0, config["vocab_size"], (rows, config["sequence_len"] + 1))
        for group in optimizer.param_groups:
            if group["kind"] == "muon":
                decay = 0.5 * (1 + math.cos(math.pi * it / steps))
                group["weight_decay"] = BASE_TRAIN_RATES["weight_decay"] * decay
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()).backward()
        optimizer.step()
    return optimizer


def start_weights_loader(gpt, path):
    """GPT.init_weights, then the step-0 file's weights (its rotary tables stay its init's)."""
    own_init = gpt.GPT.init_weights

    def init_then_load(model):
        own_init(model)
        model.load_state_dict(torch.load(path, map_location="cpu"), strict=True)

    return init_then_load


def train(args, script_argv):
    torch.set_num_threads(args.threads)
    gpt, _ = import_nanochat(args.checkout)
    sys.modules.setdefault("wandb", type(sys)("wandb"))  # imported, unused at --run=dummy
    if args.start:
        gpt.GPT.init_weights = start_weights_loader(gpt, args.start)
    losses, own_forward = [], gpt.GPT.forward

    def recorded_forward(model, idx, targets=None, **kw):
        loss = own_forward(model, idx, targets, **kw)
        if targets is not None and model.training:
            losses.append(loss.item())
        return loss

    gpt.GPT.forward = recorded_forward
    sys.argv = [args.script.replace(".", "/") + ".py", *script_argv]
    try:
        runpy.run_module(args.script, run_name="__main__")
    finally:
        with open(args.losses, "w") as f:
            json.dump(losses, f)


def compare(args):
    """{name: [largest |difference| from the first directory's, ...]} of each other directory."""
    _, checkpoint_manager = import_nanochat(args.checkout)
    states = []
    for directory in args.dirs:
        model, _, _ = checkpoint_manager.build_model(
            directory, args.step, torch.device("cpu"), phase="eval"
        )
        states.append({k: v.double() for k, v in model.state_dict().items()})
    first = states[0]
    found = {
        k: [float((s[k] - v).abs().max()) for s in states[1:]]
        + [float(v.abs().max()), float(v.norm())]
        for k, v in first.items()
        if k not in ("cos", "sin")
    }
    json.dump(found, sys.stdout)


def gradients(args):
    """The lambdas' first gradients from the step-0 file on its loader's first micro-batch."""
    gpt, _ = import_nanochat(args.checkout)
    from nanochat import dataloader, tokenizer

    state = torch.load(args.start, map_location="cpu")
    batch = dataloader.tokenizing_distributed_data_loader_bos_bestfit(
        tokenizer.get_tokenizer(), args.rows, args.seq, split="train", device="cpu"
    )
    x, y = next(batch)
    found = {}
    for dtype in (torch.float32, torch.float64):
        gpt.COMPUTE_DTYPE = dtype  # its forward casts the stream to it (the head's loss: float32)
        torch.set_default_dtype(dtype)
        with torch.device("meta"):
            model = gpt.GPT(gpt.GPTConfig(**json.loads(args.config)))
        model.to_empty(device="cpu")
        model.init_weights()
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        model.train()
        model(x, y).backward()
        params = dict(model.named_parameters())
        found[str(dtype).removeprefix("torch.")] = {
            k: params[k].grad.double().abs().max().item() for k in LAMBDAS
        }
    json.dump(found, sys.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("part", choices=("start", "train", "compare", "gradients"))
    p.add_argument("--checkout", required=True)
    p.add_argument("--out", help="start: the step-0 checkpoint's directory")
    p.add_argument("--start", help="train, gradients: the step-0 model file")
    p.add_argument("--losses", help="train: where each training forward's loss is written")
    p.add_argument("--script", default="scripts.base_train", help="train: its script (module)")
    p.add_argument("--threads", type=int, default=2, help="train: torch's CPU threads")
    p.add_argument("--dirs", nargs="+", help="compare: checkpoint directories")
    p.add_argument("--step", type=int, help="compare: the step")
    p.add_argument("--config", help="gradients: the model_config as JSON")
    p.add_argument("--rows", type=int, default=4)
    for name, default in (("depth", 2), ("aspect_ratio", 64), ("head_dim", 64), ("seq", 256)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--vocab", type=int)
    p.add_argument("--window", default="L")
    p.add_argument("--own_start", action="store_true")
    p.add_argument("--optimizer_steps", type=int, default=0, help="start: MuonAdamW steps saved")
    p.add_argument("--seed", type=int, default=0)
    argv = sys.argv[1:]
    ours, script_argv = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    args = p.parse_args(ours)
    if args.part == "train":
        train(args, script_argv)
    else:
        {"start": start, "compare": compare, "gradients": gradients}[args.part](args)


if __name__ == "__main__":
    main()
