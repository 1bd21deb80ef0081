"""Shared test helpers: tiny settings, train.py in-process and as a command, what a run leaves
behind."""

import contextlib
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

import train
from configurator import command_line_keys, configure, exit_on_bad_input
from parity.common import write_datafile
from run.settings import DEFAULTS


def assert_close(actual, expected, rtol=0.0, atol=0.0, what=""):
    """np.testing-style closeness, but the failure message reports max and mean abs diff."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what} shape {a.shape} != {e.shape}"
    diff = np.abs(a - e)
    bad = diff > atol + rtol * np.abs(e)
    assert not bad.any(), (
        f"{what} not close: max abs diff {diff.max():.3g}, mean abs diff {diff.mean():.3g}, "
        f"{bad.sum()} of {bad.size} beyond atol={atol:g} rtol={rtol:g}"
    )


def rel_diff(a, b):
    """max |a - b| / max |b|, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@contextlib.contextmanager
def one_torch_thread():
    """Torch on one thread, and the pythons a test starts too (OMP_NUM_THREADS): its OpenMP threads
    spin at barriers, and on 2 shared cores they slow the tiny model 10x (test_check_train.py)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def save_ours(out_dir, model, config=None, iter_num=5):
    """A checkpoint of `model` as train.py writes it, its settings `config` (the optimizer state is
    not what an export reads)."""
    from flax import nnx

    from run import checkpoint

    mngr = checkpoint.manager(out_dir)
    meta = checkpoint.meta_for(
        model.config, {"dataset": "x"} if config is None else config, iter_num, 1.5, {}
    )
    checkpoint.save(mngr, iter_num, nnx.state(model), {"count": np.zeros((), np.int32)}, meta)
    mngr.wait_until_finished()
    mngr.close()


def random_nanogpt(seed=0, bias=True, flash=True, **kw):
    """nanoGPT's GPT (parity/nanogpt_reference.py, torch) with every tensor random
    (parity.common.randomized: its init leaves biases 0 and LayerNorms 1, which would hide a swapped
    or missing mapping)."""
    from parity import nanogpt_reference as nanogpt
    from parity.common import randomized

    config = nanogpt.GPTConfig(
        **{
            "block_size": 32,
            "vocab_size": 65,
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 48,
            "bias": bias,
            **kw,
        }
    )
    return randomized(nanogpt.GPT(config, flash=flash).eval(), seed)


def tiny_config(**kw):
    from model import GPTConfig

    return GPTConfig(
        **{"block_size": 32, "vocab_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 64, **kw}
    )


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 20 HellaSwag examples
HELLASWAG_FIXTURE = os.path.join(REPO, "tests", "fixtures", "hellaswag_small.jsonl")
# eval.py's local lm-eval tasks (test_eval.py, test_eval_scoring.py)
TASKS = os.path.join(REPO, "eval_tasks")
TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=16",
    "--batch_size=4",
    "--gradient_accumulation_steps=1",
    "--eval_iters=2",
    "--eval_interval=1000",
    "--log_interval=1",
    "--max_iters=4",
    "--warmup_iters=2",
    "--lr_decay_iters=10",
    "--learning_rate=1e-2",
    "--dtype=float32",
    "--dropout=0.0",
    "--bias=True",
]


def tiny_argv(dataset, out_dir, *extra):
    return TINY + [f"--dataset={dataset}", f"--out_dir={out_dir}", *extra]


def settings(dataset, out_dir, *extra):
    return configure(DEFAULTS, tiny_argv(dataset, out_dir, *extra))


def run(dataset, out_dir, *extra):
    """train.py's run of the tiny settings and `extra`, each as typed on its command line."""
    argv = tiny_argv(dataset, out_dir, *extra)
    return train.Trainer(configure(DEFAULTS, argv), typed=command_line_keys(argv)).run()


def read_log(out_dir, key):
    """(iter, value) of each record with `key`, in out_dir's log.jsonl (a local path or a gs://
    URL)."""
    from dataio import storage

    text = storage.read_bytes(storage.join(str(out_dir), "log.jsonl")).decode()
    return [(r["iter"], r[key]) for r in map(json.loads, text.splitlines()) if key in r]


def fake_devices(n):
    """The environment of a python with n fake CPU devices: this one's, its XLA_FLAGS too
    (conftest.QUICK_COMPILE)."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    ).split()
    return {
        **os.environ,
        "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={n}"]),
    }


def train_cli(args, devices=1, env=None, **kw):
    """train.py as a command. On 1 device in this process's environment: XLA_FLAGS are part of the
    compilation cache's key, and what the tests compiled in process, it finds in the cache."""
    env = {**(fake_devices(devices) if devices > 1 else os.environ), **(env or {})}
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def snapshot(path):
    return {
        os.path.join(r, f): os.stat(os.path.join(r, f)).st_mtime_ns
        for r, _, fs in os.walk(path)
        for f in fs
    }


def prepare_script(name):
    """data/<name>/prepare.py as a module (its main() callable in process)."""
    path = os.path.join(REPO, "data", name, "prepare.py")
    spec = importlib.util.spec_from_file_location(f"{name}_prepare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exit_line(main, capsys):
    """What the command line prints for main's UsageError: its exit code and the one line on
    stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        exit_on_bad_input(main)
    err = capsys.readouterr().err
    return done.value.code, err.splitlines()[-1]


def one_line_error(result, code):
    err = result.stderr.strip()
    assert result.returncode == code and err.startswith("error: ") and "\n" not in err, (
        result.stderr[-3000:]
    )
    return err


def assert_memory_lines(lines, auto, fits):
    """bench/train.py --memory's lines after the first (the devices and the mesh): the auto
    settings, matching `auto`; the memory per device; the device's memory and whether the step
    fits, matching `fits` (regular expressions)."""
    memory = r"memory per device: state \d+\.\d\d GiB, step peak \d+\.\d\d GiB"
    for i, pattern in enumerate((auto, memory, fits), 1):
        assert re.fullmatch(pattern, lines[i]), lines[i]


def popen_train(args, process_id, port, devices=2):
    """Process `process_id` of a train.py run of 2 processes (each compiles its own programs: JAX
    caches process 0's only)."""
    env = {
        **fake_devices(devices),
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(process_id),
    }
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def transpose_c_proj_on_restore(monkeypatch):
    """A bug planted in our checkpoint loader: layer 0's square attn.c_proj comes back transposed (a
    parity check whose reference reads the checkpoint by its own path must catch it)."""
    from run import checkpoint

    load = checkpoint.load_checkpoint_model

    def transposed(*args, **kwargs):
        model, meta = load(*args, **kwargs)
        model.h[0].attn.c_proj.kernel.set_value(model.h[0].attn.c_proj.kernel[...].T)
        return model, meta

    monkeypatch.setattr(checkpoint, "load_checkpoint_model", transposed)


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (jit, scan, cond, custom_vjp,
    remat)."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from equations(sub)


class Call:
    """Pickles as the call fn(*args), which a plain pickle.load makes (a file's payload the readers
    must refuse)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def python_in_c_locale(script, timeout=120):
    """`python -c script` in the repository as a C locale without Python's UTF-8 mode runs it (a
    python of its own, as on a bare server): what reads or writes a file must not depend on the
    locale's encoding."""
    return subprocess.run(
        [sys.executable, "-X", "utf8=0", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0"},
        timeout=timeout,
    )


# record 5's recipe at a tiny size (test_muon.py, test_optimizer.py)
MUON_SETTINGS = dict(
    DEFAULTS,
    optimizer="muon",
    arch="speedrun",
    bias=False,
    learning_rate=0.01,
    muon_learning_rate=0.02,
    lr_schedule="trapezoid",
    max_iters=6,
    warmup_iters=2,
    warmdown_iters=3,
    weight_decay=0.0,
    muon_ns_dtype="float32",
)

# what a token file's error tells the user to do (test_bin_shards.py, test_token_files.py)
FIX = "the run stopped; restore the file and resume with --init_from=resume"


def write_shards(folder, sizes, split="train", seed=0):
    """Random uint16 shards named as the record's (fineweb_train_000001.bin, ...; val from 000000);
    their tokens."""
    rng, arrays = np.random.default_rng(seed), []
    for i, n in enumerate(sizes):
        arrays.append(rng.integers(0, 2**16, n, dtype=np.uint16))
        write_datafile(folder / f"fineweb_{split}_{i + (split == 'train'):06d}.bin", arrays[-1])
    return arrays
