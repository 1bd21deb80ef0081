"""
The GPU check in one command: what a user's own commands cost on the GPU at hand, each against the
PyTorch original on the same GPU, as a ratio of times (below 1: ours is faster), with the device's
name and the packages' versions.

    # on a GPU: (a) and (c), and (b) ours alone; 255 s on an H200
    python -m bench.gpu
    # (b) against record 5's own code too: ~4 minutes more
    python -m bench.gpu --record ../modded-nanogpt
    # (d) alone, ours with its 'auto' attention and with the flash kernel, against record 20's code
    python -m bench.gpu --rows d --attention20 auto,flash --record ../modded-nanogpt \
        --speedrun_steps 20
    # (e) alone: nanochat's d20 step, ours against its own base_train from a checkout
    python -m bench.gpu --rows e --nanochat ../nanochat
    # any machine: the same rows at tiny sizes (the tests)
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
(d) Record 20: `python train.py config/speedrun20_gpt2.py` (8 sequences of 64K tokens a step,
    accumulated on one GPU, FP8 head) on the same kind of shards; with --record, the checkout's
    record 20 (the code that opens records/track_1_short/2025-01-16_Sub3Min/'s log) run as (b)
    runs record 5, on one GPU, so its own loop takes the 8 sequences one after another. Both time
    the same steps (from the 11th; the window grows with the step), each stopped after its last
    step (the record's final val would compile its eval graph, which times no step). Ours once per
    --attention20 setting: a row each, against the same record run.
(e) nanochat (bench/gpu_nanochat.py): `python train.py config/nanochat.py` at d20, 32 x 2048 a GPU,
    4 micro-batches a step, bf16, against nanochat's own scripts/base_train.py from a checkout
    (--nanochat, or NANOCHAT_CHECKOUT; skipped in one line without one) with the same settings, on
    the same parquet shards of generated text and tokenizer in nanochat's layout (its
    NANOCHAT_BASE_DIR); ms a step, the median from the 4th step, ours from train.py's log, its from
    its printed dt; it says whether its attention ran Flash Attention 3 (a download) or SDPA.
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

from bench import gpu_nanochat
from bench import train as bench_train
from bench.gpu_records import (  # noqa: F401 (the tests' names for them)
    RECORD_5,
    RECORD_20,
    RECORDS,
    record_code,
    run_until,
    speedrun_record,
    write_shards,
)
from configurator import UsageError, exit_on_bad_input

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
CONFIGS = {5: "config/speedrun_gpt2.py", 20: "config/speedrun20_gpt2.py"}
TIMED_FROM = 10  # the records time their steps from the 11th (index 10)
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
SPEEDRUN20 = {
    "real": [],
    "tiny": [
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=64",
        "--block_size=128",
        "--total_batch_size=0",
        "--gradient_accumulation_steps=2",
        "--fp8_head=False",  # too few tokens for its gradient's scale
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


def speedrun_ours(data_dir, steps, size, record=5, overrides=()):
    """(b) and (d), ours: train.py on the record's config for `steps` iterations, with `overrides`
    -> {ms: median ms a step (record 5: after the first 3; record 20: from the 11th, as the record
    times its own), wall_s: the whole command, auto: its auto settings line}."""
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [
            sys.executable,
            "train.py",
            CONFIGS[record],
            f"--dataset={data_dir}",
            f"--out_dir={out_dir}",
            f"--max_iters={steps}",
            f"--eval_interval={steps}",
            "--eval_iters=1",
            "--val_tokens=0",
            "--checkpoint_interval=0",
            "--log_interval=1",
            *overrides,
        ]
        if record == 5:
            cmd += [f"--warmdown_iters={steps // 2}", *SPEEDRUN[size]]
        else:  # its cooldown and windows are fractions of max_iters, as the record's
            cmd += SPEEDRUN20[size]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.time() - t0
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            ms = [(r["iter"], r["ms"]) for r in map(json.loads, f) if "ms" in r]
    first = 3 if record == 5 else min(TIMED_FROM, len(ms) - 1)
    timed = [m for it, m in ms if it >= first] or [m for _, m in ms]
    auto = next((line for line in p.stdout.splitlines() if line.startswith("auto settings:")), None)
    return {"ms": float(np.median(timed)), "wall_s": wall, "auto": auto, "log": p.stdout}


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
        help="a checkout of KellerJordan/modded-nanogpt: (b) and (d) run its records 5 and 20 too "
        "(a GPU)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny sizes, for any machine (the tests)")
    p.add_argument("--rows", default="abcde", help="the rows to run, e.g. bd (default: all five)")
    p.add_argument(
        "--nanochat",
        help="a checkout of karpathy/nanochat: (e) runs its base_train (default: "
        "NANOCHAT_CHECKOUT)",
    )
    p.add_argument(
        "--speedrun_steps", type=int, default=16, help="(b), (d): iterations of each speedrun run"
    )
    p.add_argument(
        "--attention20",
        default="auto",
        help="(d): ours with each of these attention settings, e.g. auto,flash (a row each)",
    )
    p.add_argument(
        "--logs",
        help="a folder for the runs' own output (train.py's, the records', nanochat's)",
    )
    args = p.parse_args(argv)
    size = "tiny" if args.tiny else "real"
    rows_asked = set(args.rows)
    if not rows_asked or rows_asked - set("abcde"):
        raise UsageError(f"--rows={args.rows}: give some of the letters abcde, e.g. --rows=bd")
    nanochat = gpu_nanochat.checkout_of(args.nanochat) if "e" in rows_asked else None
    for record, row in ((5, "b"), (20, "d")):
        if args.record and row in rows_asked:
            if not os.path.isfile(os.path.join(args.record, RECORDS[record])):
                raise UsageError(
                    f"--record={args.record}: no {RECORDS[record]} there; give a checkout of "
                    "KellerJordan/modded-nanogpt"
                )
    if args.speedrun_steps < 13 and args.record:
        raise UsageError(
            "--speedrun_steps must be >= 13 with --record: the record times its steps from the 11th"
        )
    attentions20 = args.attention20.split(",")
    if set(attentions20) - {"auto", "xla", "splash", "flash"}:
        raise UsageError(
            f"--attention20={args.attention20}: give some of auto, xla, splash, flash, e.g. "
            "--attention20=auto,flash"
        )
    if args.speedrun_steps < 2:
        raise UsageError(f"--speedrun_steps must be >= 2, got {args.speedrun_steps}")
    t_start = time.time()
    lines = [f"packages: {versions()}, python {sys.version.split()[0]}"]
    rows = []

    if "a" in rows_asked:
        gpt2 = gpt2_row(size)
        ours, theirs = gpt2["ours"], gpt2["nanogpt"]
        lines.append(f"device: {ours['device']} (ours), {theirs['device']} (PyTorch)")
        rows.append(
            (
                "(a) GPT-2 124M step, config/train_gpt2.py's settings"
                if size == "real"
                else "(a) GPT-2 step (tiny)",
                f"{ours['ms']:.2f} ms",
                f"{theirs['ms']:.2f} ms (nanoGPT)",
                ours["ms"] / theirs["ms"],
            )
        )
        lines.append(
            f"(a) ours: {ours['auto'] or 'no auto settings'}; MFU ours {mfu(ours)}, nanoGPT "
            f"{mfu(theirs)}"
        )

    for record, row in ((5, "b"), (20, "d")):
        if row not in rows_asked:
            continue
        with tempfile.TemporaryDirectory() as data_dir:
            per_step = 524288 if size == "real" else 2 * 2 * (64 if record == 5 else 128)
            write_shards(data_dir, (args.speedrun_steps + 4) * per_step + 1, 2 * per_step + 1)
            runs = {}
            for attention in attentions20 if record == 20 else ["auto"]:
                overrides = [] if attention == "auto" else [f"--attention={attention}"]
                run = speedrun_ours(data_dir, args.speedrun_steps, size, record, overrides)
                tag = "" if attention == "auto" else f"-{attention}"
                print(f"({row}) ours{tag}: {run['ms']:.1f} ms a step", file=sys.stderr, flush=True)
                keep(args.logs, f"speedrun{record}-ours{tag}.txt", run["log"])
                runs[attention] = run
            theirs = None
            if args.record:
                log = os.path.join(args.logs, f"record{record}.txt") if args.logs else None
                theirs = speedrun_record(args.record, data_dir, args.speedrun_steps, record, log)
        if "a" not in rows_asked and not any(x.startswith("device:") for x in lines):
            kind = re.search(r"device\(s\) \((.+?)\)", run["log"])
            lines.append(f"device: {kind[1] if kind else '?'} (ours)")
        if theirs:
            lines.append(
                f"({row}) record {record}: the whole command to its last step "
                f"{theirs['wall_s']:.0f} s (torch.compile included)"
            )
        for attention, run in runs.items():
            tag = "" if attention == "auto" else f" --attention={attention}"
            lines.append(
                f"({row}) ours{tag}: {run['auto'] or 'no auto settings'}; the whole command "
                f"{run['wall_s']:.0f} s"
            )
            what = f"({row}) {'speedrun' if record == 5 else 'record 20'} step, {CONFIGS[record]}"
            what += tag
            if theirs:
                theirs_ms = f"{theirs['ms']:.1f} ms (record {record})"
                rows.append((what, f"{run['ms']:.1f} ms", theirs_ms, run["ms"] / theirs["ms"]))
            else:
                rows.append((what, f"{run['ms']:.1f} ms", "- (no --record)", None))

    if "c" in rows_asked:
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

    if "e" in rows_asked:
        nanochat_lines, nanochat_rows = gpu_nanochat.row(nanochat, size, args.logs)
        lines += nanochat_lines
        rows += nanochat_rows

    print("\n".join(lines))
    print(f"\n{'':<52} {'ours':>14} {'PyTorch original':>32} {'ours / theirs (time)':>21}")
    for what, a, b, ratio in sorted(rows, key=lambda row: row[0][:3]):  # (a) to (e)
        print(f"{what:<52} {a:>14} {b:>32} {f'{ratio:.2f}' if ratio is not None else '-':>21}")
    print(f"\n(bench/gpu.py took {time.time() - t_start:.0f} s)")
    return 0


def keep(folder, name, text):
    """A run's own output into --logs, as soon as it ends."""
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def mfu(r):
    return f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "n/a"


if __name__ == "__main__":
    exit_on_bad_input(main)
