"""
The records' own code, run for bench/gpu.py's rows (b) and (d) beside ours: a checkout of
KellerJordan/modded-nanogpt's record 5 or 20 copied into a folder of its own with its
Hyperparameters pointed at llm.c shards of random tokens (write_shards), run under torchrun until
its last step's line (run_until, which row (e) runs nanochat's base_train with too), its own
step_avg the figure.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from configurator import UsageError

RECORD_5 = os.path.join("records", "track_1_short", "2024-10-14_ModernArch", "train_gpt2.py")
# record 20's code is the part of its log before the first '====' line
RECORD_20 = os.path.join(
    "records", "track_1_short", "2025-01-16_Sub3Min", "1d3bd93b-a69e-4118-aeb8-8184239d7566.txt"
)
RECORDS = {5: RECORD_5, 20: RECORD_20}


def write_shards(folder, train_tokens, val_tokens, vocab_size=50257, seed=0):
    """llm.c .bin shards of random token ids, one train and one val (modded-nanogpt's names), as the
    record reads."""
    from parity.check_speedrun import write_datafile

    rng = np.random.default_rng(seed)
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        write_datafile(
            os.path.join(folder, f"fineweb_{split}_000000.bin"), rng.integers(0, vocab_size, n)
        )


def record_code(checkout, record, data_dir, steps):
    """The record's code, its Hyperparameters' defaults (one a line: record 5's `name : type =
    value`, record 20's `name = value`) pointed at the shards (record 20 globs them under its
    folder: data/, a link to them) and `steps`, with no val before the end."""
    source = os.path.join(checkout, RECORDS[record])
    with open(source) as f:
        code = f.read()
    if record == 5:
        form = "{} : ... = ..."
        settings = {
            "input_bin": f"'{data_dir}/fineweb_train_*.bin'",
            "input_val_bin": f"'{data_dir}/fineweb_val_*.bin'",
            "num_iterations": str(steps),
            "val_loss_every": "0",
        }
    else:
        code = code.split("\n====")[0]
        # newer torch than the record's 2.7 (2.11 on the H200) checks a custom op's strides against
        # its fake: the record's fake of the FP8 head's backward states the weight's gradient
        # row-major where its kernel returns the transpose of a row-major product. The fake is made
        # to say what the kernel returns.
        fake, stated = "w_f8.to(torch.float32)", "w_f8.T.contiguous().T.to(torch.float32)"
        if code.count(fake) != 1:
            raise UsageError(f"{source}: no '{fake}' in its FP8 head's fake backward")
        code = code.replace(fake, stated)
        form = "{} = ..."
        settings = {
            "train_files": '"data/fineweb_train_*.bin"',
            "val_files": '"data/fineweb_val_*.bin"',
            "num_iterations": str(steps),
            "val_loss_every": "0",
        }
    for name, value in settings.items():
        code, n = re.subn(
            rf"^(\s+{name}\s*(?::\s*\w+\s*)?=\s*)[^#\n]+",
            lambda m: m[1] + value + " ",
            code,
            flags=re.M,
        )
        if n != 1:
            raise UsageError(
                f"{source}: no Hyperparameters line '{form.format(name)}' to point at the shards"
            )
    return code


def speedrun_record(checkout, data_dir, steps, record=5, log_path=None):
    """(b) and (d), the record's own code under torchrun on the shards, run until its last step's
    line (its output into log_path as it comes) -> {ms: its last step_avg, wall_s}."""
    code = record_code(checkout, record, data_dir, steps)
    with tempfile.TemporaryDirectory() as run_dir:  # the record writes logs/ beside itself
        with open(os.path.join(run_dir, "train_gpt.py"), "w") as f:
            f.write(code)
        os.symlink(data_dir, os.path.join(run_dir, "data"))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "train_gpt.py",
        ]
        t0 = time.time()
        returncode, log = run_until(cmd, run_dir, rf"step:{steps}/{steps} .*step_avg:", log_path)
        wall = time.time() - t0
    avgs = re.findall(rf"step:{steps}/{steps} .*step_avg:([\d.]+)ms", log)
    if returncode or not avgs:
        raise SystemExit(f"record {record} failed:\n{log[-5000:]}")
    return {"ms": float(avgs[-1]), "wall_s": wall, "log": log}


def run_until(cmd, cwd, last_line, log_path=None, env=None):
    """Runs cmd (stderr into stdout; each line into log_path too) until it ends or prints a line
    that matches `last_line`, then stops its process group -> (its return code, 0 if stopped; its
    output). env: its environment (default: ours)."""
    p = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    lines, stopped = [], False
    log = open(log_path, "w") if log_path else None
    for line in p.stdout:
        lines.append(line)
        if log:
            log.write(line)
            log.flush()
        if re.match(last_line, line):
            stopped = True
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:  # it had ended
                pass
            break
    p.wait()
    if log:
        log.close()
    return (0 if stopped else p.returncode), "".join(lines)
