"""python -m pytest tests/test_window_attention.py -q

archs/window_attention.py's splash and flash kernels for record 20 (Pallas interpret mode on this
CPU) against masked attention over window_mask: forward and gradients at windows that documents and
tiles cut, the tiles splash's tables visit (exactly those the window meets), which kernel each
setting and platform gets, and splash's Mosaic kernels compiled for a TPU v5e by libtpu. Under a
mesh: tests/test_attention.py; a whole model: tests/test_speedrun20_model.py; flash's Triton kernels
compiled for an H100: tests/test_gpu.py."""

import math
import types
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from helpers.attention import forward_and_grads, window_inputs
from jax._src import config as jax_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from archs import window_attention
from archs.window_attention import (
    masked_attention,
    window_flash_attention,
    window_mask,
    window_splash_attention,
)
from compute import accelerators, sharding
from configurator import UsageError


def assert_the_masked_kernel(kernel, window):
    """kernel(q, k, v, docs, window): its output and three gradients against masked_attention over
    window_mask, fp32, on window_inputs."""
    q, k, v, g, docs = window_inputs()
    pos = jnp.arange(q.shape[1])
    mask = window_mask(pos, pos, docs, docs, window)
    with jax.default_matmul_precision("highest"):
        want = forward_and_grads(lambda *a: masked_attention(*a, mask, 0.12), q, k, v, g)
        got = forward_and_grads(lambda *a: kernel(*a, docs, jnp.int32(window)), q, k, v, g)
    for name, a, b in zip(("y", "dq", "dk", "dv"), got, want):
        assert_close(a, b, atol=2e-6 * np.abs(b).max(), what=name)


@pytest.mark.parametrize(
    "tile, band, window",
    [
        (128, 8, 0),
        (256, 8, 3),
        (512, 3, 2),
        # make test-slow (CI runs it): the window past a tile of 4 blocks, and at the band's end
        pytest.param(512, 8, 5, marks=pytest.mark.slow),
        pytest.param(256, 8, 8, marks=pytest.mark.slow),
    ],
)
def test_window_splash_is_the_masked_kernel(tile, band, window):
    """With tiles of 1, 2 and 4 blocks: the window's edge inside a tile and at its border."""
    assert_the_masked_kernel(
        lambda q, k, v, docs, w: window_splash_attention(q, k, v, docs, w, band, 0.12, tile), window
    )


@pytest.mark.parametrize(
    "tiles, window",
    [(((128, 64), (64, 64)), 0), (((128, 128), (32, 64)), 3), (((64, 32), (128, 128)), 8)],
)
def test_window_flash_is_the_masked_kernel(tiles, window):
    """With forward and backward tiles of 32 to 128 positions: each kernel's loops span the
    window."""
    assert_the_masked_kernel(
        lambda q, k, v, docs, w: window_flash_attention(q, k, v, docs, w, 0.12, tiles), window
    )


def visited(tables, transposed):
    """{(query tile, kv tile)} the kernel computes, from its block tables (dkv's: transposed)."""
    on, tile = np.asarray(tables.block_mask[0]), np.asarray(tables.data_next[0])
    if transposed:
        return {(int(tile[g, j]), j) for g, j in zip(*np.nonzero(on))}
    return {(i, int(tile[i, g])) for i, g in zip(*np.nonzero(on))}


@pytest.mark.parametrize("tile, band", [(256, 7), (512, 14), (128, 3)])
def test_the_tables_visit_exactly_the_tiles_the_window_meets(tile, band):
    """For every window up to the band, the forward's and dkv's tables name each (query, kv) tile
    pair where the causal window allows some key (documents aside: segment ids mask inside), and no
    other; a skipped entry fetches the tile its neighbour fetches, so it copies nothing."""
    T = 2048
    n_tiles = T // tile
    pos, one_doc = jnp.arange(T), jnp.zeros(T, jnp.int32)
    for window in range(1, band + 1):
        mask = np.asarray(window_mask(pos, pos, one_doc, one_doc, window))
        met = mask.reshape(n_tiles, tile, n_tiles, tile).any(axis=(1, 3))
        expected = set(zip(*map(lambda a: a.tolist(), np.nonzero(met))))
        forward, dq, dkv = window_attention._window_tables(T, tile, band, jnp.int32(window), None)
        jax.tree.map(np.testing.assert_array_equal, dq, forward)  # dq visits as the forward
        for tables, transposed in ((forward, False), (dkv, True)):
            assert visited(tables, transposed) == expected, (window, transposed)
            on, tiles = np.asarray(tables.block_mask[0]), np.asarray(tables.data_next[0])
            for row_on, row_tiles in zip(*((on.T, tiles.T) if transposed else (on, tiles))):
                fetched = [t for n, t in enumerate(row_tiles) if n == 0 or t != row_tiles[n - 1]]
                assert fetched == row_tiles[row_on == 1].tolist(), (window, transposed)


def test_each_setting_gets_its_kernel():
    """'auto' takes splash on a TPU whose compiler takes the dtype, XLA elsewhere (masked up to the
    band's blocks, banded beyond); 'splash' runs wherever the shapes allow (interpret mode off a
    TPU), refused in bf16 on a TPU v3 in one line; 'flash' off a TPU (interpret mode off a GPU),
    refused on a TPU and, on a GPU, for a head size Triton cannot tile."""

    def pick(setting, platform="tpu", dtype="bfloat16", T=65536, kind="TPU v5 lite"):
        return window_attention.record20_kernel(
            setting, platform=platform, dtype=dtype, seq_len=T, head_size=128, band=14,
            device_kind=kind,
        )  # fmt: skip

    assert pick("auto") == pick("splash") == pick("splash", platform="cpu") == "splash"
    assert pick("auto", platform="gpu") == pick("xla") == "banded"
    assert pick("auto", platform="cpu", T=1792) == pick("xla", T=256) == "masked"
    assert pick("auto", kind="TPU v3") == "banded"
    assert pick("auto", kind="TPU v3", dtype="float32") == "splash"
    assert pick("flash", platform="gpu") == pick("flash", platform="cpu") == "flash"
    assert pick("flash", platform="gpu", T=200) == "masked"  # a prompt of 200 tokens
    refusals = [
        (lambda: pick("splash", kind="TPU v3"), "^attention='splash' cannot run here: TPU v3's"),
        (lambda: pick("flash"), "^attention='flash' cannot run here: it is a GPU kernel"),
        (
            lambda: window_attention.record20_kernel(
                "flash", platform="gpu", dtype="bfloat16", seq_len=256, head_size=96, band=14
            ),
            r"^attention='flash' cannot run here: its head size \(n_embd / n_head\) must be a "
            "power of 2 >= 16, got 96",
        ),
    ]
    for refused, says in refusals:
        with pytest.raises(ValueError, match=says) as e:
            refused()
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_run_that_cannot_take_its_setting_stops_in_one_line():
    """The check train.py and bench/train.py make before anything is written (models.check_run:
    record 20's window_attention.check_run, the other archs' attention.check_run), on a TPU's kind:
    'flash' is a GPU kernel; 'splash' in bf16 on a TPU v3 is refused by its compiler. On an H100's
    kind flash runs for record 20 only."""
    from archs.models import check_run
    from model import GPTConfig

    config = GPTConfig(arch="speedrun20", bias=False, n_embd=256, n_head=2, block_size=1024)
    v5e = accelerators.topology_devices("v5e:2x2")[0]
    check_run(config, v5e)  # 'auto': splash
    with pytest.raises(UsageError, match="^attention='flash' cannot run here: it is a GPU kernel"):
        check_run(replace(config, attention="flash"), v5e)
    v3 = accelerators.topology_devices("v3:2x2")[0]
    with pytest.raises(UsageError, match="^attention='splash' cannot run here: TPU v3's kernel"):
        check_run(replace(config, attention="splash", dtype="bfloat16"), v3)
    h100 = types.SimpleNamespace(
        platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0"
    )
    check_run(replace(config, attention="flash", dtype="bfloat16"), h100)
    with pytest.raises(UsageError, match="^attention='flash' cannot run here: it is record 20's"):
        check_run(GPTConfig(attention="flash", dtype="bfloat16"), h100)


@pytest.mark.slow
def test_window_splash_compiles_for_tpu():
    """Forward and backward for a v5e 2x2 slice as fsdp 2 x tensor 2, the window an argument: the
    Mosaic kernels (forward, dq, dkv), each device on its row and 2 heads."""
    mesh = sharding.make_mesh(
        fsdp=2, tensor_parallel=2, devices=accelerators.topology_devices("v5e:2x2")
    )

    def loss(q, k, v, docs, window):
        y = window_splash_attention(q, k, v, docs, window, 14, 0.12)
        return jnp.sum(y.astype(jnp.float32))

    # kept out of JAX's persistent compilation cache, which cannot load a compile-only client's
    # executables back
    with jax.set_mesh(mesh), jax_config.persistent_cache_min_compile_time_secs(math.inf):
        rows = P(sharding.BATCH, None, "tensor")
        x = jax.ShapeDtypeStruct(
            (2, 4096, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, rows)
        )
        docs = jax.ShapeDtypeStruct(
            (2, 4096), jnp.int32, sharding=NamedSharding(mesh, P(sharding.BATCH, None))
        )
        window = jax.ShapeDtypeStruct((), jnp.int32)
        grad = jax.jit(jax.grad(loss, (0, 1, 2)))
        hlo = grad.lower(x, x, x, docs, window).compile().as_text()
    for kernel in ("fwd", "dq", "dkv"):  # each on (2 heads, 4096, 128): one row, its device's heads
        name = f"%splash_mha_{kernel}_segmented"
        (call,) = [line for line in hlo.splitlines() if line.strip().startswith(name)]
        assert "tpu_custom_call" in call and "bf16[2,4096,128]" in call
