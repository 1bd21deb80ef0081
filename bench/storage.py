"""
What reading the data from Cloud Storage costs: the loader's tokens/s over the same token files on
local disk and on gs://, through the Cloud Storage emulator (tools/gcs_emulator.py, in memory, on
loopback), at GPT-2 124M's shapes; and saving and restoring GPT-2 124M's training state (train.py's
checkpoints) on each.

    python -m bench.storage                                # 50M tokens of fineweb-style .npy shards
    # llm.c .bin shards (raw: one train.bin, random windows)
    python -m bench.storage --format=bin --tokens=20_000_000
    # a step of 100 ms beside the Prefetcher: what it hides
    python -m bench.storage --step_ms=100
    # checkpoints only, of a tiny model (a smoke test)
    python -m bench.storage --skip=data --preset=tiny

The files are written to a temporary folder, then uploaded to the emulator's bucket. Each source is
timed twice: make_loader(...).next(accum) in a loop (each batch read while the loop waits), then
through the Prefetcher (train.py's way: a thread reads two batches ahead) with a step of --step_ms
of sleep standing in for the devices' work. Prints tokens/s, and the milliseconds a step waited for
its batch. The emulator is a Python HTTP server on this machine: its figures are the client's cost
(requests, copies, checks) and a lower bound on a real bucket's latency, not GCS's.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from configurator import UsageError, exit_on_bad_input
from dataio import storage
from dataio.dataloader import LLMC_HEADER, LLMC_MAGIC, LLMC_VERSION, make_loader
from dataio.prefetch import Prefetcher
from parity.common import print_table
from tools import gcs_emulator  # the tests' emulator, the one the suite runs against

FORMATS = ("npy", "bin", "raw")


def write_data(folder, fmt, tokens, shard_tokens, seed=0):
    """`tokens` random uint16 GPT-2 ids as fineweb.py's .npy shards, llm.c .bin shards or one
    nanoGPT train.bin; the bytes written."""
    rng = np.random.default_rng(seed)
    if fmt == "raw":
        rng.integers(0, 50257, tokens, dtype=np.uint16).tofile(os.path.join(folder, "train.bin"))
    for i, start in enumerate(range(0, tokens, shard_tokens) if fmt != "raw" else ()):
        shard = rng.integers(0, 50257, min(shard_tokens, tokens - start), dtype=np.uint16)
        if fmt == "npy":
            np.save(os.path.join(folder, f"edufineweb_train_{i:06d}.npy"), shard)
        # llm.c's write_datafile: 256 int32 (magic, version, token count, zeros), then the tokens
        else:
            header = np.zeros(LLMC_HEADER // 4, "<i4")
            header[:3] = LLMC_MAGIC, LLMC_VERSION, len(shard)
            with open(os.path.join(folder, f"fineweb_train_{i + 1:06d}.bin"), "wb") as f:
                f.write(header.tobytes() + shard.tobytes())
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def start_emulator():
    """The emulator on a free loopback port, in memory, as a process of its own; this process's
    clients pointed at it (gcs_emulator.client_env). Returns the process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # stderr to DEVNULL: the emulator prints a traceback for each request its client drops (gcsfs's
    # info races two)
    server = subprocess.Popen(
        [sys.executable, gcs_emulator.__file__, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    if server.stdout.readline().strip() != "ready":
        raise RuntimeError("the Cloud Storage emulator did not start")
    os.environ.update(gcs_emulator.client_env(port))
    return server


def upload(folder, url):
    """The folder's files to `url`; seconds taken."""
    t0 = time.perf_counter()
    storage.upload(folder, url)
    return time.perf_counter() - t0


def measure_next(data_dir, args):
    """make_loader + next in a loop: (tokens/s, ms per batch), after a warm-up batch (the first
    shard's open)."""
    loader = make_loader(data_dir, "train", args.seq_len, args.batch_size, seed=0)
    loader.next(args.accum)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loader.next(args.accum)
    elapsed = time.perf_counter() - t0
    return (
        args.steps * args.accum * args.batch_size * args.seq_len / elapsed,
        elapsed / args.steps * 1e3,
    )


def measure_prefetch(data_dir, args):
    """The Prefetcher as train.py runs it, a step of args.step_ms (sleep) after each batch:
    (tokens/s, ms a step waited for its batch)."""
    loader = make_loader(data_dir, "train", args.seq_len, args.batch_size, seed=0)
    # host arrays: the reading, not a device copy
    ahead = Prefetcher(loader, args.accum, put=lambda a: a)
    try:
        ahead.next()
        waited, t0 = 0.0, time.perf_counter()
        for _ in range(args.steps):
            t = time.perf_counter()
            ahead.next()
            waited += time.perf_counter() - t
            time.sleep(args.step_ms / 1e3)
        elapsed = time.perf_counter() - t0
    finally:
        ahead.close()
    return (
        args.steps * args.accum * args.batch_size * args.seq_len / elapsed,
        waited / args.steps * 1e3,
    )


def measure_loaders(sources, args):
    """Each source's rows of the table: direct next(), then the Prefetcher."""
    rows = []
    for name, data_dir in sources:
        tok_s, ms = measure_next(data_dir, args)
        rows.append([name, "next()", f"{tok_s / 1e6:.2f}M", f"{ms:.2f}", "-"])
        tok_s, wait = measure_prefetch(data_dir, args)
        rows.append(
            [
                name,
                f"Prefetcher, step {args.step_ms:g} ms",
                f"{tok_s / 1e6:.2f}M",
                "-",
                f"{wait:.2f}",
            ]
        )
        print(f"{name}: done", flush=True)
    return rows


def measure_checkpoints(places, args):
    """Save and restore of a training state (bench_checkpoint's: params + AdamW, fp32, saved as
    train.py saves and restored as a resume does) at each place, a round untimed first
    (compilation): rows of (place, save s, restore s), the median of --rounds."""
    import logging
    import math
    import statistics

    import jax

    from bench.checkpoint import save_and_restore, training_state
    from bench.train import PRESETS
    from compute import sharding
    from configurator import configure
    from model import GPTConfig
    from run import checkpoint, settings, train_step

    sharding.use_compilation_cache()
    logging.getLogger("absl").setLevel(logging.ERROR)
    preset = PRESETS[args.preset]
    config = GPTConfig(
        **{k: preset[k] for k in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd")}
    )
    c = configure(settings.DEFAULTS, [])
    tx, mesh = train_step.make_optimizer(c), sharding.make_mesh()
    state = training_state(config, tx, mesh)
    meta = checkpoint.meta_for(config, c, 0, math.inf, {"step": 0})
    print(
        f"checkpoints: preset {args.preset}, "
        f"{sum(x.nbytes for x in jax.tree.leaves(state)) / 1e9:.2f} GB of params + AdamW state, "
        f"{args.rounds} timed round(s) after one untimed",
        flush=True,
    )
    rows = []
    for name, out_dir in places:
        mngr = checkpoint.manager(out_dir, keep=2)
        times = [
            save_and_restore(out_dir, mngr, step, state, meta, config, tx, mesh)
            for step in range(1, args.rounds + 2)
        ][1:]
        mngr.close()
        rows.append(
            [
                name,
                f"{statistics.median(t[0] for t in times):.2f}",
                f"{statistics.median(t[1] for t in times):.2f}",
            ]
        )
        print(f"{name}: done", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=50_000_000, help="tokens written (and uploaded)")
    p.add_argument(
        "--format",
        default="npy",
        choices=FORMATS,
        help="npy: fineweb.py's shards; bin: llm.c's shards; raw: one train.bin (random windows)",
    )
    p.add_argument(
        "--shard_tokens", type=int, default=10_000_000, help="tokens per shard (npy, bin)"
    )
    p.add_argument(
        "--batch_size", type=int, default=16, help="rows per micro-batch (GPT-2 124M: 16)"
    )
    p.add_argument("--seq_len", type=int, default=1024, help="tokens per row (GPT-2 124M: 1024)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per next()")
    p.add_argument("--steps", type=int, default=1000, help="timed batches per measurement")
    p.add_argument(
        "--step_ms",
        type=float,
        default=0.0,
        help="the work of a step beside the Prefetcher (sleep)",
    )
    p.add_argument("--dir", default=None, help="where the temporary data folder goes")
    p.add_argument(
        "--preset",
        default="gpt2",
        help="the checkpoints' model (bench/train.py's presets; gpt2: 124M)",
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="timed checkpoint rounds (a save and a restore each)"
    )
    p.add_argument(
        "--skip", choices=("data", "checkpoints"), default=None, help="leave one part out"
    )
    args = p.parse_args(argv)
    if (
        args.tokens < args.batch_size * args.seq_len * args.accum + 1
        or min(args.steps, args.shard_tokens) < 1
    ):
        raise UsageError(
            f"--tokens={args.tokens} holds no batch of {args.accum} x {args.batch_size} x "
            f"{args.seq_len} (+1), or --steps / --shard_tokens is under 1"
        )

    server = start_emulator()
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            url = f"gs://{gcs_emulator.BUCKET}/bench/{os.getpid()}"
            if args.skip != "data":
                size = write_data(folder, args.format, args.tokens, args.shard_tokens)
                seconds = upload(folder, url)
                print(
                    f"{args.tokens / 1e6:g}M tokens as {args.format} ({size / 1e6:.0f} MB), "
                    f"uploaded to the emulator in {seconds:.1f} s; {args.steps} batches of "
                    f"{args.accum} x {args.batch_size} x {args.seq_len} per measurement",
                    flush=True,
                )
                data_rows = measure_loaders([("local", folder), ("gs:// (emulator)", url)], args)
            if args.skip != "checkpoints":
                ckpt_rows = measure_checkpoints(
                    [("local", os.path.join(folder, "run")), ("gs:// (emulator)", f"{url}/run")],
                    args,
                )
    finally:
        server.kill()
        server.wait()
    if args.skip != "data":
        print()
        print_table(data_rows, ["source", "read by", "tokens/s", "ms/batch", "step waited ms"])
    if args.skip != "checkpoints":
        print()
        print_table(ckpt_rows, ["checkpoints at", "save s (median)", "restore s (median)"])
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
