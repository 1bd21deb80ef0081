"""python -m pytest tests/test_nanochat_bench.py -q

nanochat's fit and speed figures (docs/tpu.md, docs/gpu.md): bench/train.py's nanochat presets are
its configs' runs, dialed by depth as base_train dials them (against nanochat_recipe's arithmetic),
and their step holds train.py's own state; bench/gpu.py's row (e) runs nanochat's base_train with
the same settings on the same shards and tokenizer in nanochat's layout, timed from its printed dt
and stopped after its last step (a stand-in base_train with its flag names, which refuses any
other); skipped in one line without a checkout; with NANOCHAT_CHECKOUT, nanochat's own."""

import json
import os
import re
import subprocess
import sys
import time
from argparse import Namespace

import jax
import numpy as np
import pytest
from helpers import REPO

from archs import nanochat_recipe
from bench import gpu as bench_gpu
from bench import gpu_nanochat
from bench import train as bench_train
from bench.train_workers import bench_memory
from compute import sharding
from configurator import UsageError, configure
from dataio import parquet_shards
from dataio.chat_tokenizer import ChatTokenizer
from model import GPTConfig
from run import train_setup, train_step
from run.settings import DEFAULTS

# base_train's command lines (runs/speedrun.sh's for the GPT-2 grade): depth, tokens per
# scaling param, its device batch
RUNS = {"nanochat": (20, 12.0), "nanochat-gpt2": (24, 8.0)}
# a stand-in scripts/base_train.py: base_train's flags the row gives (argparse refuses any other),
# nanochat's base directory checked, its step lines with a dt each, then its end-of-run save
STAND_IN = """
import argparse, json, os, time
import pyarrow.parquet as pq
p = argparse.ArgumentParser()
for flag in ("depth", "aspect-ratio", "head-dim", "max-seq-len", "device-batch-size",
             "total-batch-size", "num-iterations", "eval-every", "core-metric-every",
             "sample-every"):
    p.add_argument("--" + flag, type=int)
p.add_argument("--window-pattern")
p.add_argument("--run")
args = p.parse_args()
base = os.environ["NANOCHAT_BASE_DIR"]
shards = sorted(os.listdir(os.path.join(base, "base_data_climbmix")))
assert len(shards) == 3 and all(s.endswith(".parquet") for s in shards), shards
assert pq.read_schema(os.path.join(base, "base_data_climbmix", shards[0])).names == ["text"]
assert {"tokenizer.pkl", "token_bytes.pt"} <= set(os.listdir(os.path.join(base, "tokenizer")))
with open(os.environ["STAND_IN_ARGS"], "w") as f:
    json.dump(dict(vars(args), dtype=os.environ["NANOCHAT_DTYPE"]), f)
n = args.num_iterations
for step in range(n):
    print(f"step {step:05d}/{n:05d} (0.00%) | loss: 5.0 | lrm: 1.00 | dt: {900 + step}.00ms | "
          "tok/sec: 1 | bf16_mfu: 0.00 | epoch: 1 | total time: 0.00m", flush=True)
time.sleep(120)  # its checkpoint at the last step, which times no step
"""


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """Row (e)'s data at its tiny size: nanochat's base directory (write_data)."""
    base = tmp_path_factory.mktemp("nanochat-base")
    gpu_nanochat.write_data(str(base), "tiny")
    return base


def preset_args(preset, **given):
    return Namespace(
        **dict(
            preset=preset,
            batch_size=None,
            dtype="bfloat16",
            remat=None,
            loss_chunk=None,
            scan_layers=None,
            attention="auto",
        )
        | given
    )


@pytest.mark.parametrize("preset", RUNS)
def test_the_presets_are_base_trains_runs(preset):
    """Each preset's shape, horizon and rates are nanochat_recipe.resolve's for base_train's
    command (its arithmetic held against base_train's in tests/test_nanochat_recipe.py), at
    base_train's 32 x 2048 a device and its tokenizer's 32,768 ids; remat and loss_chunk 'auto',
    from its config files."""
    depth, ratio = RUNS[preset]
    s, source = bench_train.step_settings(preset_args(preset))
    recipe = nanochat_recipe.resolve(depth=depth, target_param_data_ratio=ratio)
    shape = recipe.model
    assert (s["n_layer"], s["n_head"], s["n_embd"]) == (depth, shape["n_head"], shape["n_embd"])
    assert (s["block_size"], s["batch_size"], s["vocab_size"]) == (2048, 32, 32768)
    assert s["window_pattern"] == "SSSL" and s["optimizer"] == "muonadamw"
    assert s["max_iters"] == recipe.num_iterations and s["weight_decay"] == recipe.weight_decay
    scale = recipe.batch_lr_scale
    for key, base in (("learning_rate", 0.008), ("muon_learning_rate", 0.02)):
        assert s[key] == pytest.approx(base * scale, rel=1e-15)  # one product each side
    assert (s["remat"], s["loss_chunk"], s["dtype"]) == ("auto", "auto", "bfloat16")
    files = "config/nanochat.py" + (" + config/nanochat_gpt2.py" if preset != "nanochat" else "")
    assert source == f" (from {files})"
    assert bench_train.step_settings(preset_args(preset, batch_size=8))[0]["batch_size"] == 8


def test_a_nanochat_preset_times_ours_only(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/train.py", "--preset=nanochat"])
    with pytest.raises(UsageError) as refused:
        bench_train.main()
    assert str(refused.value) == (
        "--preset=nanochat times ours only (--frameworks=jax): nanochat's own base_train runs "
        "beside it in bench/gpu.py's row (e)"
    )


@pytest.mark.slow  # a step compiled on the CPU, 7-22 s here
def test_a_nanochat_step_holds_train_pys_state():
    """The preset's step, at a tiny shape, holds what train.py's run of the same shape holds:
    nanochat's MuonAdamW over its GPT (a preset that fell back to AdamW, or lost its key/value
    heads or windows, would hold other bytes)."""
    tiny = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=2, vocab_size=320)
    s, _ = bench_train.step_settings(preset_args("nanochat", batch_size=2))
    s = dict(s, **tiny, devices=1, fsdp=1, tensor_parallel=1, topology=None, gpu=None)
    r = bench_memory(s)
    c = configure(
        DEFAULTS,
        [
            "config/nanochat.py",
            "--depth=2",
            "--aspect_ratio=32",
            "--head_dim=32",
            "--block_size=64",
            "--batch_size=2",
            "--total_batch_size=128",
        ],
    )
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    train_setup.dial(c, 320, mesh, master=False)
    keys = ("block_size", "n_layer", "n_head", "n_embd", "arch", "n_kv_head", "window_pattern")
    config = GPTConfig(**{k: c[k] for k in keys}, vocab_size=320, bias=False, dtype=s["dtype"])
    _, params, opt_state = jax.eval_shape(
        lambda: train_step.init_state(config, mesh, train_step.make_optimizer(c))
    )
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, opt_state)))
    assert r["state"] == held
    assert r["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1} and r["remat"] == "none"


def test_row_e_is_skipped_in_one_line_without_a_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOCHAT_CHECKOUT", raising=False)
    assert gpu_nanochat.checkout_of(None) is None
    lines, rows = gpu_nanochat.row(None, "tiny")
    assert lines == ["(e) nanochat: skipped, no checkout (--nanochat or NANOCHAT_CHECKOUT)"]
    assert rows == []
    monkeypatch.setenv("NANOCHAT_CHECKOUT", str(tmp_path))
    with pytest.raises(UsageError, match=r"^--nanochat=.*: no scripts/base_train\.py there; give"):
        bench_gpu.main(["--rows=e", "--tiny"])
    with pytest.raises(UsageError, match=r"^--rows=af: give some of the letters abcde"):
        bench_gpu.main(["--rows=af"])


def test_the_data_folder_is_nanochats_layout(tiny_base):
    """Shards of the size's tokens and more, the last the val split, each document of 1/8 of a row
    to 2 rows of words, and a tokenizer of the size's ids whose token_bytes.pt agrees with it."""
    tmp_path = tiny_base
    run = gpu_nanochat.SIZES["tiny"]["run"]
    shards = parquet_shards.list_shards(str(tmp_path / "base_data_climbmix"))
    assert [os.path.basename(p) for p in shards] == [f"shard_0000{k}.parquet" for k in range(3)]
    tokenizer = ChatTokenizer.from_directory(str(tmp_path / "tokenizer"))
    assert tokenizer.n_vocab == gpu_nanochat.SIZES["tiny"]["vocab_size"]
    train = list(parquet_shards.texts(str(tmp_path / "base_data_climbmix"), "train"))
    words = [len(t.split()) for t in train]
    assert min(words) >= run["block_size"] // 8 and max(words) < 2 * run["block_size"]
    tokens = sum(len(ids) for ids in tokenizer.encode(train))
    assert tokens >= (run["max_iters"] + 2) * run["total_batch_size"]


def test_nanochats_side_runs_its_flags_until_its_last_step(tiny_base, tmp_path, monkeypatch):
    """base_train from the checkout gets the run's settings under its own flag names, nanochat's
    base directory and the run's dtype; its figure is the median of its dt from the 4th step; it
    is stopped after its last step's line, not at its save."""
    checkout = tmp_path / "nanochat"
    os.makedirs(checkout / "scripts")
    (checkout / "scripts" / "base_train.py").write_text(STAND_IN)
    (checkout / "scripts" / "__init__.py").write_text("")
    monkeypatch.setenv("STAND_IN_ARGS", str(tmp_path / "args.json"))
    t0 = time.time()
    r = gpu_nanochat.theirs(str(checkout), str(tiny_base), "tiny", str(tmp_path / "log.txt"))
    assert time.time() - t0 < 60  # not the 120 s of its save
    run = gpu_nanochat.SIZES["tiny"]["run"]
    steps = run["max_iters"]
    assert r["ms"] == float(np.median([900 + k for k in range(3, steps)]))
    assert not r["fa3"] and (tmp_path / "log.txt").read_text() == r["log"]
    got = json.loads((tmp_path / "args.json").read_text())
    for ours, theirs in gpu_nanochat.RUN.items():
        assert got[theirs.replace("-", "_")] == run[ours], ours
    assert got["dtype"] == "float32" and got["run"] == "dummy"
    assert got["eval_every"] == got["core_metric_every"] == got["sample_every"] == -1


@pytest.mark.slow  # train.py's tiny run beside the stand-in, ~21 s here
def test_row_e_at_tiny_size(tmp_path):
    checkout = tmp_path / "nanochat"
    os.makedirs(checkout / "scripts")
    (checkout / "scripts" / "base_train.py").write_text(STAND_IN)
    (checkout / "scripts" / "__init__.py").write_text("")
    env = dict(os.environ, STAND_IN_ARGS=str(tmp_path / "args.json"))
    cmd = [sys.executable, "-m", "bench.gpu", "--tiny", "--rows=e", f"--nanochat={checkout}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    theirs = np.median([900 + k for k in range(3, gpu_nanochat.SIZES["tiny"]["run"]["max_iters"])])
    assert re.search(
        rf"^\(e\) nanochat d2 step, config/nanochat\.py +[\d.]+ ms +{theirs:.1f} ms \(base_train\) "
        r"+\d+\.\d\d$",
        out,
        re.M,
    ), out
    assert re.search(
        r"^\(e\) ours: auto settings: attention=windows-\S+, scan_layers=off", out, re.M
    )
    assert re.search(
        r"^\(e\) nanochat's base_train \(2 x 64 a device, 256 tokens a step, float32, windows "
        r"SL\): attention SDPA",
        out,
        re.M,
    ), out


@pytest.mark.slow  # nanochat's own base_train, torch.compile on 2 CPU cores: 120-210 s here
@pytest.mark.skipif(
    not os.environ.get("NANOCHAT_CHECKOUT"),
    reason="NANOCHAT_CHECKOUT: a karpathy/nanochat checkout",
)
def test_row_e_against_nanochats_own_base_train():
    checkout = os.environ["NANOCHAT_CHECKOUT"]
    cmd = [sys.executable, "-m", "bench.gpu", "--tiny", "--rows=e", f"--nanochat={checkout}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert re.search(
        r"^\(e\) nanochat d2 step, config/nanochat\.py +[\d.]+ ms +[\d.]+ ms \(base_train\) "
        r"+\d+\.\d\d$",
        p.stdout,
        re.M,
    ), p.stdout
