"""python -m pytest tests/test_attention.py -q

compute/attention.py: the splash kernel (Pallas interpret mode on this CPU) against XLA's attention,
forward and gradients (fp32); which kernel each setting, platform and shape gets, and the one-line
errors; splash under a mesh on 8 fake CPU devices, each on its own rows and heads; and splash
compiled for a TPU (v5e 2x2, fsdp 2 x tensor 2) from this CPU by libtpu's ahead-of-time compiler.
Record 20's splash and flash (tests/test_window_attention.py) under the same mesh."""

import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, equations, fake_devices, tiny_config
from helpers.attention import causal_forward_and_grads, window_inputs
from helpers.attention import forward_and_grads as window_grads
from jax._src import config as jax_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from archs.window_attention import window_flash_attention, window_splash_attention
from compute import accelerators, attention, sharding
from compute.attention import causal_attention, check_setting, choose

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qkv_and_cotangent(B, T, nh, hs, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((B, T, nh, hs)), jnp.float32) for _ in range(4)]


@pytest.mark.parametrize("B, T", [(2, 384), (1, 1024)])
def test_splash_matches_xla(B, T):
    """fp32: T = 384 runs 128-tiles (3 x 3, the upper ones skipped), T = 1024 512-tiles. Measured:
    max abs diff <= 1.4e-6 of the reference's largest value, forward and every gradient."""
    q, k, v, g = qkv_and_cotangent(B, T, 2, 64)
    splash, xla = (
        causal_forward_and_grads("splash", q, k, v, g),
        causal_forward_and_grads("xla", q, k, v, g),
    )
    for name, a, b in zip(("y", "dq", "dk", "dv"), splash, xla):
        assert a.dtype == b.dtype == jnp.float32
        assert_close(a, b, atol=1e-5 * np.abs(b).max(), what=name)


def test_choose_and_check_setting():
    """'auto' takes splash on a TPU where the shapes allow, cudnn on an Ampere+ GPU in bf16, xla
    elsewhere; explicit settings that can never run are one-line ValueErrors naming the reason and
    the fix."""

    def pick(
        setting,
        platform="tpu",
        T=1024,
        hs=64,
        dtype="bfloat16",
        capability=None,
        device_kind="TPU v5 lite",
    ):
        return choose(
            setting,
            platform=platform,
            dtype=dtype,
            seq_len=T,
            head_size=hs,
            capability=capability,
            device_kind=device_kind,
        )

    assert (
        pick("auto") == "splash"
        and pick("auto", T=128) == "splash"
        and pick("auto", dtype="float32") == "splash"
    )
    assert pick("auto", T=32) == "xla" and pick("auto", T=1) == "xla"  # short sequences, decoding
    assert pick("auto", hs=attention.SPLASH_MAX_HEAD_SIZE * 2) == "xla"
    # the largest head size it takes
    assert pick("auto", hs=attention.SPLASH_MAX_HEAD_SIZE) == "splash"
    assert pick("auto", platform="cpu") == "xla" and pick("xla") == "xla"
    assert pick("auto", platform="gpu", capability=(9, 0)) == "cudnn"
    assert pick("auto", platform="gpu", capability=(9, 0), dtype="float32") == "xla"
    assert pick("splash", platform="cpu", T=256) == "splash"  # interpret mode: the tests' route
    # a call shape the kernel cannot take (check_setting holds block_size)
    assert pick("splash", T=100) == "xla"
    # TPU v2 and v3 compile splash in float32 only (tests/test_tpu.py: their compiler's refusal)
    for kind in ("TPU v2", "TPU v3"):
        assert (
            pick("auto", device_kind=kind) == "xla"
            and pick("auto", device_kind=kind, dtype="float32") == "splash"
        )
    assert (
        pick("auto", device_kind="TPU7x") == "splash"
        and pick("auto", device_kind="TPU v4") == "splash"
    )
    assert attention.cuda_capability(jax.devices()[0]) is None
    for platform, capability, want in [
        ("gpu", "9.0", (9, 0)),
        ("cuda", "12.1", (12, 1)),
        ("gpu", "gfx90a", None),
        # NVIDIA's; ROCm's names its chip; no TPU has one
        ("tpu", "9.0", None),
    ]:
        device = types.SimpleNamespace(platform=platform, compute_capability=capability)
        assert attention.cuda_capability(device) == want, (platform, capability)

    ok = dict(platform="tpu", dtype="bfloat16", head_size=64, block_size=1024, dropout=0.0)
    for setting in ("auto", "xla", "splash"):
        check_setting(setting, **ok)
    check_setting("splash", **{**ok, "platform": "cpu"})
    # training takes the explicit path for attention dropout
    check_setting("auto", **{**ok, "dropout": 0.1})
    check_setting("cudnn", **{**ok, "platform": "gpu"}, capability=(8, 0))

    fix = "; use attention='auto' or 'xla'$"
    bad = [
        (
            lambda: check_setting("flash2", **ok),
            "^attention must be one of 'auto', 'xla', 'cudnn', 'splash', 'flash', got 'flash2'$",
        ),
        (lambda: pick("flash2"), "^attention must be one of .* got 'flash2'$"),
        (
            lambda: check_setting("flash", **ok),
            r"^attention='flash' cannot run here: it is record 20's windowed kernel "
            r"\(arch='speedrun20'\); use attention='auto', 'xla', 'cudnn' or 'splash'$",
        ),
        (
            lambda: check_setting("splash", **{**ok, "dropout": 0.1}),
            "^attention='splash' cannot run here: the kernel has no attention dropout, dropout is "
            "0.1; use dropout=0.0, ",
        ),
        (
            lambda: check_setting("splash", **{**ok, "block_size": 1000}),
            "^attention='splash' cannot run here: block_size must be a multiple of 128, got 1000"
            + fix,
        ),
        (
            lambda: check_setting("splash", **{**ok, "head_size": 512}),
            r"^attention='splash' cannot run here: the head size \(n_embd / n_head\) must be <= "
            r"256, got 512" + fix,
        ),
        (
            lambda: check_setting("cudnn", **ok),
            "^attention='cudnn' cannot run here: it runs on NVIDIA GPUs only" + fix,
        ),
        (
            lambda: check_setting("splash", **ok, device_kind="TPU v3"),
            "^attention='splash' cannot run here: TPU v3's kernel compiler takes it in float32 "
            "only, dtype is 'bfloat16'; use attention='auto' or 'xla', or dtype='float32'$",
        ),
        (
            lambda: pick("splash", T=32, device_kind="TPU v2"),
            "TPU v2's kernel compiler takes it in float32 only",
        ),
        (
            lambda: pick("cudnn", platform="gpu", capability=(8, 0), hs=160),
            "must be a multiple of 8 and <= 128",
        ),
        (
            lambda: pick("cudnn", platform="gpu", capability=(9, 0), dtype="float32"),
            "^attention='cudnn' cannot run here: it computes in bfloat16 only, dtype is 'float32'"
            + fix,
        ),
        # a run's config on this process's device (train.py's check before anything is written): its
        # head size
        (
            lambda: attention.check_run(
                tiny_config(attention="splash", block_size=128, n_embd=1024), jax.devices()[0]
            ),
            r"^attention='splash' cannot run here: the head size \(n_embd / n_head\) must be <= "
            r"256, got 512" + fix,
        ),
        # ... and on a TPU v3 compiled for here: its platform and kind reach the check
        (
            lambda: attention.check_run(
                tiny_config(attention="splash", block_size=128, dtype="bfloat16"),
                accelerators.topology_devices("v3:2x2")[0],
            ),
            "^attention='splash' cannot run here: TPU v3's kernel compiler takes it in float32 "
            "only",
        ),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_splash_tiles_are_the_largest_that_divide_the_sequence():
    """512 where T allows, else 256, else 128, in every one of the kernel's forward and backward
    block sizes (the kernel's own default is 128 throughout)."""
    tiles = [attention.splash_tile(T) for T in (1024, 1536, 768, 384, 128)]
    assert tiles == [512, 512, 256, 128, 128]
    sizes = attention._kernel(1024, 2, interpret=True).kwargs["block_sizes"]
    fields = (
        "block_q",
        "block_kv",
        "block_kv_compute",
        "block_q_dkv",
        "block_kv_dkv",
        "block_kv_dkv_compute",
        "block_q_dq",
        "block_kv_dq",
    )
    assert {name: getattr(sizes, name) for name in fields} == dict.fromkeys(fields, 512)


def test_splash_in_bf16_gives_the_kernel_bf16():
    """bf16 q, k, v reach the kernel as bf16 (the 1/sqrt(hs) scale is applied in q's dtype: a
    strongly typed float32 one would make it a float32 kernel), and it computes what XLA's attention
    does, to bf16's rounding."""
    q, k, v = (a.astype(jnp.bfloat16) for a in qkv_and_cotangent(1, 128, 8, 16)[:3])
    jaxpr = jax.make_jaxpr(lambda *a: causal_attention(*a, "splash"))(q, k, v).jaxpr
    (call,) = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
    assert [
        str(x.aval.dtype) for x in call.invars if jnp.issubdtype(x.aval.dtype, jnp.floating)
    ] == ["bfloat16"] * 3
    y, want = causal_attention(q, k, v, "splash"), causal_attention(q, k, v, "xla")
    assert y.dtype == jnp.bfloat16
    assert_close(
        y.astype(jnp.float32), want.astype(jnp.float32), atol=2**-6 * float(jnp.abs(want).max())
    )


def test_explicit_attention_scores_and_softmax_in_float32():
    """The dropout path (the probabilities materialized) in bf16: scores and softmax in float32, the
    probabilities rounded to bf16 for the matmul with v, as autocast's. Scores up to ~190, where
    bf16's rounding (up to 0.5 there) would move the probabilities: against float64 on the same bf16
    inputs, measured 0.28% of the output's largest value, 3.6% with the scores in bf16."""
    rng = np.random.default_rng(0)
    B, T, nh, hs = 2, 64, 2, 16
    q, k, v = (
        jnp.asarray(rng.standard_normal((B, T, nh, hs)) * scale, jnp.bfloat16)
        for scale in (6, 6, 1)
    )
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(hs)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v64)
    y = attention.explicit_attention(q, k, v, 0.0, None)
    assert y.dtype == jnp.bfloat16
    assert_close(np.asarray(y, np.float64), want, atol=0.01 * np.abs(want).max())


def test_explicit_attention_drops_probabilities_at_its_rate():
    """Attention dropout acts on the probabilities: with v the identity (hs = T), the output is
    them. At rate 0.5, about half of the causal ones are zero and the rest are scaled by 1 / (1 -
    rate); another key, other ones."""
    B, T, nh = 2, 64, 2
    q, k = qkv_and_cotangent(B, T, nh, T)[:2]
    v = jnp.broadcast_to(jnp.eye(T)[None, :, None, :], (B, T, nh, T))  # v[b, j, h] = e_j
    probs = attention.explicit_attention(q, k, v, 0.0, None)
    dropped = attention.explicit_attention(q, k, v, 0.5, jax.random.key(0))
    causal = np.broadcast_to(np.tril(np.ones((T, T), bool))[None, :, None, :], probs.shape)
    zeroed = causal & (np.asarray(dropped) == 0)
    # 8,320 entries: the binomial's sd is 0.0055
    assert abs(zeroed.sum() / causal.sum() - 0.5) < 0.02
    kept = causal & ~zeroed
    assert_close(np.asarray(dropped)[kept], 2 * np.asarray(probs)[kept], rtol=1e-6)
    other = attention.explicit_attention(q, k, v, 0.5, jax.random.key(1))
    assert not np.array_equal(other, dropped)


# splash on 8 fake CPU devices, each mesh's outputs and gradients saved for the test to compare
MESH_RUNS = r"""
import sys
import jax
import numpy as np
from compute import attention
from compute import sharding
from helpers.attention import causal_forward_and_grads
inputs = dict(np.load(sys.argv[1]))
out = {}
for name, (fsdp, tp) in {"data2_fsdp2_tp2": (2, 2), "fsdp8": (8, 1)}.items():
    with jax.set_mesh(sharding.make_mesh(fsdp=fsdp, tensor_parallel=tp)):
        jaxpr = str(jax.make_jaxpr(attention.causal_attention, static_argnums=3)(
            inputs["q"], inputs["k"], inputs["v"], "splash"))
        assert "shard_map" in jaxpr, jaxpr
        for key, a in zip(("y", "dq", "dk", "dv"), causal_forward_and_grads("splash", *(inputs[n] for n in "qkvg"))):
            out[f"{name} {key}"] = np.asarray(a)
# record 20's splash (archs/window_attention.py): each device on its row and head
from helpers.attention import forward_and_grads as window_grads, window_inputs
from archs.window_attention import window_flash_attention, window_splash_attention
q, k, v, g, docs = window_inputs(B=4, T=512)
kernels = {
    "splash": lambda *a: window_splash_attention(*a, docs, jax.numpy.int32(2), 3, 0.12, 128),
    "flash": lambda *a: window_flash_attention(*a, docs, jax.numpy.int32(2), 0.12),
}
with jax.set_mesh(sharding.make_mesh(fsdp=2, tensor_parallel=2)):
    for name, kernel in kernels.items():
        assert "shard_map" in str(jax.make_jaxpr(kernel)(q, k, v))
        for key, a in zip(("y", "dq", "dk", "dv"), window_grads(kernel, q, k, v, g)):
            out[f"{name} {key}"] = np.asarray(a)
np.savez(sys.argv[2], **out)
"""  # noqa: E501


@pytest.mark.slow
def test_splash_under_a_mesh(tmp_path):
    """data 2 x fsdp 2 x tensor 2: each device runs the kernel on 1 row and 2 heads (shard_map);
    fsdp 8 does not divide the 4 rows, so every device runs all of them. Both as splash and xla on
    one device. Record 20's splash and flash on data 2 x fsdp 2 x tensor 2 (1 row and 1 head a
    device, its documents and window beside them) as on one device."""
    q, k, v, g = qkv_and_cotangent(4, 256, 4, 64, seed=1)
    np.savez(tmp_path / "in.npz", q=q, k=k, v=v, g=g)
    env = {**fake_devices(8), "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    p = subprocess.run(
        [sys.executable, "-c", MESH_RUNS, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    one, xla = (
        causal_forward_and_grads("splash", q, k, v, g),
        causal_forward_and_grads("xla", q, k, v, g),
    )
    for mesh in ("data2_fsdp2_tp2", "fsdp8"):
        for key, a, b in zip(("y", "dq", "dk", "dv"), one, xla):
            assert_close(
                out[f"{mesh} {key}"],
                a,
                atol=1e-6 * np.abs(a).max(),
                what=f"{mesh} {key} vs one device",
            )
            assert_close(
                out[f"{mesh} {key}"], b, atol=1e-5 * np.abs(b).max(), what=f"{mesh} {key} vs xla"
            )
    q, k, v, g, docs = window_inputs(B=4, T=512)
    for name, kernel in {
        "splash": lambda *a: window_splash_attention(*a, docs, jnp.int32(2), 3, 0.12, 128),
        "flash": lambda *a: window_flash_attention(*a, docs, jnp.int32(2), 0.12),
    }.items():
        for key, a in zip(("y", "dq", "dk", "dv"), window_grads(kernel, q, k, v, g)):
            what = f"{name} {key}"
            assert_close(out[what], a, atol=1e-6 * np.abs(a).max(), what=what)


@pytest.mark.slow
def test_splash_compiles_for_tpu():
    """Forward and backward for a v5e 2x2 slice as fsdp 2 x tensor 2, from abstract inputs: the
    Mosaic kernels (tpu_custom_call, not interpret mode), each on its device's 2 rows and 2
    heads."""
    mesh = sharding.make_mesh(
        fsdp=2, tensor_parallel=2, devices=accelerators.topology_devices("v5e:2x2")
    )

    def loss(q, k, v):
        return jnp.sum(causal_attention(q, k, v, "splash").astype(jnp.float32))

    # kept out of JAX's persistent compilation cache, which cannot load a compile-only client's
    # executables back
    with jax.set_mesh(mesh), jax_config.persistent_cache_min_compile_time_secs(math.inf):
        x = jax.ShapeDtypeStruct(
            (4, 256, 4, 64),
            jnp.bfloat16,
            sharding=NamedSharding(mesh, P(sharding.BATCH, None, "tensor")),
        )
        hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile().as_text()
    assert "tpu_custom_call" in hlo and "bf16[2,2,256,64]" in hlo


def test_the_model_with_splash_computes_what_it_computes_with_xla():
    """A whole model (2 layers, T 128), fp32: logits and loss within 1e-5 relative, gradients within
    1e-5 of each tensor's largest (parity.check_train holds ours to torch's within 1e-4 on the grad
    norm). Jitted, as training runs it (one compilation, not one per operation)."""
    from flax import nnx
    from helpers import tiny_config

    from model import GPT

    idx = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 128)), jnp.int32)

    @nnx.jit
    def logits_loss_grads(model):
        logits, loss = model(idx, idx)
        return logits, loss, nnx.grad(lambda m: m.loss(idx, idx))(model)

    out = {}
    for setting in ("splash", "xla"):
        logits, loss, grads = logits_loss_grads(
            GPT(tiny_config(block_size=128, attention=setting), nnx.Rngs(0))
        )
        out[setting] = logits, loss, jax.tree.leaves(nnx.to_pure_dict(grads))
    (ls, loss_s, gs), (lx, loss_x, gx) = out["splash"], out["xla"]
    assert_close(ls, lx, atol=1e-5 * float(jnp.max(jnp.abs(lx))), what="logits")
    assert abs(float(loss_s) / float(loss_x) - 1) < 1e-5
    for a, b in zip(gs, gx):
        assert_close(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))), what="gradient")
