"""
What the loop's bound on the steps it runs ahead of the device (train.STEPS_AHEAD, which makes a
stop wait for one step) costs the main command: its training (config/train_shakespeare_char.py
config/cpu.py, 2000 iterations, after data/shakespeare_char/prepare.py) with the bound and without
it, alternated, in one process.

    python -m bench.steps_ahead              # 2 rounds
    python -m bench.steps_ahead --rounds 3

Prints each run's loop seconds (Trainer.run: steps, evals, checkpoints; compilation is before it)
and best val loss, then the medians.
"""

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import train
from compute import sharding
from configurator import configure, exit_on_bad_input
from run.settings import DEFAULTS

MAIN = ["config/train_shakespeare_char.py", "config/cpu.py"]
BOUNDS = {"bounded": train.STEPS_AHEAD, "unbounded": 10**9}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sharding.start_backend()  # as train.py's main does (libtpu's banner off a TPU dropped)
    sharding.keep_freed_memory()
    seconds = {name: [] for name in BOUNDS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, ahead in BOUNDS.items():
                train.STEPS_AHEAD = ahead
                out_dir = os.path.join(tmp, f"{name}-{r}")
                with contextlib.redirect_stdout(open(os.devnull, "w")):
                    trainer = train.Trainer(configure(DEFAULTS, [*MAIN, f"--out_dir={out_dir}"]))
                    began = time.time()
                    trainer.run()
                seconds[name].append(time.time() - began)
                print(
                    f"round {r} {name:<9} (steps ahead {ahead}): {seconds[name][-1]:6.1f} s, "
                    f"best val {trainer.best_val_loss:.4f}",
                    flush=True,
                )
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.1f} s over {len(values)} run(s)")


if __name__ == "__main__":
    exit_on_bad_input(main)
