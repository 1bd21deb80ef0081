"""python -m pytest tests/test_bench_gpu.py -q

bench/gpu.py, the GPU check in one command, at its tiny sizes on the CPU so that it does not rot:
its four rows (GPT-2's step against nanoGPT's, the speedrun through train.py, sampling against
transformers, record 20 through train.py), each with a ratio, the auto settings each run took, the
packages' versions; records 5 and 20's own files run through torchrun with their Hyperparameters
pointed at the shards (stand-in files with the records' Hyperparameters lines); bad input in one
line."""

import os
import re
import subprocess
import sys
import time

import pytest

from bench import gpu as bench_gpu
from configurator import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# record 5's Hyperparameters lines as its file writes them, and a loop that prints its step lines
STAND_IN = """
from dataclasses import dataclass
import glob, os

@dataclass
class Hyperparameters:
    # data hyperparams
    input_bin : str = 'data/fineweb10B/fineweb_train_*.bin' # input .bin to train on
    input_val_bin : str = 'data/fineweb10B/fineweb_val_*.bin' # input .bin to eval validation loss on
    num_iterations : int = 5100 # number of iterations to run
    val_loss_every : int = 125 # every how many steps to evaluate val loss? 0 for only at the end
args = Hyperparameters()
assert glob.glob(args.input_bin) and glob.glob(args.input_val_bin) and args.val_loss_every == 0
assert os.environ["WORLD_SIZE"] == "1"  # under torchrun
for step in range(args.num_iterations):
    print(f"step:{step+1}/{args.num_iterations} train_loss:1.0 train_time:{step}ms step_avg:{900 + step}.00ms")
"""  # noqa: E501
# record 20's: a log whose code ends at the '====' line, Hyperparameters without types, shards
# globbed under the working folder, the FP8 head's fake backward; its final val never ends
STAND_IN_20 = """
import os, sys, time
from dataclasses import dataclass
from pathlib import Path

def fake_backward(x_f8, w_f8, torch):
    return x_f8.to(torch.bfloat16), w_f8.to(torch.float32)

@dataclass
class Hyperparameters:
    # data
    train_files = "data/fineweb10B/fineweb_train_*.bin" # input .bin to train on
    val_files = "data/fineweb10B/fineweb_val_*.bin" # input .bin to eval validation loss on
    num_iterations = 1393 # number of iterations to run
    val_loss_every = 125 # every how many steps to evaluate val loss? 0 for only at the end
args = Hyperparameters()
assert sorted(Path.cwd().glob(args.train_files)) and sorted(Path.cwd().glob(args.val_files))
assert args.val_loss_every == 0 and os.environ["WORLD_SIZE"] == "1"
assert "w_f8.T.contiguous().T.to(torch.float32)" in open(sys.argv[0]).read()
for step in range(args.num_iterations):
    print(f"step:{step+1}/{args.num_iterations} train_time:{step}ms step_avg:{800 + step}.00ms")
sys.stdout.flush()
time.sleep(120)  # the final val, which compiles the eval graph
====================================================================================================
step:0/1393 val_loss:10.8258 train_time:0ms step_avg:nanms
"""  # noqa: E501


@pytest.mark.slow  # a benchmark's whole run, 20 s: make test-slow
def test_the_four_rows_at_tiny_sizes():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu",
            "--tiny",
            "--rows=abcd",  # (e): tests/test_nanochat_bench.py
            "--speedrun_steps=4",
            "--attention20=auto,flash",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert re.search(
        r"^packages: jax [\d.]+, jaxlib [\d.]+, flax [\d.]+, optax [\d.]+, torch \S+, transformers "
        r"\S+, python [\d.]+$",
        out,
        re.M,
    ), out
    assert re.search(r"^device: cpu \(ours\), cpu \(PyTorch\)$", out, re.M), out
    for run, attention in (("a", "xla"), ("b", "xla"), ("d", "windows-masked")):
        assert re.search(
            rf"^\({run}\) ours: auto settings: attention={attention}, scan_layers=off, remat=none, "
            r"loss_chunk=0 ",
            out,
            re.M,
        ), out
    ratio = r"\d+\.\d\d$"
    assert re.search(
        rf"^\(a\) GPT-2 step \(tiny\) +[\d.]+ ms +[\d.]+ ms \(nanoGPT\) +{ratio}", out, re.M
    ), out
    assert re.search(
        r"^\(b\) speedrun step, config/speedrun_gpt2\.py +[\d.]+ ms +- \(no --record\) +-$",
        out,
        re.M,
    )
    for tag in ("", r" --attention=flash"):  # a row for each --attention20
        step = rf"^\(d\) record 20 step, config/speedrun20_gpt2\.py{tag} +[\d.]+ ms"
        assert re.search(step + r" +- \(no --record\) +-$", out, re.M), out
    flash = r"^\(d\) ours --attention=flash: auto settings: scan_layers=off"
    assert re.search(flash, out, re.M), out
    assert re.search(
        rf"^\(c\) sampling, batch 1 +[\d,]+ tok/s +[\d,]+ tok/s \(transformers\) +{ratio}",
        out,
        re.M,
    )
    assert re.search(r"^\(c\) tiny-shaped, random weights, .* torch \S+ on cpu", out, re.M), out


def stand_in_checkout(tmp_path, record_file, text):
    """(a modded-nanogpt checkout holding `text` as the record's file, a folder of shards)."""
    checkout, data = tmp_path / "modded-nanogpt", tmp_path / "shards"
    os.makedirs(checkout / os.path.dirname(record_file))
    (checkout / record_file).write_text(text)
    data.mkdir()
    bench_gpu.write_shards(str(data), 1000, 100)
    return checkout, data


@pytest.mark.slow
def test_record_5_runs_as_it_is_on_the_shards(tmp_path):
    """A copy of the record's file, its Hyperparameters pointed at the shards and the steps asked
    for, run by torchrun in a folder of its own; its own step_avg is the figure."""
    checkout, data = stand_in_checkout(tmp_path, bench_gpu.RECORD_5, STAND_IN)
    r = bench_gpu.speedrun_record(str(checkout), str(data), steps=13)
    assert r["ms"] == 912.0 and "step:13/13" in r["log"]
    assert (checkout / bench_gpu.RECORD_5).read_text() == STAND_IN  # the checkout itself untouched
    (checkout / bench_gpu.RECORD_5).write_text(STAND_IN.replace("num_iterations", "iterations"))
    with pytest.raises(
        UsageError, match=r"no Hyperparameters line 'num_iterations : \.\.\. = \.\.\.'"
    ):
        bench_gpu.speedrun_record(str(checkout), str(data), steps=13)


@pytest.mark.slow
def test_record_20_runs_as_it_is_until_its_last_step(tmp_path):
    """Record 20's code (its log before the '====' line), pointed at the shards through a data/
    link in its folder, its FP8 fake made to state the kernel's layout, stopped after its last
    step's line (its final val is not a step) with its own step_avg as the figure."""
    checkout, data = stand_in_checkout(tmp_path, bench_gpu.RECORD_20, STAND_IN_20)
    t0 = time.time()
    r = bench_gpu.speedrun_record(str(checkout), str(data), 13, 20, str(tmp_path / "log.txt"))
    assert time.time() - t0 < 60  # not the 120 s of its val
    assert r["ms"] == 812.0 and "step:13/13" in r["log"] and "val_loss" not in r["log"]
    assert (tmp_path / "log.txt").read_text() == r["log"]
    code = bench_gpu.record_code(str(checkout), 20, str(data), 13)
    assert "====" not in code and "num_iterations = 13 " in code
    (checkout / bench_gpu.RECORD_20).write_text(STAND_IN_20.replace("w_f8.to(", "w_f8.type("))
    with pytest.raises(UsageError, match=r"no 'w_f8\.to\(torch\.float32\)' in its FP8 head"):
        bench_gpu.record_code(str(checkout), 20, str(data), 13)
    (checkout / bench_gpu.RECORD_20).write_text(STAND_IN_20.replace("val_loss_every", "every"))
    with pytest.raises(UsageError, match=r"no Hyperparameters line 'val_loss_every = \.\.\.'"):
        bench_gpu.record_code(str(checkout), 20, str(data), 13)


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(
        UsageError, match=r"^--record=.*: no records/track_1_short/.* there; give a checkout"
    ):
        bench_gpu.main(["--record", str(tmp_path)])
    with pytest.raises(UsageError, match=r"^--speedrun_steps must be >= 2"):
        bench_gpu.main(["--speedrun_steps=1"])
    with pytest.raises(UsageError, match=r"^--rows=af: give some of the letters abcde"):
        bench_gpu.main(["--rows=af"])
    with pytest.raises(UsageError, match=r"^--attention20=auto,cudnn: give some of auto, xla, "):
        bench_gpu.main(["--rows=d", "--attention20=auto,cudnn"])
    os.makedirs(tmp_path / os.path.dirname(bench_gpu.RECORD_5))
    (tmp_path / bench_gpu.RECORD_5).write_text(STAND_IN)  # record 5's file, not record 20's
    with pytest.raises(UsageError, match=r"^--record=.*: no .*2025-01-16_Sub3Min/.* there"):
        bench_gpu.main(["--record", str(tmp_path), "--rows=d"])
