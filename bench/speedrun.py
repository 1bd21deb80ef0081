"""
Tokens (and seconds) to target: the speedrun recipe against nanoGPT's AdamW baseline, side by side
in one run, on the CPU default. Per seed: the baseline (`make shakespeare`'s train.py command) to
its 2000 iterations, whose final val loss is the target; then config/speedrun_shakespeare_char.py,
the same model size, data, batch and seed. For each: the first eval at or under the target
(iterations, tokens, wall seconds from the command's start, imports and compilation included), from
evals every --eval_interval iterations (the same cadence for both).

    python -m bench.speedrun                      # seeds 1337 (make shakespeare's), 1, 2
    python -m bench.speedrun --seeds 1337 --eval_interval 100

Prints a row per run and, last, the speedrun's wall time over the baseline's (median over seeds).
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
# make shakespeare's train.py command (Makefile), the shape both runs share
BASELINE = ["config/train_shakespeare_char.py", "config/cpu.py"]
SPEEDRUN = ["config/speedrun_shakespeare_char.py"]
EVAL_LINE = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")


def run(args, out_dir, seed, eval_interval):
    """train.py with `args`: [(iter, val loss, wall seconds since the command started)] of its
    evals."""
    cmd = [
        sys.executable,
        "train.py",
        *args,
        f"--out_dir={out_dir}",
        f"--seed={seed}",
        f"--eval_interval={eval_interval}",
    ]
    t0, evals = time.time(), []
    with subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as p:
        for line in p.stdout:
            if m := EVAL_LINE.match(line):
                evals.append((int(m[1]), float(m[2]), time.time() - t0))
        err = p.stderr.read()
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return evals


def first_at_or_under(evals, target):
    return next(((it, s) for it, loss, s in evals if loss <= target), (None, None))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--seeds", default="1337,1,2")
    p.add_argument("--eval_interval", type=int, default=50)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.eval_interval < 1 or 2000 % args.eval_interval:
        raise UsageError(
            f"--eval_interval must divide the baseline's 2000 iterations, got {args.eval_interval}"
        )
    subprocess.run(
        [sys.executable, "data/shakespeare_char/prepare.py"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    tokens_per_iter = 12 * 64
    print(
        f"{'seed':>5} {'run':<9} {'target val':>10} {'iters':>6} {'tokens':>9} {'wall s':>7} "
        f"{'final val':>9}",
        flush=True,
    )
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            base = run(BASELINE, os.path.join(tmp, f"base-{seed}"), seed, args.eval_interval)
            target = base[-1][1]
            fast = run(SPEEDRUN, os.path.join(tmp, f"speedrun-{seed}"), seed, args.eval_interval)
            walls = []
            for name, evals in (("baseline", base), ("speedrun", fast)):
                it, wall = first_at_or_under(evals, target)
                walls.append(wall)
                reached = (
                    f"{it:>6} {it * tokens_per_iter:>9,} {wall:>7.1f}"
                    if it is not None
                    else f"{'never':>6} {'':>9} {'':>7}"
                )
                print(
                    f"{seed:>5} {name:<9} {target:>10.4f} {reached} {evals[-1][1]:>9.4f}",
                    flush=True,
                )
            if None not in walls:
                ratios.append(walls[1] / walls[0])
    if ratios:
        median = sorted(ratios)[len(ratios) // 2]
        print(
            "\nspeedrun / baseline wall seconds to the baseline's final val loss: median "
            f"{median:.2f} over {len(ratios)} seed(s) ({', '.join(f'{r:.2f}' for r in ratios)})"
        )
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
