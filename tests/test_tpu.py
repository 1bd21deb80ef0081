"""python -m pytest tests/test_tpu.py -q

TPU programs without a TPU: libtpu's ahead-of-time compiler (the tpu extras) compiles the train step
and sample.py's generation for a v5e:2x2 topology here on the CPU (accelerators.topology_devices),
as bench/train.py --memory --topology does, and the train, eval and generate steps for one topology
of every generation (accelerators.TPUS: v2 and v3, the free Colab/Kaggle TPUs, to TPU7x). The
compiled step holds on each chip what the state's shardings say; the program is the TPU's (its tiled
layouts, the attention kernel its compiler takes, none of the model's CPU-only workarounds); each
generation's HBM is its compiler's. The commands (bench/train.py and bench/sample.py --memory, the
compiler's refusal, a bad topology, libtpu's banner): test_tpu_commands.py."""

import math

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_config
from helpers.compile_only import (
    TOPOLOGY,
    T,
    abstract_model,
    compile_generate,
    compile_train_step,
    no_cache_entries,  # noqa: F401 (autouse: a compile-only client's executables stay out of the cache)
)

from compute import accelerators, sharding
from run import train_step
from run.settings import DEFAULTS

# the host's loop of blocks and XLA's attention; the TPU's own choices: the blocks under one scan
# and 'auto' attention (the fused kernel where it runs: splash on a TPU, DESIGN.md)
VARIANTS = {
    "xla_loop": dict(attention="xla", scan_layers=False),
    "auto_scan": dict(attention="auto", scan_layers=True),
}
# the plain loop in make test-slow (CI runs it): make test compiles the one with splash and a
# scan
SLOW_FIRST = [pytest.param("xla_loop", marks=pytest.mark.slow), "auto_scan"]


def tpu_mesh():
    # fsdp 2 x tensor 2
    return sharding.make_mesh(2, 2, devices=accelerators.topology_devices(TOPOLOGY))


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


@pytest.mark.parametrize("variant", SLOW_FIRST)
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


@pytest.mark.parametrize("variant", SLOW_FIRST)
def test_generate_compiles_for_a_tpu(variant):
    """sample.py's generation (generate.generate_in_jit: the prompt prefilled into the KV cache,
    then sampled token by token, top_k) compiled for the same mesh, its weights split as the train
    step's."""
    assert_tpu_program(compile_generate(tiny_config(block_size=T, **VARIANTS[variant]), tpu_mesh()))


@pytest.mark.slow  # make test-slow (CI runs it): make test compiles GPT-2's step for TPUs
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
