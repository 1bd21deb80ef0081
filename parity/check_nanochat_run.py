"""
nanochat's pretraining run, ours against nanochat's own, as a user runs each: train.py's command
and a nanochat checkout's scripts/base_train.py, from one model_000000.pt on the same parquet shards
and tokenizer directory, float32; every step's loss, then every tensor of our --format=nanochat
export against nanochat's own last checkpoint, both read by its checkpoint_manager.build_model.

The data: the shipped Shakespeare's paragraphs as documents (data/nanochat/prepare.py --text: 4
train shards and a val shard, a 2048-id tokenizer), shorter and longer than the 256-token rows.
The start: nanochat's own init_weights at depth 2, its zero output projections then drawn
N(0, 0.02) (parity/nanochat_own_run.py), saved by its own save_checkpoint. At its init as it is
(--own_start) the stream is a multiple of the embedding, which the final RMSNorm's scale
invariance cancels: the residual, x0 and backout lambdas' first gradients are rounding, which
Adam's eps of 1e-10 turns into full steps of either sign. The gradients table shows it (float32
against float64, on nanochat's own model and first batch); --own_start runs the steps from there
and reports without a verdict.

nanochat's loop runs twice, on 2 CPU threads and on 1: the spread between them (summation order
only) is the scale of what float32 cannot settle. A tensor passes within 1e-3 of nanochat's, or
within 10x that spread where the spread is larger. It runs eager (TORCHDYNAMO_DISABLE=1:
torch.compile's CPU build takes minutes, for the same float32 arithmetic in another order).

    python -m parity.check_nanochat_run --own ../nanochat
    python -m parity.check_nanochat_run --own ../nanochat --window_pattern=SL   # 128-token windows
    python -m parity.check_nanochat_run --own ../nanochat --own_start
    python -m parity.check_nanochat_run --own ../nanochat --slip=window_pattern=SL   # exits 1

Exit code: 0 parity holds (--own_start: 0, it reports), 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from configurator import UsageError, exit_on_bad_input, require_extras
from parity.common import print_table, verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(ROOT, "data", "shakespeare_char", "input.txt")
VOCAB, DEPTH, ROWS, SEQ, TOTAL, WARMUP = 2048, 2, 4, 256, 2048, 2
LOSS_RTOL = 1e-5
TENSOR_ATOL, SPREAD_FACTOR = 1e-3, 10
THREADS = (2, 1)  # nanochat's runs: the first is compared with ours, the second gives the spread


def run(argv, what, env=None, cwd=ROOT):
    """A command; its output kept in the work folder's log, its failure one line."""
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"{what} failed (exit {done.returncode}): {tail[0]}")
    return done.stdout


class Work:
    """The work folder: nanochat's base directory (shards, tokenizer, its checkpoints) and ours."""

    def __init__(self, folder, checkout, window_pattern, steps, own_start, slip=()):
        self.folder, self.checkout, self.slip = folder, os.path.abspath(checkout), list(slip)
        self.window, self.steps, self.own_start = window_pattern, steps, own_start
        self.base = os.path.join(folder, "base")
        self.shards = os.path.join(self.base, "base_data_climbmix")  # where its dataset.py reads
        self.tokenizer = os.path.join(self.base, "tokenizer")
        self.start = os.path.join(folder, "start")

    def nanochat_env(self, threads=2):
        env = dict(os.environ, NANOCHAT_BASE_DIR=self.base, NANOCHAT_DTYPE="float32")
        return env | {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": str(threads)}

    def own(self, part, *argv, threads=2):
        command = [sys.executable, "-m", "parity.nanochat_own_run", part, "--checkout"]
        return run(
            [*command, self.checkout, *argv], f"nanochat's {part}", self.nanochat_env(threads)
        )

    def prepare(self):
        prepare = os.path.join(ROOT, "data", "nanochat", "prepare.py")
        run(
            [sys.executable, prepare, f"--text={TEXT}", "--shards=4", f"--vocab_size={VOCAB}"]
            + [f"--dir={self.shards}", f"--tokenizer_dir={self.tokenizer}"],
            "data/nanochat/prepare.py",
        )
        shape = ["--depth", str(DEPTH), "--seq", str(SEQ), "--vocab", str(VOCAB)]
        self.own("start", "--out", self.start, *shape, "--window", self.window, *self.start_flag())

    def start_flag(self):
        return ["--own_start"] * self.own_start

    def nanochat_run(self, threads):
        """base_train's own loop; each training forward's loss (its micro-batches)."""
        losses = os.path.join(self.folder, f"nanochat_losses_{threads}.json")
        self.own(
            "train",
            *("--start", os.path.join(self.start, "model_000000.pt"), "--losses", losses),
            *("--threads", str(threads), "--", f"--depth={DEPTH}", "--head-dim=64"),
            *("--aspect-ratio=64", f"--window-pattern={self.window}", f"--max-seq-len={SEQ}"),
            *(f"--device-batch-size={ROWS}", f"--total-batch-size={TOTAL}"),
            *(f"--num-iterations={self.steps}", f"--warmup-steps={WARMUP}", "--eval-every=-1"),
            *("--core-metric-every=-1", "--sample-every=-1", "--device-type=cpu"),
            f"--model-tag=threads{threads}",
            threads=threads,
        )
        with open(losses) as f:
            micro = json.load(f)
        accum = TOTAL // (ROWS * SEQ)
        return [sum(micro[i : i + accum]) / accum for i in range(0, len(micro), accum)]

    def our_run(self):
        """train.py's command (the issue's, plus its window pattern and a log line each step)."""
        out_dir = os.path.join(self.folder, "ours")
        run(
            [sys.executable, "train.py", "config/nanochat_cpu.py", f"--init_from={self.start}"]
            + [f"--dataset={self.shards}", f"--tokenizer={self.tokenizer}", f"--depth={DEPTH}"]
            + [f"--block_size={SEQ}", f"--batch_size={ROWS}", f"--total_batch_size={TOTAL}"]
            + [f"--max_iters={self.steps}", f"--warmup_iters={WARMUP}", "--dtype=float32"]
            + [f"--window_pattern={self.window}", "--log_interval=1", f"--out_dir={out_dir}"]
            + [f"--{setting}" for setting in self.slip],
            "train.py",
        )
        return logged_losses_and_export(out_dir, self.folder)

    def tensors(self, export):
        """{name: (|ours - its|, |its 1 thread - its 2|, max |its|)} at the last step."""
        theirs = [os.path.join(self.base, "base_checkpoints", f"threads{t}") for t in THREADS]
        found = json.loads(
            self.own("compare", "--step", str(self.steps), "--dirs", theirs[0], export, theirs[1])
        )
        return {name: tuple(v[:3]) for name, v in found.items()}

    def first_gradients(self):
        with open(os.path.join(self.start, "meta_000000.json")) as f:
            config = json.dumps(json.load(f)["model_config"])
        start = os.path.join(self.start, "model_000000.pt")
        found = self.own("gradients", "--start", start, "--config", config, "--rows", str(ROWS))
        return json.loads(found)


def logged_losses_and_export(out_dir, folder):
    """(each step's loss in out_dir's log.jsonl, its checkpoint exported as nanochat's into
    folder/ours_export)."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    export = os.path.join(folder, "ours_export")
    run(
        [
            sys.executable,
            "export.py",
            f"--out_dir={out_dir}",
            "--format=nanochat",
            f"--to={export}",
        ],
        "export.py",
    )
    return [r["loss"] for r in records if "loss" in r and "iter" in r], export


def relative(a, b):
    return abs(a - b) / abs(b)


def print_comparison(ours, theirs, spread_run, tensors):
    """Each step's loss, ours against nanochat's (and its other run's), then each tensor's largest
    difference against its tolerance."""
    print_table(
        [
            [str(i), f"{o:.7f}", f"{t:.7f}", f"{relative(o, t):.1e}", f"{relative(s, t):.1e}"]
            for i, (o, t, s) in enumerate(zip(ours, theirs, spread_run))
        ],
        ["step", "ours", "nanochat", "|rel|", f"nanochat {THREADS[1]} thread |rel|"],
    )
    print()
    print_table(
        [
            [name, f"{d:.1e}", f"{s:.1e}", f"{tolerance(s):.1e}", f"{m:.2g}"]
            for name, (d, s, m) in tensors.items()
        ],
        ["tensor", "max |ours - its|", "its spread", "tolerance", "max |its|"],
    )


def within_tolerances(ours, theirs, tensors):
    """Every step there and within LOSS_RTOL, every tensor within its tolerance."""
    ok = len(ours) == len(theirs) > 0
    ok &= all(relative(o, t) <= LOSS_RTOL for o, t in zip(ours, theirs))
    return ok and all(d <= tolerance(s) for d, s, _ in tensors.values())


def print_report(work, ours, theirs, spread_run, tensors, gradients):
    start = "nanochat's init as it is" if work.own_start else "nanochat's init, projections drawn"
    print(
        f"nanochat's pretraining run: train.py vs base_train (its own, {THREADS[0]} threads), "
        f"depth {DEPTH}, windows {work.window}, {ROWS} x {SEQ} tokens a micro-batch, {TOTAL} a "
        f"step, {work.steps} steps, warmup {WARMUP}, float32; start: {start}"
    )
    print_comparison(ours, theirs, spread_run, tensors)
    print("\nthe lambdas' first gradients on nanochat's own model and first batch, max |grad|:")
    print_table(
        [
            [k, f"{gradients['float32'][k]:.1e}", f"{gradients['float64'][k]:.1e}"]
            for k in gradients["float32"]
        ],
        ["parameter", "float32", "float64"],
    )


def tolerance(spread):
    return max(TENSOR_ATOL, SPREAD_FACTOR * spread)


def run_check_parser(doc, script):
    """The run checks' options: --own (a checkout holding scripts/`script`), --work, --slip; the
    checkout checked once parsed (parse_with_checkout)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--own", metavar="CHECKOUT", required=True, help="a nanochat checkout")
    parser.add_argument("--work", help="keep the runs in this folder (default: a temporary one)")
    parser.add_argument(
        "--slip",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting given to train.py's side only: a planted slip the check must catch",
    )
    parser.set_defaults(script=script)
    return parser


def parse_with_checkout(parser, argv):
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.own, "scripts", args.script)):
        raise UsageError(f"--own {args.own}: no scripts/{args.script} there (a nanochat checkout?)")
    return args


def main(argv=None):
    parser = run_check_parser(__doc__, "base_train.py")
    parser.add_argument("--steps", type=int, default=8, help="max_iters (>= 4)")
    parser.add_argument("--window_pattern", default="L", help="both sides' (config's: L)")
    parser.add_argument("--own_start", action="store_true", help="nanochat's init as it is")
    args = parse_with_checkout(parser, argv)
    if args.steps < 4:
        raise UsageError("--steps must be >= 4: the warmup (2) and the warmdown both within it")
    require_extras("parity")
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.work or temporary
        os.makedirs(folder, exist_ok=True)
        work = Work(folder, args.own, args.window_pattern, args.steps, args.own_start, args.slip)
        work.prepare()
        runs = [work.nanochat_run(threads) for threads in THREADS]
        ours, export = work.our_run()
        tensors = work.tensors(export)
        print_report(work, ours, *runs, tensors, work.first_gradients())
    if args.own_start:
        return 0
    ok = len(ours) == args.steps and within_tolerances(ours, runs[0], tensors)
    return 0 if verdict(ok, "nanochat's pretraining run") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
