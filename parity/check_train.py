"""
Training parity: nanoGPT's training step in PyTorch (parity/torch_reference.py: transformers'
GPT2LMHeadModel, AdamW with nanoGPT's two parameter groups, get_lr, accumulation by loss / K,
clipping) against train.py's own jitted step (make_optimizer, init_state and make_train_step on
compute/sharding.py's mesh, as train.py uses them), from the same weights on the same batches: loss,
pre-clip grad norm and lr at every step, every parameter at the end. The two sides are
parity/train_sides.py's, the judgement parity/train_report.py's.

    # tiny random GPT-2, fp32, 50 steps, offline
    python -m parity.check_train
    # each step's rows as 4 micro-batches (same tokens)
    python -m parity.check_train --accum 4
    # 8-way data parallel (fake CPU devices when needed)
    python -m parity.check_train --devices 8
    # sharded: 8 devices as fsdp 4 x tensor 2
    python -m parity.check_train --fsdp 4 --tensor_parallel 2
    # bf16 against the fp32 reference, next to torch autocast's
    python -m parity.check_train --dtype bfloat16
    # each setting of ours the same: --attention, --remat,
    python -m parity.check_train --remat block
    # --loss-chunk, --scan_layers (train.py's, same names)
    python -m parity.check_train --loss-chunk 8
    # gpt2-shaped random weights (124M; slow on a CPU)
    python -m parity.check_train --model gpt2 --steps 3
    python -m parity.check_train --model DIR              # any HF GPT-2 directory (save_pretrained)
    # golden run on the bundled data
    python -m parity.check_train --config shakespeare_char --steps 200

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from configurator import InputNotFound, UsageError, configure, exit_on_bad_input, require_extras
from dataio.dataloader import data_dir_for, data_meta
from parity.common import HF_SIZES, add_step_args, pin_numerics, random_hf_model
from parity.train_report import report
from parity.train_sides import (
    Run,
    check_rows,
    hf_vocab_size,
    make_batches,
    make_trainers,
    train_side,
)

# jax, and our modules on it (model, settings, sharding), are imported where they are used: bad
# arguments fail before jax loads, in a fraction of a second (parse_args)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny run: nanoGPT's optimizer defaults (betas 0.9/0.95, weight decay 0.1, clip 1.0) at a
# learning rate that moves a tiny model far in 50 steps (and clips steps 3-10), the schedule
# squeezed into --steps.
TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64)
TINY_RUN = dict(rows=32, seq_len=32, learning_rate=1e-2, min_lr=1e-3)
# --model gpt2* / DIR: a few short rows, so that a CPU takes a step of 124M in seconds
LARGE_RUN = dict(rows=8, seq_len=64, learning_rate=6e-4, min_lr=6e-5)
# The golden run: config/train_<name>.py with nanoGPT's README overrides for a CPU ("I only have a
# macbook"), and bias=True (an HF GPT-2 always has biases; dropout is 0 there too: the frameworks
# draw different masks).
GOLDEN_OVERRIDES = [
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
    "--bias=True",
]


def check(run, dtype="float32"):
    """Train both sides on the same batches; print the report; return (ok, figures)."""
    import jax

    pin_numerics()
    batches = make_batches(run)
    c = run.c
    print(
        f"{run.steps} steps of {run.rows} x {run.seq_len} tokens ({run.accum} micro-batch(es)), "
        f"{dtype}; torch on cpu, ours on {run.devices} {jax.devices()[0].platform} device(s) (fsdp "
        f"{run.fsdp}, tensor {run.tensor_parallel}; attention {c['attention']}, remat "
        f"{c['remat']}, loss_chunk {c['loss_chunk']}); data {run.data_dir}"
    )
    print(
        f"AdamW lr {c['learning_rate']:g} (warmup {c['warmup_iters']}, cosine to {c['min_lr']:g} "
        f"at {c['lr_decay_iters']}{'' if c['decay_lr'] else '; decay_lr off'}), betas "
        f"({c['beta1']}, {c['beta2']}), weight decay {c['weight_decay']:g} on >=2-D tensors, grad "
        f"clip {c['grad_clip']:g}"
    )
    results = {
        side: train_side(make(), batches) for side, make in make_trainers(run, dtype).items()
    }
    return report(run, results, dtype)


# --- the runs the CLI offers
# -----------------------------------------------------------------------


def write_tokens(path, vocab_size, n=200_000, seed=0):
    """A uint16 train.bin with something to learn: each token is the previous one plus 1, 2 or 3
    (mod vocab)."""
    rng = np.random.default_rng(seed)
    (np.cumsum(rng.integers(1, 4, n)) % vocab_size).astype(np.uint16).tofile(path)


def config_path(name):
    return name if name.endswith(".py") else os.path.join(REPO, "config", f"train_{name}.py")


def make_run(args, tmp):
    """The Run for the parsed arguments, with the model directory and data it needs written under
    tmp."""
    from run.settings import DEFAULTS

    model_dir = os.path.join(tmp, "model")
    if args.config:
        from flax import nnx

        from model import GPT, GPTConfig

        c = configure(DEFAULTS, [config_path(args.config), *GOLDEN_OVERRIDES])
        data_dir = os.path.abspath(data_dir_for(c["dataset"]))
        # as train.py: the setting, meta.pkl's, GPT-2's
        vocab_size = c["vocab_size"] or data_meta(data_dir)[0] or 50304
        config = GPTConfig(
            block_size=c["block_size"],
            vocab_size=vocab_size,
            n_layer=c["n_layer"],
            n_head=c["n_head"],
            n_embd=c["n_embd"],
            dropout=0.0,
            bias=True,
        )
        # train.py's init from scratch, ours -> torch
        GPT(config, nnx.Rngs(c["seed"])).save_pretrained(model_dir)
        rows, seq_len = c["batch_size"] * c["gradient_accumulation_steps"], c["block_size"]
    else:
        defaults = TINY_RUN if args.model == "tiny" else LARGE_RUN
        # nanoGPT's defaults, the schedule squeezed into the run: warmup for the first fifth of the
        # steps, cosine decay until four fifths, then min_lr
        c = dict(
            DEFAULTS,
            learning_rate=defaults["learning_rate"],
            min_lr=defaults["min_lr"],
            warmup_iters=max(args.steps // 5, 1),
            lr_decay_iters=max(args.steps * 4 // 5, 2),
            dropout=0.0,
            bias=True,
            seed=args.seed,
        )
        if args.model == "tiny" or args.model in HF_SIZES:
            shape = (
                dict(TINY, n_positions=max(TINY["n_positions"], args.seq_len or 0))
                if args.model == "tiny"
                else dict(HF_SIZES[args.model], vocab_size=50257, n_positions=1024)
            )
            # every tensor random, torch -> ours
            random_hf_model(args.seed, **shape).save_pretrained(model_dir)
        else:
            model_dir = args.model
        data_dir = os.path.join(tmp, "data")
        os.makedirs(data_dir)
        write_tokens(os.path.join(data_dir, "train.bin"), hf_vocab_size(model_dir), seed=args.seed)
        rows, seq_len = args.batch_size or defaults["rows"], args.seq_len or defaults["seq_len"]
    c.update(
        attention=args.attention,
        remat=args.remat,
        loss_chunk=args.loss_chunk,
        scan_layers=args.scan_layers,
    )
    if args.attention == "splash" and seq_len % 128:  # else XLA's attention would run in its place
        raise UsageError(
            f"--attention splash needs a --seq-len that is a multiple of 128, got {seq_len}"
        )
    return Run(
        c,
        model_dir,
        data_dir,
        args.steps,
        rows,
        seq_len,
        args.accum,
        args.devices,
        args.fsdp,
        args.tensor_parallel,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=50)
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny | gpt2 | gpt2-medium | ... (random weights) | HF directory",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--config",
        default=None,
        help="golden run: config/train_<name>.py (e.g. shakespeare_char) or a config file, "
        "on its data",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per step, over all micro-batches and devices",
    )
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="random weights and data (not --config's)")
    add_step_args(p)
    args = p.parse_args(argv)
    # bad input fails here, before anything heavy is imported or written
    args.devices = args.devices or args.fsdp * args.tensor_parallel
    if min(args.steps, args.accum, args.devices, args.fsdp, args.tensor_parallel) < 1:
        raise UsageError(
            "--steps, --accum, --devices, --fsdp and --tensor_parallel must be >= 1, got "
            f"{args.steps}, {args.accum}, {args.devices}, {args.fsdp}, {args.tensor_parallel}"
        )
    if args.devices % (args.fsdp * args.tensor_parallel):
        raise UsageError(
            f"--fsdp {args.fsdp} x --tensor_parallel {args.tensor_parallel} must divide --devices "
            f"{args.devices}"
        )
    if args.loss_chunk < 0:
        raise UsageError(f"--loss-chunk must be >= 0 (0: no chunks), got {args.loss_chunk}")
    if args.config:
        if args.model != "tiny" or args.batch_size or args.seq_len:
            raise UsageError(
                "--config sets the model, batch and sequence length: "
                "drop --model, --batch-size, --seq-len"
            )
        if not os.path.isfile(config_path(args.config)):
            raise InputNotFound(
                f"no config {config_path(args.config)} (--config takes a name under config/ "
                "without train_ and .py, or a config file)"
            )
    elif args.model != "tiny" and args.model not in HF_SIZES and not os.path.isdir(args.model):
        raise UsageError(
            f"--model takes tiny, a size ({', '.join(HF_SIZES)}) or an HF GPT-2 directory, "
            f"got {args.model!r}"
        )
    else:
        rows = args.batch_size or (TINY_RUN if args.model == "tiny" else LARGE_RUN)["rows"]
        check_rows(rows, args.accum, args.devices, args.tensor_parallel)
    return args


def rerun_with_fake_devices(argv, devices, have, module="parity.check_train"):
    """This check (`module`) again in a fresh python with `devices` fake CPU devices (XLA reads the
    flag when jax starts)."""
    if os.environ.get("CHECK_TRAIN_FAKE_DEVICES"):
        raise UsageError(f"--devices {devices}: only {have} device(s), even with fake CPU devices")
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "CHECK_TRAIN_FAKE_DEVICES": "1",
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    }
    print(
        f"--devices {devices} with {have} device(s) here: running on {devices} fake CPU devices",
        flush=True,
    )
    return subprocess.run([sys.executable, "-m", module, *argv], env=env).returncode


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    require_extras("parity")
    import jax

    from compute import sharding

    sharding.start_backend()
    if args.devices > jax.device_count():
        return rerun_with_fake_devices(argv, args.devices, jax.device_count())
    pin_numerics()  # before anything is saved: no progress bars
    with tempfile.TemporaryDirectory() as tmp:
        ok, _ = check(make_run(args, tmp), args.dtype)
    return 0 if ok else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
