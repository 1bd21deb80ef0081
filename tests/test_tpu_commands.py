"""python -m pytest tests/test_tpu_commands.py -q

The commands on a TPU topology without a TPU (libtpu's ahead-of-time compiler, the tpu extras):
bench/train.py --memory --topology prints the step's memory and whether it fits the chip, a step
too big reported with the compiler's figure, and for the 124M recipe takes what fits each TPU;
bench/sample.py --memory sizes generation for a chip; the TPU compiler's out-of-memory refusal, read
in both its forms, is one line naming the fixes in train.py; a bad topology name, or splash in bf16
on v2 and v3, is one line; libtpu's start-up banner never reaches the terminal (the programs
compiled for a TPU: test_tpu.py)."""

import os
import re
import subprocess
import sys

import helpers
import jax
import pytest
from helpers import REPO
from helpers.compile_only import (
    TOPOLOGY,
    no_cache_entries,  # noqa: F401 (autouse: keeps the TPU executables out of the cache)
)

from bench import sample as bench_sample
from bench import train as bench_train
from compute import accelerators
from configurator import UsageError
from parity.common import save_random_hf_model
from run import auto_settings


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env or os.environ,
    )


# the benchmarks' TPU sizing: make test-slow (CI runs it); tests/test_tpu.py compiles for TPUs
# in make test
@pytest.mark.slow
def test_bench_memory_for_a_topology(monkeypatch, capsys):
    """bench/train.py --memory --topology: the memory line, then the chip's HBM and whether the step
    fits; a step too big for the chip is the compiler's refusal, reported as a measurement, exit 0
    (the refusal with bench_train's worker in this process: the command itself runs above)."""
    p = run(
        "-m",
        "bench.train",
        "--memory",
        f"--topology={TOPOLOGY}",
        "--preset=tiny",
        "--fsdp=2",
        "--tensor_parallel=2",
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]  # no libtpu banner either
    lines = p.stdout.splitlines()
    assert (
        "4 tpu device(s) of v5e:2x2 (TPU v5 lite), mesh data 1 x fsdp 2 x tensor 2" in lines[0]
    ), lines[0]
    helpers.assert_memory_lines(
        lines,
        r"auto settings: attention=splash, scan_layers=on, remat=none, loss_chunk=0 \(step peak "
        r"\d+\.\d\d of 15\.75 GiB usable on TPU v5 lite\)",
        r"TPU v5 lite HBM 15\.75 GiB per device: fits, step peak \d+% of it \(compiled by libtpu "
        r"for v5e:2x2 in [\d.]+ s\)",
    )

    worker = bench_train.WORKERS["memory"]
    monkeypatch.setattr(
        bench_train, "run_worker", lambda framework, s, env: worker(dict(s, framework=framework))
    )
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench/train.py",
            "--memory",
            f"--topology={TOPOLOGY}",
            "--preset=tiny",
            "--batch_size=32768",
            "--remat=block",
            "--loss_chunk=128",
        ],
    )
    assert bench_train.main() == 0
    assert re.fullmatch(
        r"memory per device: state \d+\.\d\d GiB; does not fit: needs ~\d+\.\d\d GiB of 15\.75 GiB "
        r"HBM \(the TPU compiler's figure\)",
        capsys.readouterr().out.splitlines()[-1],
    )


@pytest.mark.slow
def test_the_124m_recipe_takes_what_fits_each_tpu():
    """bench/train.py --memory for config/train_gpt2.py's batch 64 (remat and loss_chunk 'auto'; ~40
    s and ~60 s of libtpu compiles): a v5e chip takes the least recompute whose step fits its 15.75
    GiB, a v6e chip (31.25 GiB) recomputes less than a v5e; each line names the candidates the TPU
    compiler refused."""
    chosen = {}
    for topology, kind, hbm in (
        ("v5e:2x2", "TPU v5 lite", 15.75),
        ("v6e:2x2", "TPU v6 lite", 31.25),
    ):
        p = run(
            "-m",
            "bench.train",
            "--memory",
            f"--topology={topology}",
            "--preset=gpt2",
            "--batch_size=64",
            "--dtype=bfloat16",
        )
        assert p.returncode == 0, p.stderr[-3000:]
        auto = next(line for line in p.stdout.splitlines() if line.startswith("auto settings:"))
        m = re.fullmatch(
            r"auto settings: attention=splash, scan_layers=on, remat=(\w+), loss_chunk=(\d+) "
            rf"\(step peak (\d+\.\d\d) of {hbm:.2f} GiB usable on {kind}; too big: none/0 "
            r"[\d.]+.*\)",
            auto,
        )
        assert m and float(m[3]) <= hbm, auto
        chosen[topology] = auto_settings.CANDIDATES.index((m[1], int(m[2])))
    assert chosen["v6e:2x2"] < chosen["v5e:2x2"], chosen


@pytest.mark.slow  # as test_bench_memory_for_a_topology
def test_bench_sample_sizes_generation_for_a_tpu_chip(capsys):
    """bench/sample.py --memory: sample.py's generation (KV cache, top-k) for one chip of a
    topology, from abstract weights; without a target, or with two, one line."""
    args = ["--memory", "--topology=v5e:2x2", "--size=gpt2", "--batch", "2", "--new-tokens", "8"]
    assert bench_sample.main(args) == 0
    assert re.fullmatch(
        r"gpt2, batch 2, 16 positions, bfloat16, KV cache, on TPU v5 lite: weights 0\.46 GiB, "
        r"generate peak \d+\.\d\d GiB of 15\.75 GiB: fits \(compiled by libtpu in [\d.]+ s\)\n",
        capsys.readouterr().out,
    )
    for args in (["--memory"], ["--memory", "--gpu=h100", "--topology=v5e:2x2"]):
        with pytest.raises(
            UsageError, match="^--memory compiles for a device it need not have: give --gpu"
        ):
            bench_sample.main(args)


def test_tpu_out_of_memory_reads_both_refusals():
    """The two forms of the TPU compiler's out-of-memory error; any other error is not a refusal."""
    G = 2**30
    assert accelerators.tpu_out_of_memory(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
        "for HLO temporaries (16.16G) exceeds available HBM (15.75G)."
    ) == (16.16 * G, 15.75 * G)
    assert accelerators.tpu_out_of_memory(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
        "memory space hbm. Used 15.82G of 15.75G hbm."
    ) == (15.82 * G, 15.75 * G)
    assert accelerators.tpu_out_of_memory("RESOURCE_EXHAUSTED: some other limit") is None


def test_a_step_the_tpu_compiler_refuses_is_one_line(dataset, tmp_path, monkeypatch):
    """On a TPU the compiler itself refuses a step that does not fit (on a v2-8,
    config/train_gpt2.py's batch 32 per device: bench/train.py --memory --topology=v2:2x2): train.py
    turns that refusal into one line naming the fixes, before a step runs."""

    class Refused:  # a lowered step whose compile the TPU compiler refuses
        def __init__(self, message):
            self.message = message

        def compile(self, options=None):
            raise jax.errors.JaxRuntimeError(self.message)

    def refused(message):
        return lambda *args: Refused(message)

    monkeypatch.setattr(
        auto_settings,
        "lower_step",
        refused(
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 8.62G of 7.48G hbm. Exceeded hbm capacity by 1.14G."
        ),
    )
    with pytest.raises(
        UsageError,
        match=r"^the train step needs 8\.62 GiB per device, the device has 7\.48 GiB: "
        r"lower --batch_size .* or raise --fsdp / --tensor_parallel$",
    ):
        # every candidate of remat and loss_chunk 'auto' refused
        helpers.run(dataset, tmp_path / "out")
    monkeypatch.setattr(auto_settings, "lower_step", refused("INTERNAL: something else"))
    # any other error keeps its traceback
    with pytest.raises(jax.errors.JaxRuntimeError, match="^INTERNAL"):
        helpers.run(dataset, tmp_path / "out2")


def test_unknown_topology_is_one_line():
    p = run("-m", "bench.train", "--memory", "--topology=v9:2x2", "--preset=tiny")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.startswith(
        "error: unknown TPU topology 'v9:2x2': give one of v2:2x2, v3:2x2, v4:2x2x1, v5e:2x4, "
        "v5p:2x2x1, v6e:2x4, tpu7x:2x2x1 (one host; XxY chips for v2, v3, v5e, v6e, XxYxZ"
    )
    assert p.stderr.count("\n") == 1, p.stderr
    # a generation's other form is unknown too
    for name in ("v3:2x2x1", "v4:2x2", "tpu7x:2x2", "v5e"):
        with pytest.raises(UsageError, match=f"^unknown TPU topology '{name}': give one of v2:2x2"):
            accelerators.topology_devices(name)
    # a v3-32: 4 hosts of 2x2 chips, a device per core
    assert len(accelerators.topology_devices("v3:4x4")) == 32
    assert len(accelerators.topology_devices("tpu7x:2x2x2")) == 16


@pytest.mark.parametrize("topology", ["v2:2x2", "v3:2x2"])
def test_splash_in_bf16_on_v2_and_v3_is_one_line(topology, monkeypatch):
    """Their compiler refuses the splash kernel in bf16 (test_every_generation_...): an explicit
    attention='splash' is refused before anything compiles, naming the fixes; bench/train.py exits 2
    on it (exit_on_bad_input)."""
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench/train.py",
            "--memory",
            f"--topology={topology}",
            "--preset=tiny",
            "--dtype=bfloat16",
            "--attention=splash",
        ],
    )
    monkeypatch.setattr(bench_train, "run_worker", lambda *a: pytest.fail("a worker started"))
    with pytest.raises(UsageError) as e:
        bench_train.main()
    kind = accelerators.topology_devices(topology)[0].device_kind
    assert str(e.value) == (
        f"attention='splash' cannot run here: {kind}'s kernel compiler takes it in float32 only, "
        "dtype is 'bfloat16'; use attention='auto' or 'xla', or dtype='float32'"
    )


@pytest.mark.slow
def test_libtpu_banner_stays_off_the_terminal(tmp_path):
    """With libtpu installed and no TPU, starting JAX's backends (no JAX_PLATFORMS) makes libtpu
    print its start-up lines, every one of which LIBTPU_BANNER knows; sharding.start_backend and
    topology_devices keep them all off stderr. ALLOW_MULTIPLE_LIBTPU_LOAD: another process's libtpu
    (a test beside this one) holds its lockfile."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    raw = run("-c", "import jax; jax.devices()", env=dict(env, ALLOW_MULTIPLE_LIBTPU_LOAD="1"))
    assert raw.returncode == 0, raw.stderr[-3000:]
    assert raw.stderr.strip(), (
        "libtpu printed nothing at start-up: is it installed (the tpu extras)?"
    )
    assert all(accelerators.LIBTPU_BANNER.search(line) for line in raw.stderr.splitlines()), (
        raw.stderr
    )
    quiet = run(
        "-c",
        "import jax; from compute import accelerators, sharding; sharding.start_backend(); "
        "accelerators.topology_devices('v5e:2x2'); "
        "print(jax.devices()[0].platform)",
        env=env,
    )
    assert quiet.returncode == 0 and quiet.stdout == "cpu\n", quiet.stderr[-3000:]
    assert quiet.stderr == ""
    quiet = run(
        "-c",
        "from compute import accelerators; print(len(accelerators.topology_devices('v5e:2x4')))",
        env=env,
    )
    assert quiet.stdout == "8\n" and quiet.stderr == "", quiet.stderr
    # a user's command: sample.py from a (tiny, random) HF directory
    save_random_hf_model(
        tmp_path / "hf", n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=50257
    )
    sample = run(
        "sample.py",
        f"--init_from={tmp_path / 'hf'}",
        "--max_new_tokens=2",
        "--num_samples=1",
        env=env,
    )
    assert sample.returncode == 0 and not any(
        accelerators.LIBTPU_BANNER.search(line) for line in sample.stderr.splitlines()
    ), sample.stderr[-3000:]
