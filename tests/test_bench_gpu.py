"""python -m pytest tests/test_bench_gpu.py -q

bench/gpu.py, the GPU check in one command, at its tiny sizes on the CPU so that it does not rot:
its three rows (GPT-2's step against nanoGPT's, the speedrun through train.py, sampling against
transformers), each with a ratio, the auto settings each run took, the packages' versions; record
5's own file run through torchrun with its Hyperparameters pointed at the shards (a stand-in file
with the record's Hyperparameters lines); bad input in one line."""

import os
import re
import subprocess
import sys

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


@pytest.mark.slow  # a benchmark's whole run, 20 s: make test-slow
def test_the_three_rows_at_tiny_sizes():
    p = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--tiny", "--speedrun_steps=4"],
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
    for run in ("a", "b"):
        assert re.search(
            rf"^\({run}\) ours: auto settings: attention=xla, scan_layers=off, remat=none, "
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
    assert re.search(
        rf"^\(c\) sampling, batch 1 +[\d,]+ tok/s +[\d,]+ tok/s \(transformers\) +{ratio}",
        out,
        re.M,
    )
    assert re.search(r"^\(c\) tiny-shaped, random weights, .* torch \S+ on cpu", out, re.M), out


def test_record_5_runs_as_it_is_on_the_shards(tmp_path):
    """A copy of the record's file, its Hyperparameters pointed at the shards and the steps asked
    for, run by torchrun in a folder of its own; its own step_avg is the figure."""
    checkout = tmp_path / "modded-nanogpt"
    os.makedirs(checkout / os.path.dirname(bench_gpu.RECORD_5))
    (checkout / bench_gpu.RECORD_5).write_text(STAND_IN)
    data = tmp_path / "shards"
    data.mkdir()
    bench_gpu.write_shards(str(data), 1000, 100)
    r = bench_gpu.speedrun_record(str(checkout), str(data), steps=13)
    assert r["ms"] == 912.0 and "step:13/13" in r["log"]
    assert (checkout / bench_gpu.RECORD_5).read_text() == STAND_IN  # the checkout itself untouched
    (checkout / bench_gpu.RECORD_5).write_text(STAND_IN.replace("num_iterations", "iterations"))
    with pytest.raises(
        UsageError, match=r"no Hyperparameters line 'num_iterations : \.\.\. = \.\.\.'"
    ):
        bench_gpu.speedrun_record(str(checkout), str(data), steps=13)


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(
        UsageError, match=r"^--record=.*: no records/track_1_short/.* there; give a checkout"
    ):
        bench_gpu.main(["--record", str(tmp_path)])
    with pytest.raises(UsageError, match=r"^--speedrun_steps must be >= 2"):
        bench_gpu.main(["--speedrun_steps=1"])
