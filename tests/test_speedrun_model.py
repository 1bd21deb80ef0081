"""python -m pytest tests/test_speedrun_model.py -q

arch='speedrun' (modded-nanogpt's record 5) against the torch reference written from the record
(parity/speedrun_reference.py): rotary with bfloat16 tables, QK-norm and RMSNorm's eps, ReLU^2, the
inits, whole-model logits and loss through dataio/weights.py's state_step*.pt mapping both ways,
scan_layers, remat and loss_chunk, KV-cache generation, bf16 against the record's autocast, every
attention kernel, and a bad config, one line (the record's files: test_speedrun_files.py)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from helpers import assert_close, rel_diff, tiny_config
from helpers.record5 import (
    RECORD,
    highest_precision,  # noqa: F401 (autouse: fp32 matmuls as written, on both sides)
    ours_of,
    random_record,
    record_logits,
    tokens,
)

from archs.models import build, check_config, model_from
from compute import attention, sharding
from compute.layers import rms_norm, rotary, rotary_tables
from dataio.pretrained import to_modded_state
from dataio.weights import state_dict
from parity import speedrun_reference as record
from parity.check_generate import CACHE_LOGITS_TOL
from parity.check_logits import FP32_LOSS_TOL, FP32_MAX_REL_TOL

SPEEDRUN = dict(arch="speedrun", bias=False)
# --- the pieces
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize("hs", [32, 128])
def test_rotary_tables_are_the_records_bf16_ones_at_every_position(hs):
    """Bit for bit over the record's 1024 positions (head size 128 is the record's), and so under
    jit: the tables are constants of the program, no device cos or sin."""
    T = 1024
    want = [t[0, :, 0].float().numpy() for t in record.Rotary(hs)(torch.zeros(1, T, 1, hs))]
    for table, expected in zip(rotary_tables(T, hs), want):
        assert table.dtype == jnp.bfloat16
        np.testing.assert_array_equal(table.astype(np.float32), expected)
    ones = jnp.concatenate([jnp.ones((1, T, 1, hs // 2)), jnp.zeros((1, T, 1, hs // 2))], axis=-1)
    y = jax.jit(lambda x: rotary(x, *rotary_tables(T, hs)))(ones)  # x1 = 1, x2 = 0 -> (cos, -sin)
    np.testing.assert_array_equal(y[0, :, 0], np.concatenate([want[0], -want[1]], axis=-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotary_rotates_as_the_record(dtype):
    x = torch.randn(2, 16, 2, 32, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, dtype)
    )
    want = record.apply_rotary_emb(x, *record.Rotary(32)(x)).float().numpy()
    got = rotary(jnp.asarray(x.float().numpy(), dtype), *rotary_tables(16, 32))
    assert got.dtype == jnp.dtype(dtype)
    # float32: the same products and sums (an FMA may round once less); bfloat16: at most one
    # rounding apart
    if dtype == "float32":
        assert_close(got, want, atol=2e-6, what="rotary float32")
    else:
        assert_close(np.asarray(got, np.float32), want, rtol=2**-7, what="rotary bfloat16")


def test_rms_norm_is_torchs_with_its_eps():
    """float32 and bfloat16 inputs as F.rms_norm (eps: float32's machine epsilon, 1.19e-7, for
    both); on inputs of 1e-4 the eps is most of the mean square (1e-8): the output is a quarter of
    what it would be without it."""
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-4):
        x = scale * torch.randn(3, 5, 64, generator=g)
        want = F.rms_norm(x, (64,)).numpy()
        got = rms_norm(jnp.asarray(x.numpy()))
        assert_close(got, want, rtol=1e-6, atol=0, what=f"rms_norm at scale {scale}")
        without_eps = x.numpy() / np.sqrt(np.mean(x.numpy() ** 2, axis=-1, keepdims=True))
        assert rel_diff(got, without_eps) > 0.5 if scale < 1 else rel_diff(got, without_eps) < 1e-6
    x = torch.randn(3, 5, 64, generator=g).bfloat16()
    got = rms_norm(jnp.asarray(x.float().numpy(), jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), F.rms_norm(x, (64,)).float().numpy())


def test_q_k_v_after_rotary_and_qk_norm_and_the_relu2_mlp_equal_the_records():
    ref, T = random_record(seed=1), 16
    model = ours_of(ref)
    x = torch.randn(2, T, 64, generator=torch.Generator().manual_seed(2))
    attn, mlp = ref.transformer.h[1].attn, ref.transformer.h[1].mlp
    with torch.no_grad():
        q, k, v = (f(x).view(2, T, 2, 32) for f in (attn.c_q, attn.c_k, attn.c_v))
        cos, sin = attn.rotary(q)
        q, k = (F.rms_norm(record.apply_rotary_emb(a, cos, sin), (32,)) for a in (q, k))
        want_mlp = mlp(x).numpy()
    for name, got, want in zip("qkv", model.h[1].attn.qkv(jnp.asarray(x.numpy())), (q, k, v)):
        assert_close(got, want.numpy(), atol=2e-6, what=name)
    assert_close(
        model.h[1].mlp(jnp.asarray(x.numpy())), want_mlp, atol=2e-6, rtol=1e-5, what="ReLU^2 MLP"
    )


def test_init_is_the_records():
    """Zero residual projections (@Grad62304977's zero init); every other matrix and the tied
    embedding U(-1/sqrt(C), 1/sqrt(C)), torch nn.Linear's default (the embedding is the record's
    lm_head Linear); no wpe, LayerNorm or bias params at all."""
    model = build(tiny_config(**SPEEDRUN), nnx.Rngs(0))
    params = {
        jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    assert sorted(params) == sorted(
        f"h.{i}.{name}"
        for i in range(2)
        for name in (
            "attn.c_attn.kernel",
            "attn.c_proj.kernel",
            "mlp.c_fc.kernel",
            "mlp.c_proj.kernel",
        )
    ) + ["wte.embedding"]
    bound = 1 / math.sqrt(64)
    for path, value in params.items():
        if path.endswith("c_proj.kernel"):
            assert not value.any(), path
        else:  # uniform on (-bound, bound): its extremes near the bound, its std bound / sqrt(3)
            assert 0.97 * bound < np.abs(value).max() <= bound, path
            assert (
                abs(value.std() / (bound / math.sqrt(3)) - 1) < 0.05
                and abs(value.mean()) < 0.01 * bound
            ), path
    # every param has its row in sharding's table: none is left whole on every device by accident
    assert all(
        any(re.search(pattern, path) for pattern, _ in sharding.PARAM_SPECS) for path in params
    )
    assert model.num_params() == sum(v.size for v in params.values())  # no wpe to leave out


# --- the whole model
# ----------------------------------------------------------------------------------


def test_logits_and_loss_equal_the_records_on_its_weights():
    ref = random_record(seed=3)
    model = ours_of(ref)
    x, y = tokens(seed=4), tokens(seed=5)
    y[0, :3] = -1  # ignored, as the record's ignore_index
    want_logits, want_loss = record_logits(ref, x, y)
    logits, loss = model(jnp.asarray(x), jnp.asarray(y))
    assert rel_diff(logits, want_logits) < FP32_MAX_REL_TOL
    assert abs(float(loss) - want_loss) < FP32_LOSS_TOL
    assert abs(float(model.loss(jnp.asarray(x), jnp.asarray(y))) - want_loss) < FP32_LOSS_TOL


def test_our_weights_load_strictly_into_the_record_with_the_same_logits():
    # through one mapping; a fresh random model back through the other:
    model = ours_of(random_record(seed=6))
    fresh = model_from(
        model.config,
        {
            k: np.random.default_rng(7).normal(0, 0.1, v.shape).astype(np.float32)
            for k, v in state_dict(model).items()
        },
    )
    ref = record.GPT(record.GPTConfig(**RECORD))
    # strict
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in to_modded_state(fresh).items()})
    x = tokens(seed=8)
    assert rel_diff(fresh(jnp.asarray(x))[0], record_logits(ref, x)[0]) < FP32_MAX_REL_TOL


@pytest.mark.parametrize(
    "settings",
    [
        dict(scan_layers=True),
        dict(scan_layers=True, remat="dots", loss_chunk=8),
        dict(remat="block", loss_chunk=12),
    ],
    ids=["scan", "scan-dots-chunks", "block-chunks"],
)
def test_scan_layers_remat_and_loss_chunk_compute_the_same_loss_and_grads(settings):
    ref = random_record(seed=9)
    plain, other = ours_of(ref), ours_of(ref, **settings)
    x, y = jnp.asarray(tokens(seed=10)), jnp.asarray(tokens(seed=11))

    def loss_and_grads(model):
        graphdef, params = nnx.split(model)
        loss, grads = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(x, y)))(
            params
        )
        return float(loss), state_dict(nnx.merge(graphdef, grads))

    (loss, grads), (loss2, grads2) = loss_and_grads(plain), loss_and_grads(other)
    assert abs(loss - loss2) < 1e-6
    for k, g in grads.items():
        assert_close(grads2[k], g, atol=1e-6 * np.abs(g).max(), what=k)
    if settings.get("scan_layers"):
        assert rel_diff(other(x)[0], plain(x)[0]) < FP32_MAX_REL_TOL


@pytest.mark.parametrize("scan_layers", [False, True])
def test_kv_cache_generation_equals_the_full_forward(scan_layers):
    """Greedy tokens and every step's logits with the cache (keys rotated at their absolute
    positions) equal the full forward's, within block_size and past it (the window slides: the full
    forward then serves). block_size 40, not the head size 32: the cache's rotary tables are as long
    as the cache."""
    model = ours_of(random_record(seed=12), scan_layers=scan_layers, block_size=40)
    prompt = tokens(batch=2, T=5, seed=13)
    cached, cached_logits = model.generate(prompt, 40, temperature=0, return_logits=True)
    full, full_logits = model.generate(
        prompt, 40, temperature=0, return_logits=True, use_cache=False
    )
    np.testing.assert_array_equal(cached, full)
    assert len(set(cached[:, 5:].ravel().tolist())) >= 5  # it decided something
    assert rel_diff(cached_logits, full_logits) < CACHE_LOGITS_TOL
    # and the first step's are the record's last position's
    assert (
        rel_diff(cached_logits[:, 0], record_logits(random_record(seed=12), prompt)[0][:, -1])
        < FP32_MAX_REL_TOL
    )


def test_bfloat16_is_as_close_to_float32_as_the_records_autocast():
    """In bf16 the matmuls, rotary (bf16 tables on bf16 q, k) and the MLP compute in bf16, the
    residual stream and the norms' sums in float32, as the record under autocast: our bf16 logits
    are about as far from the float32 ones as torch's autocast logits are (CPU autocast here; the
    record's is CUDA's)."""
    ref = random_record(seed=19)
    x = tokens(seed=20)
    want = record_logits(ref, x)[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = ref(torch.from_numpy(np.asarray(x, np.int64)))[0].float().numpy()
    ours = ours_of(ref, dtype="bfloat16")(jnp.asarray(x))[0]
    assert 0 < rel_diff(ours, want) < 2 * rel_diff(theirs, want), (
        rel_diff(ours, want),
        rel_diff(theirs, want),
    )


@pytest.mark.parametrize("kernel", ["splash", "explicit"])
def test_every_attention_kernel_takes_the_rotated_normed_q_and_k(kernel, monkeypatch):
    """Rotary and QK-norm happen before the kernel: splash (Pallas interpret mode off a TPU; T a
    multiple of 128) and the explicit attention that attention dropout takes compute xla's
    logits."""
    ref = random_record(seed=21)
    x = jnp.asarray(tokens(batch=1, T=128, seed=22))
    want = ours_of(ref, block_size=128, attention="xla")(x)[0]
    if kernel == "explicit":  # what a dropout > 0 run takes, here with its rate 0
        monkeypatch.setattr(
            attention,
            "causal_attention",
            lambda q, k, v, _: attention.explicit_attention(q, k, v, 0.0, None),
        )
    got = ours_of(ref, block_size=128, attention="splash" if kernel == "splash" else "xla")(x)[0]
    assert rel_diff(got, want) < FP32_MAX_REL_TOL


# --- bad input
# ---------------------------------------------------------------------------------------


def test_bad_configs_are_one_line():
    for kw, message in [
        (dict(arch="llama"), "arch must be 'gpt2', 'speedrun', 'speedrun20' or 'nanochat'"),
        (dict(arch="speedrun", bias=True), "set bias=False"),
        (dict(arch="speedrun", bias=False, n_head=64), "head size n_embd / n_head must be even"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            check_config(tiny_config(**kw))  # GPTConfig's checks, then record 5's
        assert "\n" not in str(e.value)
