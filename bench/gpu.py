"""
The GPU check in one command: what a user's own commands cost on the GPU at hand, each against the
PyTorch original on the same GPU, as a ratio of times (below 1: ours is faster), with the device's
name and the packages' versions.

    # on a GPU: (a) and (c), and (b) ours alone; 255 s on an H200
    python -m bench.gpu
    # (b) against record 5's own code too: ~4 minutes more
    python -m bench.gpu --record ../modded-nanogpt
    # any machine: the same three rows at tiny sizes (the tests)
    python -m bench.gpu --tiny

(a) GPT-2 124M at config/train_gpt2.py's own settings (batch 64 x 1024, bf16, remat and loss_chunk
    as its 'auto' picks them): bench/train.py's step, ours against nanoGPT's model as its train.py
    runs it on a GPU (torch.compile, fused AdamW, TF32, autocast), each in its own process; ms a
    step, median after warm-up.
(b) The speedrun: `python train.py config/speedrun_gpt2.py` (524,288 tokens a step) on llm.c shards
    of random tokens, ms a step (train.py's own log, after its first steps); with --record, a
    checkout of KellerJordan/modded-nanogpt, its record 5
    (records/track_1_short/2024-10-14_ModernArch/train_gpt2.py) run as it is under torchrun on the
    same shards: a copy in a temporary folder, its Hyperparameters pointed at the shards and
    --speedrun_steps iterations, timed by its own step_avg (its first 10 steps untimed, as it does).
(c) Sampling: bench/sample.py's greedy generate, 500 tokens at batch 1 and 8, ours against
    transformers' generate, both on the GPU (float32, random gpt2-shaped weights).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import numpy as np

from bench import train as bench_train
from configurator import UsageError, exit_on_bad_input

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
RECORD_5 = os.path.join("records", "track_1_short", "2024-10-14_ModernArch", "train_gpt2.py")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "torch", "transformers")
# the two sizes of each row: the real ones on a GPU, tiny ones anywhere (the suite runs them on the
# CPU)
GPT2 = {
    "real": dict(preset="gpt2", dtype="bfloat16", batch_size=64, steps=10, warmup=3),
    "tiny": dict(preset="tiny", dtype="float32", batch_size=2, steps=2, warmup=1),
}
SPEEDRUN = {
    "real": [],
    "tiny": [
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=64",
        "--block_size=64",
        "--batch_size=2",
        "--total_batch_size=0",
        "--gradient_accumulation_steps=2",
    ],
}
SAMPLE = {
    "real": dict(size="gpt2", batches=[1, 8], new_tokens=500),
    "tiny": dict(size="tiny", batches=[1], new_tokens=8),
}


def gpt2_row(size):
    """(a): {ours, nanogpt: bench_train's worker results} at the settings of the preset's config
    (gpt2: config/train_gpt2.py)."""
    sizes = GPT2[size]
    args = argparse.Namespace(
        preset=sizes["preset"],
        batch_size=sizes["batch_size"],
        dtype=sizes["dtype"],
        remat=None,
        loss_chunk=None,
        scan_layers=None,
        attention="auto",
    )
    s, _ = bench_train.step_settings(
        args, steps=sizes["steps"], warmup=sizes["warmup"], accum=1, as_on_gpu=False
    )
    return {
        "ours": bench_train.run_worker("jax", s),
        "nanogpt": bench_train.run_worker("nanogpt", s),
    }


def write_shards(folder, train_tokens, val_tokens, vocab_size=50257, seed=0):
    """llm.c .bin shards of random token ids, one train and one val (modded-nanogpt's names), as the
    record reads."""
    from parity.check_speedrun import write_datafile

    rng = np.random.default_rng(seed)
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        write_datafile(
            os.path.join(folder, f"fineweb_{split}_000000.bin"), rng.integers(0, vocab_size, n)
        )


def speedrun_ours(data_dir, steps, size):
    """(b), ours: train.py config/speedrun_gpt2.py for `steps` iterations -> {ms: median ms a step
    after the first 3, wall_s: the whole command, auto: its auto settings line}."""
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [
            sys.executable,
            "train.py",
            "config/speedrun_gpt2.py",
            f"--dataset={data_dir}",
            f"--out_dir={out_dir}",
            f"--max_iters={steps}",
            f"--eval_interval={steps}",
            "--eval_iters=1",
            "--val_tokens=0",
            f"--warmdown_iters={steps // 2}",
            "--checkpoint_interval=0",
            "--log_interval=1",
            *SPEEDRUN[size],
        ]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.time() - t0
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            ms = [r["ms"] for r in map(json.loads, f) if "ms" in r]
    auto = next((line for line in p.stdout.splitlines() if line.startswith("auto settings:")), None)
    return {"ms": float(np.median(ms[3:] or ms)), "wall_s": wall, "auto": auto, "log": p.stdout}


def speedrun_record(checkout, data_dir, steps):
    """(b), record 5's own train_gpt2.py under torchrun on the shards -> {ms: its last step_avg,
    wall_s}."""
    source = os.path.join(checkout, RECORD_5)
    with open(source) as f:
        code = f.read()
    settings = {
        "input_bin": f"'{data_dir}/fineweb_train_*.bin'",
        "input_val_bin": f"'{data_dir}/fineweb_val_*.bin'",
        "num_iterations": str(steps),
        "val_loss_every": "0",
    }
    for name, value in settings.items():  # the Hyperparameters dataclass's defaults, one a line
        code, n = re.subn(
            rf"^(\s+{name}\s*:\s*\w+\s*=\s*)[^#\n]+", lambda m: m[1] + value + " ", code, flags=re.M
        )
        if n != 1:
            raise UsageError(
                f"{source}: no Hyperparameters line '{name} : ... = ...' to point at the shards"
            )
    with tempfile.TemporaryDirectory() as run_dir:  # the record writes logs/ beside itself
        with open(os.path.join(run_dir, "train_gpt2.py"), "w") as f:
            f.write(code)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "train_gpt2.py",
        ]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=run_dir, capture_output=True, text=True)
        wall = time.time() - t0
    if p.returncode:
        raise SystemExit(f"record 5 failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    avgs = re.findall(r"step_avg:([\d.]+)ms", p.stdout)
    return {"ms": float(avgs[-1]), "wall_s": wall, "log": p.stdout}


def sample_row(size):
    """(c): bench_sample.compare in a process of its own (JAX takes 75% of the GPU's memory when it
    starts)."""
    p = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--worker-sample", json.dumps(SAMPLE[size])],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if p.returncode:
        raise SystemExit(f"sampling failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def versions():
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker-sample"]:  # sample_row's process
        from bench import sample as bench_sample

        header, rows = bench_sample.compare(**json.loads(argv[1]))
        print(json.dumps({"header": header, "rows": rows}))
        return 0
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--record",
        help="a checkout of KellerJordan/modded-nanogpt: (b) runs its record 5 too (a GPU)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny sizes, for any machine (the tests)")
    p.add_argument(
        "--speedrun_steps", type=int, default=16, help="(b): iterations of each speedrun run"
    )
    p.add_argument(
        "--logs", help="a folder for the speedrun runs' own output (train.py's, the record's)"
    )
    args = p.parse_args(argv)
    size = "tiny" if args.tiny else "real"
    if args.record and not os.path.isfile(os.path.join(args.record, RECORD_5)):
        raise UsageError(
            f"--record={args.record}: no {RECORD_5} there; give a checkout of "
            "KellerJordan/modded-nanogpt"
        )
    if args.speedrun_steps < 13 and args.record:
        raise UsageError(
            "--speedrun_steps must be >= 13 with --record: the record times its steps from the 11th"
        )
    if args.speedrun_steps < 2:
        raise UsageError(f"--speedrun_steps must be >= 2, got {args.speedrun_steps}")
    t_start = time.time()
    lines = [f"packages: {versions()}, python {sys.version.split()[0]}"]

    gpt2 = gpt2_row(size)
    ours, theirs = gpt2["ours"], gpt2["nanogpt"]
    lines.append(f"device: {ours['device']} (ours), {theirs['device']} (PyTorch)")
    rows = [
        (
            "(a) GPT-2 124M step, config/train_gpt2.py's settings"
            if size == "real"
            else "(a) GPT-2 step (tiny)",
            f"{ours['ms']:.2f} ms",
            f"{theirs['ms']:.2f} ms (nanoGPT)",
            ours["ms"] / theirs["ms"],
        )
    ]
    lines.append(
        f"(a) ours: {ours['auto'] or 'no auto settings'}; MFU ours {mfu(ours)}, nanoGPT "
        f"{mfu(theirs)}"
    )

    with tempfile.TemporaryDirectory() as data_dir:
        per_step = 524288 if size == "real" else 2 * 2 * 64
        write_shards(data_dir, (args.speedrun_steps + 4) * per_step + 1, 2 * per_step + 1)
        run = speedrun_ours(data_dir, args.speedrun_steps, size)
        lines.append(
            f"(b) ours: {run['auto'] or 'no auto settings'}; the whole command {run['wall_s']:.0f} "
            "s"
        )
        record = (
            speedrun_record(args.record, data_dir, args.speedrun_steps) if args.record else None
        )
    for name, r in (("speedrun-ours.txt", run), ("speedrun-record5.txt", record)):
        if args.logs and r:
            os.makedirs(args.logs, exist_ok=True)
            with open(os.path.join(args.logs, name), "w") as f:
                f.write(r["log"])
    if record:
        lines.append(
            f"(b) record 5: the whole command {record['wall_s']:.0f} s (torch.compile included)"
        )
        rows.append(
            (
                "(b) speedrun step, config/speedrun_gpt2.py",
                f"{run['ms']:.1f} ms",
                f"{record['ms']:.1f} ms (record 5)",
                run["ms"] / record["ms"],
            )
        )
    else:
        rows.append(
            (
                "(b) speedrun step, config/speedrun_gpt2.py",
                f"{run['ms']:.1f} ms",
                "- (no --record)",
                None,
            )
        )

    sampled = sample_row(size)
    lines.append(f"(c) {sampled['header']}")
    for r in sampled["rows"]:
        rows.append(
            (
                f"(c) sampling, batch {r['batch']}",
                f"{r['ours_tps']:,.0f} tok/s",
                f"{r['hf_tps']:,.0f} tok/s (transformers)",
                r["hf_tps"] / r["ours_tps"],
            )
        )

    print("\n".join(lines))
    print(f"\n{'':<52} {'ours':>14} {'PyTorch original':>32} {'ours / theirs (time)':>21}")
    for what, a, b, ratio in rows:
        print(f"{what:<52} {a:>14} {b:>32} {f'{ratio:.2f}' if ratio is not None else '-':>21}")
    print(f"\n(bench/gpu.py took {time.time() - t_start:.0f} s)")
    return 0


def mfu(r):
    return f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "n/a"


if __name__ == "__main__":
    exit_on_bad_input(main)
