"""
What the checksums of a checkpoint cost: saving and restoring a training state with and without
them.

    # GPT-2 124M: params + AdamW state in fp32, 3 rounds
    python -m bench.checkpoint
    python -m bench.checkpoint --preset tiny --rounds 1    # a smoke test
    # the checkpoints on another disk (default: the temp dir)
    python -m bench.checkpoint --dir /mnt/disk

The state is train.py's from scratch (train_step.init_state, make_optimizer) on every device of the
mesh, after one AdamW update with random gradients: at init Adam's moments are zeros, which compress
to next to nothing, where a run saves them after many updates. Each round saves it to a temporary
directory and restores it as a resume does (checkpoint.restore_state), once as train.py saves, with
the digests of its arrays in meta (checkpoint.save), and once without them (checksums.digests
stubbed out: nothing computed on save, nothing compared on restore), the order alternating from
round to round. A save is timed until it is on disk (checkpoint.wait_saved). A first round, untimed,
compiles (the digests' jit among it). Prints the digests alone, then the median and the fastest save
and restore of each, and the overhead; and the digests as timed inside the saves and restores that
make them, which a busy machine's noise does not swamp as it does the difference of two medians.
"""

import argparse
import logging
import math
import statistics
import tempfile
import time
from contextlib import contextmanager

import jax
import optax

from bench.train import PRESETS
from compute import sharding
from configurator import UsageError, configure, exit_on_bad_input
from dataio import checksums
from model import GPTConfig
from parity.common import print_table
from run import checkpoint, settings, train_step


@contextmanager
def digests_as(digests):
    """checksums.digests replaced by `digests` meanwhile."""
    real = checksums.digests
    checksums.digests = digests
    try:
        yield
    finally:
        checksums.digests = real


def timed(digests, spent):
    """`digests`, appending the seconds of each call to `spent`."""

    def timed_digests(tree):
        t0 = time.perf_counter()
        out = digests(tree)
        spent.append(time.perf_counter() - t0)
        return out

    return timed_digests


def training_state(config, tx, mesh):
    """(params, AdamW state) after one update with random gradients, each array split over the mesh
    by its spec."""
    _, params, opt_state = train_step.init_state(config, mesh, tx)

    def update(params, opt_state, key):
        keys = iter(jax.random.split(key, len(jax.tree.leaves(params))))
        grads = jax.tree.map(
            lambda p: 1e-2 * jax.random.normal(next(keys), p.shape, p.dtype), params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    return jax.jit(update, out_shardings=shardings, donate_argnums=(0, 1))(
        params, opt_state, jax.random.key(0)
    )


def save_and_restore(out_dir, mngr, step, state, meta, config, tx, mesh):
    """(save s, restore s) of one checkpoint of `state` at `step`."""
    t0 = time.perf_counter()
    checkpoint.save(mngr, step, *state, dict(meta, iter_num=step))
    checkpoint.wait_saved(mngr)
    t1 = time.perf_counter()
    # as a resume: meta first, once
    saved_meta = checkpoint.restore(out_dir, step=step, mngr=mngr)["meta"]
    jax.block_until_ready(
        checkpoint.restore_state(out_dir, step, saved_meta, config, tx, mesh, mngr)
    )
    return t1 - t0, time.perf_counter() - t1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--preset", default="gpt2", choices=PRESETS)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed rounds, each a save and restore with and without",
    )
    p.add_argument("--dir", default=None, help="where the temporary checkpoint directory goes")
    args = p.parse_args()
    if args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")

    sharding.use_compilation_cache()
    sharding.start_backend()
    # orbax's note of a save that waited for the one before
    logging.getLogger("absl").setLevel(logging.ERROR)
    sharding.keep_freed_memory()  # as train.py: XLA:CPU's freed buffers stay in the process
    preset = PRESETS[args.preset]
    config = GPTConfig(
        **{k: preset[k] for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")}
    )
    c = configure(settings.DEFAULTS, [])
    tx = train_step.make_optimizer(c)
    mesh = sharding.make_mesh()
    state = params, _ = training_state(config, tx, mesh)
    meta = checkpoint.meta_for(config, c, 0, math.inf, {"step": 0})
    n_params = sum(x.size for x in jax.tree.leaves(params))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(
        f"preset {args.preset}: {n_params / 1e6:.2f}M params + AdamW state, "
        f"{state_bytes / 1e9:.2f} GB, {len(jax.tree.leaves(state))} arrays; {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s); {args.rounds} round(s)"
    )

    t0 = time.perf_counter()
    checksums.digests({"params": state[0], "opt_state": state[1]})
    first = time.perf_counter() - t0
    alone = []
    for _ in range(3):
        t0 = time.perf_counter()
        checksums.digests({"params": state[0], "opt_state": state[1]})
        alone.append(time.perf_counter() - t0)
    print(
        f"digests of the state alone: {statistics.median(alone):.3f} s (first call, compilation "
        f"included: {first:.1f} s)"
    )

    times = {True: [], False: []}  # with digests: [(save s, restore s)]
    # the digests themselves, in the saves and restores with them: [save's, restore's, ...]
    spent = []
    with tempfile.TemporaryDirectory(dir=args.dir) as out_dir:
        mngr = checkpoint.manager(out_dir, keep=2)
        step = 0
        for r in range(args.rounds + 1):
            for digested in (True, False) if r % 2 == 0 else (False, True):
                step += 1
                calls = []
                with digests_as(timed(checksums.digests, calls) if digested else lambda tree: {}):
                    s = save_and_restore(out_dir, mngr, step, state, meta, config, tx, mesh)
                if r > 0:  # round 0 compiles
                    times[digested].append(s)
                    spent += calls
                print(
                    f"round {r}{' (untimed)' if r == 0 else ''}, "
                    f"{'with' if digested else 'without'} digests: save {s[0]:.2f} s, restore "
                    f"{s[1]:.2f} s",
                    flush=True,
                )
        mngr.close()
    # the median, and the fastest (what the machine does when nothing else runs on it)
    stats = {
        d: [f(t[i] for t in times[d]) for i in (0, 1) for f in (statistics.median, min)]
        for d in times
    }
    print()
    print_table(
        [
            ["without digests", *(f"{x:.2f}" for x in stats[False])],
            ["with digests", *(f"{x:.2f}" for x in stats[True])],
            [
                "overhead",
                *(f"{(a / b - 1) * 100:+.1f}%" for a, b in zip(stats[True], stats[False])),
            ],
        ],
        ["", "save s (median)", "save s (min)", "restore s (median)", "restore s (min)"],
    )
    # on a busy machine the two medians differ by more than the digests take: they are timed too,
    # where they run
    in_save, in_restore = statistics.median(spent[0::2]), statistics.median(spent[1::2])
    print(
        f"\nthe digests themselves, timed inside those saves and restores (median): {in_save:.3f} "
        f"s a save ({in_save / stats[False][0] * 100:.1f}% of the median save without), "
        f"{in_restore:.3f} s a restore ({in_restore / stats[False][2] * 100:.1f}% of the median "
        "restore without)"
    )
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
