"""python -m pytest -m gpu_compile tests/test_gpu.py -q

(make test-gpu-compile: its own venv, .venv-gpu)

NVIDIA GPU programs without a GPU: XLA:GPU, through JAX's CUDA plugin (the cuda extras), compiles
the tiny model's train and eval steps and sample.py's generation here on the CPU for an H100 and an
A100 described by their specs (accelerators.GPUS, accelerators.gpu_devices), as bench/train.py
--memory --gpu does. The program is the GPU's: with attention='auto' in bf16 it holds cuDNN's fused
attention, picked from the mesh's device and not the host's; a bad GPU name is one line; no CUDA
start-up warning reaches the terminal. Marked gpu_compile: the default suite, whose venv has no CUDA
plugin, skips it."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_memory_lines, tiny_config
from helpers.compile_only import (
    T,
    abstract_model,
    compile_generate,
    compile_train_step,
    no_cache_entries,  # noqa: F401 (autouse: a compile-only client's executables stay out of the cache)
)

from bench import sample as bench_sample
from compute import accelerators, attention, sharding
from configurator import UsageError
from run import train_step

pytestmark = pytest.mark.gpu_compile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUS = {"h100": ("NVIDIA H100 80GB HBM3", (9, 0)), "a100-40": ("NVIDIA A100-SXM4-40GB", (8, 0))}
# cuDNN's fused attention, forward and backward
CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


@pytest.mark.parametrize("gpu", GPUS)
def test_train_eval_and_generate_compile_for_a_gpu(gpu):
    """The tiny model in bf16, attention='auto', the blocks under one scan, data parallel over 2
    GPUs: the train step holds cuDNN's fused attention forward and backward and its LayerNorm, the
    eval step its forward attention; sample.py's generation compiles."""
    devices = accelerators.gpu_devices(gpu, 2)
    kind, capability = GPUS[gpu]
    assert [d.device_kind for d in devices] == [kind] * 2 and attention.cuda_capability(
        devices[0]
    ) == capability
    mesh = sharding.make_mesh(devices=devices)
    config = tiny_config(block_size=T, dtype="bfloat16", attention="auto", scan_layers=True)
    text = compile_train_step(config, mesh)[0].as_text()
    assert all(f'custom_call_target="{target}"' in text for target in CUDNN)
    # LayerNorm as cuDNN's (train_step.GPU_OPTIONS)
    assert 'custom_call_target="__cudnn$norm"' in text

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
    assert CUDNN[0] in lowered.compile().as_text()
    compile_generate(config, mesh)


def test_cudnn_only_where_it_runs():
    """'auto' takes XLA's attention in float32 (cuDNN's is bf16 only); an explicit 'cudnn' in
    float32 is refused in one line, as on an attached GPU."""
    mesh = sharding.make_mesh(devices=accelerators.gpu_devices("h100"))
    text = compile_train_step(tiny_config(block_size=T, attention="auto", scan_layers=True), mesh)[
        0
    ].as_text()
    assert not any(target in text for target in CUDNN)  # (its LayerNorm is cuDNN's in float32 too)
    with pytest.raises(
        UsageError, match=r"^attention='cudnn' cannot run here: it computes in bfloat16 only"
    ):
        attention.check_run(tiny_config(attention="cudnn"), mesh.devices.flat[0])


def test_gpu_table():
    """Every GPU of the table compiles (its spec parses, its capability reads back); its memory for
    JAX is the allocator's default 75%; a node of 8, and nodes of 8; a bad name or count is one
    line."""
    for name, gpu in accelerators.GPUS.items():
        device = accelerators.gpu_devices(name)[0]
        assert (
            device.device_kind == gpu.device_kind
            and attention.cuda_capability(device) == gpu.capability
        )
        assert accelerators.usable_bytes(device) == round(0.75 * gpu.memory)
    assert (
        len(accelerators.gpu_devices("h100", 8)) == 8
        and len(accelerators.gpu_devices("h100", 16)) == 16
    )
    with pytest.raises(
        UsageError, match=r"^unknown GPU 'v100': give one of a100-40, a100-80, h100, h200, b200$"
    ):
        accelerators.gpu_devices("v100")
    with pytest.raises(UsageError, match=r"^--gpus=12: give 1 to 8"):
        accelerators.gpu_devices("h100", 12)


def bench_memory(*args):
    """`python -m bench.train --memory ARGS` as a user runs it: the environment without the suite's
    JAX_PLATFORMS and constraint-check skip, so that the CUDA plugin starts as it would."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    }
    command = [sys.executable, "-m", "bench.train", "--memory", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def test_bench_memory_for_a_gpu():
    """bench/train.py --memory --gpu: the memory line, the GPU's memory and whether the step fits;
    with nothing on stderr (no CUDA plugin's complaint about a missing GPU, no libtpu banner)."""
    p = bench_memory("--gpu=a100-40", "--gpus=2", "--preset=tiny", "--dtype=bfloat16")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert (
        "2 gpu device(s) of a100-40 (NVIDIA A100-SXM4-40GB), mesh data 2 x fsdp 1 x tensor 1"
        in lines[0]
    ), lines[0]
    assert_memory_lines(
        lines,
        r"auto settings: attention=cudnn, scan_layers=off, remat=none, loss_chunk=0 \(step peak "
        r"\d+\.\d\d of 29\.57 GiB usable on NVIDIA A100-SXM4-40GB, \+25% margin\)",
        r"NVIDIA A100-SXM4-40GB memory 39\.42 GiB, for JAX 29\.57 GiB per device: fits, step peak "
        r"\d+% of it \(compiled by XLA:GPU for a100-40 in [\d.]+ s\)",
    )


def test_bench_sample_sizes_generation_for_a_gpu(capsys):
    """bench/sample.py --memory --gpu: sample.py's generation for an H100, from abstract weights,
    and whether it fits the memory JAX lets a program use there."""
    assert (
        bench_sample.main(
            ["--memory", "--gpu=h100", "--size=gpt2", "--batch", "2", "--new-tokens", "8"]
        )
        == 0
    )
    assert re.fullmatch(
        r"gpt2, batch 2, 16 positions, bfloat16, KV cache, on NVIDIA H100 80GB HBM3: weights "
        r"0\.46 GiB, generate peak \d+\.\d\d GiB of 59\.33 GiB: fits \(compiled by XLA:GPU in "
        r"[\d.]+ s\)\n",
        capsys.readouterr().out,
    )


@pytest.mark.parametrize(
    "gpu, picks", [("h100", r"remat=none, loss_chunk=0"), ("a100-40", r"remat=\w+, loss_chunk=\d+")]
)
def test_the_124m_recipe_takes_what_fits_each_gpu(gpu, picks):
    """bench/train.py --memory for config/train_gpt2.py's batch 64 (remat and loss_chunk 'auto'): an
    H100 recomputes nothing (none/0), an A100 40 GB takes what fits its 29.57 GiB; the same line
    train.py prints at start-up, naming the attention kernel compiled in (cuDNN's). XLA:GPU's cuDNN
    LayerNorm is in the step (train_step.GPU_OPTIONS)."""
    p = bench_memory(f"--gpu={gpu}", "--preset=gpt2", "--batch_size=64", "--dtype=bfloat16")
    assert p.returncode == 0, p.stderr[-3000:]
    auto = next(line for line in p.stdout.splitlines() if line.startswith("auto settings:"))
    name = GPUS[gpu][0]
    usable = accelerators.gpu_usable(accelerators.GPUS[gpu].memory) / 2**30
    assert re.fullmatch(
        rf"auto settings: attention=cudnn, scan_layers=off, {picks} \(step peak (\d+\.\d\d) of "
        rf"{usable:.2f} GiB usable on {name}, \+25% margin(; too big: .*)?\)",
        auto,
    ), auto
    peak = float(re.search(r"step peak (\d+\.\d\d)", auto)[1])
    assert peak * 1.25 <= usable
    assert re.search(r"fits, step peak \d+% of it", p.stdout), p.stdout


def test_record20_flash_compiles_for_a_gpu():
    """Record 20's flash kernels (window_attention.window_flash_attention), forward and backward, at
    the record's 65,536 tokens and head size 128 for an H100, the window an argument: three Triton
    kernels, and none of the banded kernel's (T x band) scores in memory."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from archs.window_attention import window_flash_attention

    mesh = sharding.make_mesh(devices=accelerators.gpu_devices("h100"))

    def loss(q, k, v, docs, window):
        return jnp.sum(window_flash_attention(q, k, v, docs, window, 0.12).astype(jnp.float32))

    with jax.set_mesh(mesh):
        place = NamedSharding(mesh, P())
        x = jax.ShapeDtypeStruct((1, 65536, 6, 128), jnp.bfloat16, sharding=place)
        docs = jax.ShapeDtypeStruct((1, 65536), jnp.int32, sharding=place)
        window = jax.ShapeDtypeStruct((), jnp.int32, sharding=place)
        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x, docs, window).compile()
    calls = [line for line in compiled.as_text().splitlines() if "custom-call(" in line]
    assert len(calls) == 3 and all("__gpu$xla.gpu.triton" in call for call in calls), calls
    # the banded kernel's scores alone: 65,536 x 6 heads x 1,792 keys in float32, 2.6 GiB
    assert compiled.memory_analysis().temp_size_in_bytes < 2**28
