"""
bench/gpu.py's row (e): nanochat's pretraining step, ours (`train.py config/nanochat.py`) against
nanochat's own scripts/base_train.py from a checkout (--nanochat, or NANOCHAT_CHECKOUT), on the same
parquet shards and tokenizer: a folder in nanochat's own layout (NANOCHAT_BASE_DIR: its
base_data_climbmix/ shards, the last the val split, and tokenizer/ with tokenizer.pkl and
token_bytes.pt) of generated text, which train.py reads as --dataset and --tokenizer. Both run the
same settings (RUN: each setting's name on each side) for the same iterations, and each is timed
from its own per-step figure, the median from the TIMED_FROM-th step: ours log.jsonl's `ms`,
nanochat's printed `dt`. nanochat's run is stopped after its last step's line (it would then save a
checkpoint, which times no step). Without a checkout the row is skipped in one line.

    python -m bench.gpu --rows e --nanochat ../nanochat
    python -m bench.gpu_nanochat --base-train CHECKOUT -- --depth=2 ...  # its side (run by the row)
"""

import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time

import numpy as np

from configurator import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root
BASE_TRAIN = os.path.join("scripts", "base_train.py")
SHARDS, TOKENIZER = "base_data_climbmix", "tokenizer"  # nanochat/dataset.py's, tokenizer.py's
TIMED_FROM = 3  # the steps before: compilation (torch.compile's, XLA's) and warm-up
# {our setting: base_train's flag}, the run both sides make
RUN = {
    "depth": "depth",
    "aspect_ratio": "aspect-ratio",
    "head_dim": "head-dim",
    "block_size": "max-seq-len",
    "window_pattern": "window-pattern",
    "batch_size": "device-batch-size",
    "total_batch_size": "total-batch-size",
    "max_iters": "num-iterations",
}
# the real run fits an H200 at base_train's d20 and device batch (32 x 2048, bf16), 4 micro-batches
# a step; the tiny one runs on 2 CPU cores in float32 (nanochat's own dtype on a CPU)
SIZES = {
    "real": dict(
        run=dict(
            depth=20,
            aspect_ratio=64,
            head_dim=128,
            block_size=2048,
            window_pattern="SSSL",
            batch_size=32,
            total_batch_size=4 * 32 * 2048,
            max_iters=12,
        ),
        dtype="bfloat16",
        vocab_size=32768,
        chars_per_token=5,  # its 20,000 words about one token each: 5.4 characters a token
    ),
    "tiny": dict(
        run=dict(
            depth=2,
            aspect_ratio=32,
            head_dim=32,
            block_size=64,
            window_pattern="SL",
            batch_size=2,
            total_batch_size=2 * 2 * 64,
            max_iters=5,
        ),
        dtype="float32",
        vocab_size=300,
        chars_per_token=2,
    ),
}
# nanochat's flash_attention says which kernel its attention runs (its SDPA fallback runs the
# windows as masks)
FA3_LINE = "✓ Using Flash Attention 3"


def checkout_of(given):
    """The nanochat checkout the row runs (--nanochat, else NANOCHAT_CHECKOUT), None for none; one
    that is not nanochat's is a UsageError."""
    checkout = given or os.environ.get("NANOCHAT_CHECKOUT")
    if checkout and not os.path.isfile(os.path.join(checkout, BASE_TRAIN)):
        raise UsageError(
            f"--nanochat={checkout}: no {BASE_TRAIN} there; give a checkout of karpathy/nanochat"
        )
    return checkout or None


def write_data(base_dir, size, seed=0):
    """nanochat's base directory for the run of `size`: two train shards of the run's tokens and
    more (the best-fit rows crop what does not fit) and a val shard, of documents of random words
    (20,000 words of 2 to 8 letters, each drawn alike; documents of 1/8 of a row to 2 rows of
    words, shorter and longer than a row), and a tokenizer of the size's vocab_size ids trained on
    the first shard."""
    from dataio.chat_tokenizer import ChatTokenizer

    sizes = SIZES[size]
    run = sizes["run"]
    tokens = (run["max_iters"] + 2) * run["total_batch_size"]
    rng = np.random.default_rng(seed)
    letters = rng.integers(ord("a"), ord("z") + 1, (20000, 8), dtype=np.uint8)
    words = [bytes(w[:n]).decode() for w, n in zip(letters, rng.integers(2, 9, 20000))]
    docs, chars = [], 0
    while chars < 2 * 1.5 * tokens * sizes["chars_per_token"]:
        length = rng.integers(run["block_size"] // 8, 2 * run["block_size"])
        doc = " ".join(words[i] for i in rng.integers(0, len(words), length))
        docs.append(doc)
        chars += len(doc)
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = os.path.join(base_dir, SHARDS)
    os.makedirs(shards)
    half = len(docs) // 2
    parts = [docs[: half // 2], docs[half // 2 : half], docs[half : half + max(half // 8, 2)]]
    for k, part in enumerate(parts):
        path = os.path.join(shards, f"shard_{k:05d}.parquet")
        pq.write_table(pa.table({"text": part}), path, row_group_size=64)
    ChatTokenizer.train(iter(parts[0]), sizes["vocab_size"], max_chars=5_000_000).save(
        os.path.join(base_dir, TOKENIZER)
    )


def ours(base_dir, size, log_path=None):
    """train.py config/nanochat.py on the folder's shards and tokenizer -> {ms: median ms a step
    from TIMED_FROM, wall_s, auto: its auto settings line, log}."""
    sizes = SIZES[size]
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [
            sys.executable,
            "train.py",
            "config/nanochat.py",
            f"--dataset={os.path.join(base_dir, SHARDS)}",
            f"--tokenizer={os.path.join(base_dir, TOKENIZER)}",
            f"--out_dir={out_dir}",
            *(f"--{k}={v}" for k, v in sizes["run"].items()),
            f"--dtype={sizes['dtype']}",
            f"--eval_interval={sizes['run']['max_iters']}",
            "--eval_iters=1",
            "--val_tokens=0",
            "--checkpoint_interval=0",
            "--log_interval=1",
        ]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.time() - t0
        if log_path:
            with open(log_path, "w") as f:
                f.write(p.stdout + p.stderr)
        if p.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        with open(os.path.join(out_dir, "log.jsonl")) as f:
            ms = {r["iter"]: r["ms"] for r in map(json.loads, f) if "ms" in r}
    auto = next((line for line in p.stdout.splitlines() if line.startswith("auto settings:")), None)
    return {"ms": timed(ms), "wall_s": wall, "auto": auto, "log": p.stdout}


def base_train_argv(size):
    """base_train's flags for the run: RUN's settings, and no val, CORE, samples or wandb."""
    run = SIZES[size]["run"]
    flags = [f"--{RUN[k]}={v}" for k, v in run.items()]
    return [*flags, "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1", "--run=dummy"]


def theirs(checkout, base_dir, size, log_path=None):
    """nanochat's own base_train from the checkout on the folder (its NANOCHAT_BASE_DIR), in the
    run's dtype (NANOCHAT_DTYPE), until its last step's line -> {ms: median of its `dt` from
    TIMED_FROM, wall_s, fa3: whether its attention ran Flash Attention 3, log}."""
    from bench.gpu_records import run_until

    steps = SIZES[size]["run"]["max_iters"]
    cmd = [sys.executable, "-m", "bench.gpu_nanochat", "--base-train", checkout, "--"]
    cmd += base_train_argv(size)
    env = dict(os.environ, NANOCHAT_BASE_DIR=base_dir, NANOCHAT_DTYPE=SIZES[size]["dtype"])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    last = rf"step {steps - 1:05d}/{steps:05d} .*dt: "
    t0 = time.time()
    returncode, log = run_until(cmd, base_dir, last, log_path, env=env)
    wall = time.time() - t0
    dts = {
        int(s): float(dt) for s, dt in re.findall(r"^step (\d+)/\d+ .*\| dt: ([\d.]+)ms", log, re.M)
    }
    if returncode or len(dts) < steps:
        raise SystemExit(f"nanochat's base_train failed:\n{log[-5000:]}")
    return {"ms": timed(dts), "wall_s": wall, "fa3": FA3_LINE in log, "log": log}


def timed(ms):
    """The median of {step: ms} from TIMED_FROM (from the last step, in a run shorter than that)."""
    first = min(TIMED_FROM, max(ms))
    return float(np.median([m for it, m in ms.items() if it >= first]))


def row(checkout, size, logs=None):
    """Row (e): (lines, rows) as bench/gpu.py prints them; one line and no row without a
    checkout."""
    if not checkout:
        return ["(e) nanochat: skipped, no checkout (--nanochat or NANOCHAT_CHECKOUT)"], []
    sizes = SIZES[size]
    run = sizes["run"]
    with tempfile.TemporaryDirectory() as base_dir:
        write_data(base_dir, size)
        log = (lambda name: os.path.join(logs, name)) if logs else (lambda name: None)
        if logs:
            os.makedirs(logs, exist_ok=True)
        ours_run = ours(base_dir, size, log("nanochat-ours.txt"))
        print(f"(e) ours: {ours_run['ms']:.1f} ms a step", file=sys.stderr, flush=True)
        theirs_run = theirs(checkout, base_dir, size, log("nanochat-own.txt"))
    what = f"(e) nanochat d{run['depth']} step, config/nanochat.py"
    shape = (
        f"{run['batch_size']} x {run['block_size']} a device, {run['total_batch_size']:,} tokens a "
        f"step, {sizes['dtype']}, windows {run['window_pattern']}"
    )
    lines = [
        f"(e) ours: {ours_run['auto'] or 'no auto settings'}; the whole command "
        f"{ours_run['wall_s']:.0f} s",
        f"(e) nanochat's base_train ({shape}): attention "
        f"{'Flash Attention 3' if theirs_run['fa3'] else 'SDPA (its fallback: windows as masks)'}"
        f"; the whole command to its last step {theirs_run['wall_s']:.0f} s (torch.compile "
        "included)",
    ]
    ratio = ours_run["ms"] / theirs_run["ms"]
    rows = [(what, f"{ours_run['ms']:.1f} ms", f"{theirs_run['ms']:.1f} ms (base_train)", ratio)]
    return lines, rows


def run_base_train(checkout, argv):
    """nanochat's scripts/base_train.py as its command runs it (from its checkout's root on the
    path), with wandb a stand-in where it is not installed (base_train imports it; --run=dummy
    never calls it)."""
    sys.path.insert(0, os.path.abspath(checkout))
    try:
        import wandb  # noqa: F401
    except ImportError:
        sys.modules["wandb"] = type(sys)("wandb")
    sys.argv = [BASE_TRAIN, *argv]
    runpy.run_module("scripts.base_train", run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--base-train"] or sys.argv[3:4] != ["--"]:
        raise SystemExit("usage: python -m bench.gpu_nanochat --base-train CHECKOUT -- FLAGS...")
    run_base_train(sys.argv[2], sys.argv[4:])
