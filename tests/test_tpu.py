"""python -m pytest tests/test_tpu.py -q

TPU programs without a TPU: libtpu's ahead-of-time compiler (the tpu extras) compiles the train step
and sample.py's generation for a v5e:2x2 topology here on the CPU (accelerators.topology_devices),
as bench/train.py --memory --topology does, and the train, eval and generate steps for one topology
of every generation (accelerators.TPUS: v2 and v3, the free Colab/Kaggle TPUs, to TPU7x). The
compiled step holds on each chip what the state's shardings say; the program is the TPU's (its tiled
layouts, the attention kernel its compiler takes, none of the model's CPU-only workarounds); a step
that does not fit is reported with the compiler's figure; a bad topology name, or a kernel the TPU
cannot compile, is one line; libtpu's start-up banner never reaches the terminal."""

import math
import os
import re
import subprocess
import sys

import helpers
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import tiny_config
from jax._src import config as jax_config

import accelerators
import auto_settings
import generate
import sharding
import train_step
from bench import sample as bench_sample
from bench import train as bench_train
from configurator import UsageError
from model import GPT
from parity.common import save_random_hf_model
from settings import DEFAULTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGY = "v5e:2x2"
T = 128  # splash attention's blocks are 128 positions
# the host's loop of blocks and XLA's attention; the TPU's own choices: the blocks under one scan
# and 'auto' attention (the fused kernel where it runs: splash on a TPU, DESIGN.md)
VARIANTS = {
    "xla_loop": dict(attention="xla", scan_layers=False),
    "auto_scan": dict(attention="auto", scan_layers=True),
}


@pytest.fixture(autouse=True)
def no_cache_entries():
    """JAX's persistent compilation cache (tests/conftest.py) would store these TPU executables but
    cannot load them back (a compile-only client): keep them out of it."""
    with jax_config.persistent_cache_min_compile_time_secs(math.inf):
        yield


def tpu_mesh():
    # fsdp 2 x tensor 2
    return sharding.make_mesh(2, 2, devices=accelerators.topology_devices(TOPOLOGY))


def abstract_model(config, mesh):
    """(graphdef, params): ShapeDtypeStructs placed by the table's shardings, as
    bench_train.bench_memory's."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))
    return graphdef, sharding.abstract(params, sharding.shardings_for(params, mesh))


def compile_train_step(config, mesh, settings=DEFAULTS):
    """(compiled step, state bytes per device, params, opt_state, batch, step peak bytes) of
    train.py's step, 2 rows per batch shard, with the optimizer of train.py's `settings`."""
    graphdef, params = abstract_model(config, mesh)
    tx = train_step.make_optimizer(dict(settings))
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = sharding.abstract(opt_state, sharding.shardings_for(opt_state, mesh))
    batch = jax.ShapeDtypeStruct(
        (1, 2 * sharding.batch_shards(mesh), T), jnp.int32, sharding=sharding.batch_sharding(mesh)
    )
    step = train_step.make_train_step(graphdef, tx, grad_clip=1.0)
    compiled, state, peak = train_step.compile_step(
        step, params, opt_state, batch.shape, batch.sharding
    )
    return compiled, state, params, opt_state, batch, peak


def compile_generate(config, mesh):
    """sample.py's generation (generate.generate_in_jit: the prompt prefilled into the KV cache,
    then sampled token by token, top_k) for 2 prompts, compiled; its weights split as the train
    step's."""
    graphdef, params = abstract_model(config, mesh)
    replicated = sharding.replicated(mesh)
    # 2 prompts, then their samples
    buf = jax.ShapeDtypeStruct((2, T), jnp.int32, sharding=replicated)
    prompt_len = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    with jax.set_mesh(mesh):
        lowered = generate.generate_in_jit.lower(
            nnx.merge(graphdef, params),
            buf,
            prompt_len,
            key,
            sampling=(0.8, 10, None, None),
            use_cache=True,
            on_token=None,
            return_logits=False,
        )
    return lowered.compile().compiled  # nnx's Compiled wraps jax's


def tiled_bytes(shape, dtype, layout):
    """Bytes of an array in a TPU layout: its minor dimensions rounded up to the layout's tile (8 x
    128 elements for a float32 matrix), a scalar a whole tile."""
    dims = [shape[i] for i in layout.major_to_minor] or [1]
    for k, t in enumerate(reversed(layout.tiling[0] if layout.tiling else ()), 1):
        if k <= len(dims):
            dims[-k] = -(-dims[-k] // t) * t
    return math.prod(dims) * jnp.dtype(dtype).itemsize


def assert_tpu_program(compiled):
    """Compiled by the TPU compiler: float32 matrices in (8, 128) tiles (XLA:CPU tiles nothing), and
    without the conditional that the model puts in its backward pass on a CPU only
    (model.fusion_barrier_in_grad)."""
    layouts = [
        f.layout
        for f in jax.tree.leaves(compiled.input_formats, is_leaf=lambda f: hasattr(f, "layout"))
        if f.layout is not None
    ]
    assert any(layout.tiling and layout.tiling[0] == (8, 128) for layout in layouts), layouts[:4]
    assert " conditional(" not in compiled.as_text()


@pytest.mark.parametrize("variant", VARIANTS)
def test_train_step_compiles_for_a_tpu(variant):
    """The step compiled for fsdp 2 x tensor 2 on v5e:2x2: each chip's arguments are the shards the
    state's shardings give it (sharding.bytes_per_device) and the batch's, each padded to the TPU's
    tiles, and nothing more. The key is no argument: at dropout 0 the step never reads it, and jit
    drops it."""
    compiled, state, params, opt_state, batch, peak = compile_train_step(
        tiny_config(block_size=T, **VARIANTS[variant]), tpu_mesh()
    )
    assert_tpu_program(compiled)
    # the step's peak is the TPU compiler's own (its heap simulation: what it refuses a program by),
    # not the sum of arguments, outputs and temporaries that stands for it elsewhere
    assert (
        peak
        == compiled.memory_analysis().peak_memory_in_bytes
        != sharding.step_peak_bytes(compiled)
    )
    # the splash kernel (a Pallas TPU kernel: a custom call) where attention='auto' picks it
    assert ("tpu_custom_call" in compiled.as_text()) == (VARIANTS[variant]["attention"] == "auto")

    args = [*jax.tree.leaves(params), *jax.tree.leaves(opt_state), batch, batch]
    formats = [
        *compiled.input_formats[0][0],
        *compiled.input_formats[0][1],
        *compiled.input_formats[0][2:4],
    ]
    assert [f.sharding.spec for f in formats] == [a.sharding.spec for a in args], (
        "the step resharded its inputs"
    )
    shards = [(a.sharding.shard_shape(a.shape), a.dtype, f.layout) for a, f in zip(args, formats)]
    padding = sum(tiled_bytes(*s) - math.prod(s[0]) * s[1].itemsize for s in shards)
    batch_bytes = 2 * sharding.bytes_per_device(batch)  # x and y
    assert compiled.memory_analysis().argument_size_in_bytes == state + batch_bytes + padding


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_compiles_for_a_tpu(variant):
    """sample.py's generation (generate.generate_in_jit: the prompt prefilled into the KV cache,
    then sampled token by token, top_k) compiled for the same mesh, its weights split as the train
    step's."""
    assert_tpu_program(compile_generate(tiny_config(block_size=T, **VARIANTS[variant]), tpu_mesh()))


def test_speedrun_step_compiles_for_a_tpu():
    """The speedrun recipe's step (arch='speedrun': rotary, QK-norm, RMSNorm, ReLU²; Muon on the
    blocks' matrices, its Newton-Schulz run whole on every chip) compiled for fsdp 2 x tensor 2 on
    v5e:2x2, in bf16, splash attention taking the rotated, normed q and k."""
    config = tiny_config(
        block_size=T, arch="speedrun", bias=False, dtype="bfloat16", scan_layers=True
    )
    settings = dict(
        DEFAULTS,
        arch="speedrun",
        optimizer="muon",
        muon_learning_rate=0.01,
        lr_schedule="trapezoid",
        warmdown_iters=10,
        max_iters=100,
    )
    compiled = compile_train_step(config, tpu_mesh(), settings)[0]
    assert_tpu_program(compiled)
    assert "tpu_custom_call" in compiled.as_text()


# one topology of every generation (accelerators.TPUS), its device_kind, and whether its compiler
# takes splash in bf16
GENERATIONS = {
    "v2:2x2": ("TPU v2", False),
    "v3:2x2": ("TPU v3", False),
    "v4:2x2x1": ("TPU v4", True),
    "v5e:2x2": ("TPU v5 lite", True),
    "v5p:2x2x1": ("TPU v5", True),
    "v6e:2x2": ("TPU v6 lite", True),
    "tpu7x:2x2x1": ("TPU7x", True),
}


# v2 in make test, the other generations in make test-slow (CI runs both): each is seconds of libtpu
# compiling
@pytest.mark.parametrize(
    "topology",
    [pytest.param(t, marks=[] if t == "v2:2x2" else pytest.mark.slow) for t in GENERATIONS],
)
def test_every_generation_compiles_train_eval_and_generate(topology):
    """The tiny model in bf16 with attention='auto' and the blocks under one scan (a TPU's
    defaults), data parallel over one host's devices: train.py's train and eval steps and
    sample.py's generation compile. The train step holds the splash kernel where the TPU's compiler
    takes it in bf16 (v4 on) and XLA's attention on v2 and v3, which refuse it. The table's HBM per
    device is the compiler's own "available HBM", to the 0.01 GiB it prints."""
    devices = accelerators.topology_devices(topology)
    kind, splash = GENERATIONS[topology]
    assert devices[0].device_kind == kind
    mesh = sharding.make_mesh(devices=devices)
    config = tiny_config(block_size=T, dtype="bfloat16", attention="auto", scan_layers=True)
    compiled, *_ = compile_train_step(config, mesh)
    assert_tpu_program(compiled)
    assert ("tpu_custom_call" in compiled.as_text()) == splash

    graphdef, params = abstract_model(config, mesh)
    rows = jax.ShapeDtypeStruct(
        (2 * sharding.batch_shards(mesh), T),
        jnp.int32,
        sharding=sharding.batch_sharding(mesh, ndim=2),
    )
    with jax.set_mesh(mesh):
        lowered = train_step.make_eval_step(graphdef, params).lower(
            jax.tree.leaves(params), rows, rows
        )
    assert_tpu_program(lowered.compile())
    assert_tpu_program(compile_generate(config, mesh))

    one = jax.sharding.SingleDeviceSharding(devices[0])
    too_big = jax.ShapeDtypeStruct((2**35,), jnp.float32, sharding=one)  # 128 GiB
    with pytest.raises(jax.errors.JaxRuntimeError) as e:
        jax.jit(lambda x: x + 1, out_shardings=one).lower(too_big).compile()
    _, available = accelerators.tpu_out_of_memory(str(e.value))
    usable = accelerators.usable_bytes(devices[0])
    assert abs(available - usable) < 0.005 * 2**30, (available, usable)


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env or os.environ,
    )


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
    assert re.fullmatch(
        r"auto settings: attention=splash, scan_layers=on, remat=none, loss_chunk=0 \(step peak "
        r"\d+\.\d\d of 15\.75 GiB usable on TPU v5 lite\)",
        lines[1],
    ), lines[1]
    assert re.fullmatch(
        r"memory per device: state \d+\.\d\d GiB, step peak \d+\.\d\d GiB", lines[2]
    ), lines[2]
    assert re.fullmatch(
        r"TPU v5 lite HBM 15\.75 GiB per device: fits, step peak \d+% of it \(compiled by libtpu "
        r"for v5e:2x2 in [\d.]+ s\)",
        lines[3],
    ), lines[3]

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
        "import jax, accelerators, sharding; sharding.start_backend(); "
        "accelerators.topology_devices('v5e:2x2'); "
        "print(jax.devices()[0].platform)",
        env=env,
    )
    assert quiet.returncode == 0 and quiet.stdout == "cpu\n", quiet.stderr[-3000:]
    assert quiet.stderr == ""
    quiet = run(
        "-c", "import accelerators; print(len(accelerators.topology_devices('v5e:2x4')))", env=env
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
