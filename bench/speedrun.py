"""
Tokens (and seconds) to target: modded-nanogpt's recipes against nanoGPT's AdamW baseline, side by
side in one run, on the CPU default. Per seed: the baseline (`make shakespeare`'s train.py command)
to its 2000 iterations, whose final val loss is the target; then record 5's recipe
(config/speedrun_shakespeare_char.py) and record 20's (config/speedrun20_shakespeare_char.py), the
same model size, data and seed, about the same tokens a step. For each: the first eval at or under
the target (iterations, tokens, wall seconds from the command's start, imports and compilation
included), from evals every --eval_interval iterations (the same cadence for all three).

    python -m bench.speedrun                      # seeds 1337 (make shakespeare's), 1, 2
    python -m bench.speedrun --seeds 1337 --eval_interval 100

Prints a row per run and, last, each recipe's wall time and tokens over the baseline's (median over
seeds).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from configurator import UsageError, exit_on_bad_input

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
# (name, train.py's config files); the first is the baseline: make shakespeare's command (Makefile)
RECIPES = [
    ("baseline", ["config/train_shakespeare_char.py", "config/cpu.py"]),
    ("record5", ["config/speedrun_shakespeare_char.py"]),  # 12 x 64 tokens a step, as the baseline
    ("record20", ["config/speedrun20_shakespeare_char.py"]),  # 4 x 256: whole 128-token blocks
]
DATA = os.path.join(REPO, "data", "shakespeare_char")
BASELINE_ITERS = 2000  # config/cpu.py's max_iters
EVAL_LINE = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
TOKENS_LINE = re.compile(r"^tokens per iteration will be: ([\d,]+)")


def run(args, out_dir, seed, eval_interval):
    """train.py with `args`: its tokens per iteration and [(iter, val loss, wall seconds since the
    command started)] of its evals."""
    cmd = [
        sys.executable,
        "train.py",
        *args,
        f"--out_dir={out_dir}",
        f"--seed={seed}",
        f"--eval_interval={eval_interval}",
    ]
    t0, evals, tokens_per_iter = time.time(), [], None
    with subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as p:
        for line in p.stdout:
            if m := EVAL_LINE.match(line):
                evals.append((int(m[1]), float(m[2]), time.time() - t0))
            elif m := TOKENS_LINE.match(line):
                tokens_per_iter = int(m[1].replace(",", ""))
        err = p.stderr.read()
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return tokens_per_iter, evals


def first_at_or_under(evals, target):
    return next(((it, s) for it, loss, s in evals if loss <= target), (None, None))


def median(xs):
    return sorted(xs)[len(xs) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--seeds", default="1337,1,2")
    p.add_argument("--eval_interval", type=int, default=50)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.eval_interval < 1 or BASELINE_ITERS % args.eval_interval:
        raise UsageError(
            f"--eval_interval must divide the baseline's {BASELINE_ITERS} iterations, got "
            f"{args.eval_interval}"
        )
    # only where missing: prepare.py rewrites train.bin in place, which stops any run reading it
    if not all(os.path.exists(os.path.join(DATA, f)) for f in ("train.bin", "val.bin", "meta.pkl")):
        subprocess.run(
            [sys.executable, os.path.join(DATA, "prepare.py")], check=True, capture_output=True
        )
    print(
        f"{'seed':>5} {'run':<9} {'target val':>10} {'iters':>6} {'tokens':>9} {'wall s':>7} "
        f"{'final val':>9}",
        flush=True,
    )
    ratios = {name: [] for name, _ in RECIPES[1:]}  # name: [(wall ratio, tokens ratio)] per seed
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            target, reached = None, {}
            for name, config in RECIPES:
                out_dir = os.path.join(tmp, f"{name}-{seed}")
                tokens_per_iter, evals = run(config, out_dir, seed, args.eval_interval)
                target = evals[-1][1] if target is None else target  # the baseline's final val
                it, wall = first_at_or_under(evals, target)
                if it is None:
                    row = f"{'never':>6} {'':>9} {'':>7}"
                else:
                    reached[name] = (wall, it * tokens_per_iter)
                    row = f"{it:>6} {it * tokens_per_iter:>9,} {wall:>7.1f}"
                print(f"{seed:>5} {name:<9} {target:>10.4f} {row} {evals[-1][1]:>9.4f}", flush=True)
            base = reached.get(RECIPES[0][0])
            for name in ratios:
                if base and name in reached:
                    ratios[name].append(tuple(r / b for r, b in zip(reached[name], base)))
    for name, rs in ratios.items():
        if rs:
            walls, tokens = [w for w, _ in rs], [t for _, t in rs]
            each = ", ".join(f"{w:.2f}/{t:.2f}" for w, t in rs)
            print(
                f"\n{name} / baseline to the baseline's final val loss, median over {len(rs)} "
                f"seed(s): wall seconds {median(walls):.2f}, tokens {median(tokens):.2f} "
                f"(wall/tokens per seed: {each})"
            )
        else:
            print(f"\n{name}: never reached the baseline's final val loss")
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
