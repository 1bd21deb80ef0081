"""
nanochat's supervised finetuning, ours against nanochat's own, as a user runs each: train.py's
config/chat_sft.py and a nanochat checkout's scripts/chat_sft.py, from one base checkpoint on the
same conversations, float32; every step's loss (the mean over the assistant's tokens of each
micro-batch, averaged), then every tensor of our --format=nanochat export against nanochat's own
chatsft checkpoint, both read by its checkpoint_manager.build_model.

The data: chat_sft's own mixture, SmolTalk's conversations, MMLU's auxiliary_train and GSM8K's
train (with its calculator calls as python parts), here tiny rows made from templates in each
dataset's hub schema (dataio/toy_tasks.py), written where nanochat's tasks read them
($NANOCHAT_BASE_DIR/task_data, its cache, which our --dataset=$NANOCHAT_BASE_DIR reads as it
is). The base: nanochat's own init_weights at depth 2 with its zero output projections drawn
N(0, 0.02), then PRETRAIN_STEPS steps of its own MuonAdamW on random tokens
(parity/nanochat_own_run.py), saved by its own save_checkpoint with its optimizer state and a
meta that both sides take the row length, batch and rates from.
Both sides warm-start their optimizer from that state (chat_sft's default --load-optimizer=1,
our load_optimizer: its moments and buffers, AdamW's step counts going on, Muon's weight decay
the file's, the rates the finetuning's own), or with --load_optimizer=0 start it fresh (its
--load-optimizer=0), and train one epoch (its --num-iterations=-1). nanochat runs twice, on 2
threads and on 1, for the spread float32 leaves (check_nanochat_run.py); eager.

    python -m parity.check_chat --own ../nanochat
    python -m parity.check_chat --own ../nanochat --load_optimizer=0        # both fresh
    python -m parity.check_chat --own ../nanochat --slip=init_lr_frac=0.7   # exits 1

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import json
import os
import shutil
import sys
import tempfile

from configurator import exit_on_bad_input, require_extras
from dataio import toy_tasks
from parity.check_nanochat_run import (
    ROOT,
    TEXT,
    THREADS,
    logged_losses_and_export,
    parse_with_checkout,
    print_comparison,
    run,
    run_check_parser,
    within_tolerances,
)
from parity.common import verdict

VOCAB, DEPTH, SEQ, ROWS, TOTAL = 2048, 2, 256, 4, 2048
PRETRAIN_STEPS = 3  # the base's own optimizer steps: its state, what finetuning warm-starts from
TRAIN_ROWS = {"smoltalk": 60, "mmlu": 40, "gsm8k": 40}


class Work:
    """nanochat's base directory (tokenizer, task data, the base checkpoint, its chatsft runs) and
    ours, in one folder."""

    def __init__(self, folder, checkout, slip=(), load_optimizer=True):
        self.folder, self.checkout, self.slip = folder, os.path.abspath(checkout), list(slip)
        self.load_optimizer = load_optimizer
        self.base = os.path.join(folder, "base")
        self.start = os.path.join(self.base, "base_checkpoints", f"d{DEPTH}")

    def own(self, part, *argv, threads=2):
        env = dict(os.environ, NANOCHAT_BASE_DIR=self.base, NANOCHAT_DTYPE="float32")
        env |= {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": str(threads)}
        command = [sys.executable, "-m", "parity.nanochat_own_run", part, "--checkout"]
        return run([*command, self.checkout, *argv], f"nanochat's {part}", env)

    def prepare(self):
        """The tokenizer (the shipped Shakespeare's, 2048 ids), the task data, and the base: its
        init with the projections drawn, PRETRAIN_STEPS steps of its optimizer, its meta holding
        base_train's batch and rates."""
        run(
            [sys.executable, os.path.join(ROOT, "data", "nanochat", "prepare.py"), f"--text={TEXT}"]
            + [
                "--shards=1",
                f"--vocab_size={VOCAB}",
                f"--dir={os.path.join(self.folder, 'shards')}",
            ]
            + [f"--tokenizer_dir={os.path.join(self.base, 'tokenizer')}"],
            "data/nanochat/prepare.py",
        )
        toy_tasks.write_task_cache(self.base, TRAIN_ROWS)
        shape = ["--depth", str(DEPTH), "--seq", str(SEQ), "--vocab", str(VOCAB)]
        self.own("start", "--out", self.start, *shape, "--optimizer_steps", str(PRETRAIN_STEPS))
        path = os.path.join(self.start, f"meta_{PRETRAIN_STEPS:06d}.json")
        with open(path) as f:
            meta = json.load(f)
        meta |= {"max_seq_len": SEQ, "device_batch_size": ROWS, "total_batch_size": TOTAL}
        meta["user_config"] = {"embedding_lr": 0.3, "unembedding_lr": 0.008, "matrix_lr": 0.02}
        with open(path, "w") as f:
            json.dump(meta, f)

    def nanochat_run(self, threads):
        """chat_sft's own loop; each training forward's loss; its checkpoint kept per run."""
        losses = os.path.join(self.folder, f"nanochat_losses_{threads}.json")
        self.own(
            "train",
            *("--script", "scripts.chat_sft", "--losses", losses, "--threads", str(threads)),
            *("--", "--device-type=cpu", f"--model-tag=d{DEPTH}"),
            f"--load-optimizer={int(self.load_optimizer)}",
            *("--eval-every=-1", f"--eval-tokens={ROWS * SEQ}", "--chatcore-every=-1"),
            *("--mmlu-epochs=1", "--gsm8k-epochs=1"),
            threads=threads,
        )
        saved = os.path.join(self.base, "chatsft_checkpoints", f"d{DEPTH}")
        kept = os.path.join(self.base, f"chatsft_threads{threads}")
        shutil.move(saved, kept)
        with open(losses) as f:
            micro = json.load(f)
        accum = TOTAL // (ROWS * SEQ)
        return [sum(micro[i : i + accum]) / accum for i in range(0, len(micro), accum)], kept

    def our_run(self):
        out_dir = os.path.join(self.folder, "ours")
        run(
            [sys.executable, "train.py", "config/chat_sft.py", f"--init_from={self.start}"]
            + [f"--dataset={self.base}", "--dtype=float32"]
            + ["--mmlu_epochs=1", "--gsm8k_epochs=1", "--log_interval=1", f"--out_dir={out_dir}"]
            + [f"--val_tokens={ROWS * SEQ}", "--eval_iters=1"]
            + [f"--load_optimizer={self.load_optimizer}"]
            + [f"--{setting}" for setting in self.slip],
            "train.py",
        )
        return logged_losses_and_export(out_dir, self.folder)

    def tensors(self, step, theirs, export, spread):
        found = json.loads(
            self.own("compare", "--step", str(step), "--dirs", theirs, export, spread)
        )
        return {name: tuple(v[:3]) for name, v in found.items()}


def main(argv=None):
    parser = run_check_parser(__doc__, "chat_sft.py")
    parser.add_argument(
        "--load_optimizer",
        type=int,
        choices=(0, 1),
        default=1,
        help="both sides' optimizer warm-started from the base's state (1) or fresh (0)",
    )
    args = parse_with_checkout(parser, argv)
    require_extras("parity")
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.work or temporary
        os.makedirs(folder, exist_ok=True)
        work = Work(folder, args.own, args.slip, bool(args.load_optimizer))
        work.prepare()
        (theirs, theirs_dir), (spread, spread_dir) = (work.nanochat_run(t) for t in THREADS)
        ours, export = work.our_run()
        tensors = work.tensors(len(theirs), theirs_dir, export, spread_dir)
    print(
        f"nanochat's finetuning: train.py config/chat_sft.py vs chat_sft (its own, {THREADS[0]} "
        f"threads), depth {DEPTH}, {ROWS} x {SEQ} tokens a micro-batch, {TOTAL} a step, one epoch "
        "of SmolTalk, MMLU and GSM8K rows, float32, both optimizers "
        + (
            f"warm-started from the base's state ({PRETRAIN_STEPS} steps of its own)"
            if args.load_optimizer
            else "fresh"
        )
    )
    print_comparison(ours, theirs, spread, tensors)
    ok = within_tolerances(ours, theirs, tensors)
    return 0 if verdict(ok, "nanochat's finetuning") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
