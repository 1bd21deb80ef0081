"""python -m pytest tests/test_speedrun20_parity.py -q

arch='speedrun20' against the torch reference written from modded-nanogpt's record 20
(parity/speedrun20_reference.py), all-fp32: the masks its attention takes (the record's
BlockMask, by the reference's dense reading of it), the rotary tables, and a whole model's logits,
loss and gradients at two windows, with its weights carried across by dataio/pretrained.py's
mapping; and its state_step*.pt both ways (export.py --format=modded, --init_from=)."""

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import rel_diff

from archs import window_attention
from archs.models import load_pretrained, model_from
from compute.layers import fp8_head, half_truncated_frequencies, half_truncated_rotary_tables
from configurator import UsageError
from dataio.pretrained import from_record20_state, read_pretrained, record20_config, save_modded
from dataio.weights import state_dict
from model import GPTConfig
from parity import speedrun20_reference as record
from parity.check_logits import FP32_MAX_REL_TOL

# 8 layers: the record's layer 7 without attention is among them; documents split at id 63, not
# GPT-2's 50256 (small_end_of_text): the same masks, a head of 128 rows instead of 50304
SHAPE = dict(vocab_size=64, num_layers=8, num_heads=2, model_dim=32)
T = 512  # 4 of the record's 128-token blocks


@pytest.fixture(autouse=True, scope="module")
def small_end_of_text():
    with pytest.MonkeyPatch.context() as m:
        m.setattr(window_attention, "EOT", 63)
        m.setattr(record, "EOT", 63)
        yield


@pytest.fixture(autouse=True)
def highest_precision():
    torch.set_float32_matmul_precision("highest")
    with jax.default_matmul_precision("highest"):
        yield


def tokens(seed=0, length=T, every=90):
    """Token ids with documents that start mid-block."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, window_attention.EOT, length)
    idx[rng.random(length) < 1 / every] = window_attention.EOT
    return idx


@pytest.fixture(scope="module")
def pair():
    """The reference with every param random (its zero head, projections and lambdas would hide a
    wrong mapping), all-fp32, and our model holding its weights."""
    torch.manual_seed(0)
    ref = record.GPT(**SHAPE, embed_dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5 if p.ndim < 2 else p.shape[-1] ** -0.5)
    state = from_record20_state(ref.state_dict())
    config = GPTConfig(**{**record20_config(state, SHAPE["num_heads"]), "block_size": T})
    return ref, model_from(config, state)


@pytest.mark.parametrize("window", [0, 1, 2, 3, 5])
def test_window_mask_is_the_records_block_mask(window):
    idx = tokens(every=150, length=1024)
    long, short = record.block_masks(torch.as_tensor(idx), window)
    docs, pos = window_attention.documents(jnp.asarray(idx)), jnp.arange(1024)
    for w, expected in ((window, long), (window // 2, short)):
        mask = window_attention.window_mask(pos, pos, docs, docs, w)
        np.testing.assert_array_equal(mask, expected)


def test_rotary_tables_are_the_records():
    """The frequencies as the record's formula in torch gives them, but for how its CPU linspace
    rounds (an ulp of a point moves (1/1024)^x by ln 1024 of its ulps), the tables within what
    that moves each angle, plus an ulp of the angle, which each side rounds to float32."""
    ref_freq = ((1 / 1024) ** torch.linspace(0, 1, steps=16, dtype=torch.float32)).numpy()
    freq = half_truncated_frequencies(64)
    one_linspace_ulp = (np.log(1024) + 1) * 2.0**-23  # relative
    assert np.all(np.abs(freq[:16] / ref_freq - 1) <= one_linspace_ulp) and not freq[16:].any()
    rotary = record.Rotary(64, max_seq_len=4096)
    cos, sin = half_truncated_rotary_tables(4096, 64)
    positions = np.arange(4096, dtype=np.float32)[:, None]
    # each side rounds its float32 angle once more: an ulp of the angle
    moved = positions * np.abs(freq - np.pad(ref_freq, (0, 16))) + np.spacing(positions * freq)
    moved += 2e-7
    assert np.all(np.abs(cos - rotary.cos.numpy()) <= moved)
    assert np.all(np.abs(sin - rotary.sin.numpy()) <= moved)


@nnx.jit
def loss_grads_logits(model, x, y, window):
    """Our loss, its gradient and the logits of one sequence (T,) at a long window of `window`
    blocks (traced: one compile for every window)."""

    def loss(model):
        logits, loss = model(x[None], y[None], window_blocks=window)
        return loss, logits[0]

    (value, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, grads, logits


@pytest.mark.parametrize("window", [2, 14])
def test_logits_loss_and_gradients_are_the_records(pair, window):
    """Long windows of 2 and 14 blocks (short 1 and 7): both masks cut, then neither does."""
    ref, ours = pair
    idx = tokens(seed=window)
    x, y = torch.as_tensor(idx[:-1].tolist() + [0]), torch.as_tensor(idx[1:].tolist() + [1])
    ref.zero_grad()
    loss = ref(x, y, window)
    loss.backward()
    with torch.no_grad():
        ref_logits = ref.logits(x, window).numpy()
    value, grads, logits = loss_grads_logits(
        ours, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()), jnp.int32(window)
    )
    assert rel_diff(logits, ref_logits) < FP32_MAX_REL_TOL
    assert abs(float(value) / loss.item() - 1) < 1e-6
    our_grads = state_dict(nnx.merge(nnx.graphdef(ours), grads))
    ref_grads = from_record20_state({n: p.grad for n, p in ref.named_parameters()})
    for name, g in ref_grads.items():
        assert rel_diff(our_grads[name], g) < 1e-4, name


@pytest.mark.slow
def test_a_state_step_file_both_ways(pair, tmp_path):
    """Our model saved as the record saves its state_step*.pt loads strictly into the record's GPT
    (its keys under _orig_mod.), which computes our logits; read back, it is our model again, its
    heads from the file's code."""
    _, ours = pair
    save_modded(ours, tmp_path / "state_step000003.pt", step=3)
    saved = torch.load(tmp_path / "state_step000003.pt", weights_only=True)
    ref = record.GPT(**SHAPE, embed_dtype=torch.float32)
    ref.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    idx = torch.as_tensor(tokens(seed=7))
    with torch.no_grad():
        ref_logits = ref.logits(idx, 2).numpy()
    logits, _ = ours(jnp.asarray(idx.numpy())[None], window_blocks=2)
    assert rel_diff(logits[0], ref_logits) < FP32_MAX_REL_TOL
    back, _ = load_pretrained(str(tmp_path / "state_step000003.pt"))
    assert back.config.arch == "speedrun20" and back.config.n_head == SHAPE["num_heads"]
    for name, value in state_dict(ours).items():
        np.testing.assert_array_equal(state_dict(back)[name], value, err_msg=name)
    with pytest.raises(UsageError, match="trained with num_heads=2 .*, not 4: set n_head=2$"):
        read_pretrained(str(tmp_path / "state_step000003.pt"), n_head=4)


def test_the_records_bf16_tables_both_ways(tmp_path):
    """The record's state_step*.pt holds its embedding tables in bf16: read with
    embed_dtype='bfloat16' they are ours bit for bit; saved back, the record's GPT (bf16 tables)
    loads them strictly, the same bits."""
    torch.manual_seed(1)
    theirs = record.GPT(**SHAPE)  # the record's dtypes
    state = from_record20_state(theirs.state_dict())
    config = GPTConfig(**record20_config(state, SHAPE["num_heads"]), embed_dtype="bfloat16")
    ours = model_from(replace(config, block_size=T), state)
    tables = {"embed.weight": ours.wte}
    tables.update({f"value_embeds.embed.{i}.weight": ve for i, ve in enumerate(ours.ve)})
    for name, table in tables.items():
        assert table.embedding.dtype == jnp.bfloat16 and theirs.get_parameter(name).dtype == (
            torch.bfloat16
        )
        np.testing.assert_array_equal(
            np.asarray(table.embedding[...], np.float32),
            theirs.get_parameter(name).detach().float(),
        )
    save_modded(ours, tmp_path / "state_step000001.pt", step=1)
    saved = torch.load(tmp_path / "state_step000001.pt", weights_only=True)
    back = record.GPT(**SHAPE)
    back.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})
    for name, p in back.named_parameters():
        assert torch.equal(p, theirs.get_parameter(name)), name


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_the_fp8_head_rounds_as_the_records(x_dtype):
    """layers.fp8_head against the record's lm_head_fp8 (torch._scaled_mm on a CPU): the logits and
    both gradients bit for bit, from bf16 activations (the record's) and float32 ones; the scales
    swapped would not pass."""
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.normal(size=(64, 32)), dtype=x_dtype, requires_grad=True)
    w = torch.tensor(rng.normal(size=(256, 32)) * 0.05, dtype=torch.float32, requires_grad=True)
    g = torch.tensor(rng.normal(size=(64, 256)) * 1e-5, dtype=torch.bfloat16)
    out = record.lm_head_fp8(x, w)
    out.backward(g)
    ours, vjp = jax.vjp(
        fp8_head,
        jnp.asarray(x.detach().float().numpy(), x_dtype_of(x)),
        jnp.asarray(w.detach().numpy()),
    )
    grad_x, grad_w = vjp(jnp.asarray(g.float().numpy(), jnp.bfloat16))
    for a, b in ((ours, out), (grad_x, x.grad), (grad_w, w.grad)):
        assert a.dtype == x_dtype_of(b)
        np.testing.assert_array_equal(np.asarray(a, np.float32), b.detach().float().numpy())
    swapped = record.lm_head_fp8(x, w, x_s=32.0, w_s=2.0)
    assert not np.array_equal(np.asarray(ours, np.float32), swapped.detach().float().numpy())


def test_the_fp8_heads_matmuls_take_bfloat16_operands():
    """Its three matmuls (the logits and both gradients) multiply bfloat16 operands, which hold the
    FP8 values exactly, with float32 sums: float32 operands at HIGHEST precision ran on an H200's
    CUDA cores, three quarters of record 20's step there (docs/benchmarks.md)."""
    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((32, 16), jnp.float32)
    loss = lambda x, w: jnp.sum(fp8_head(x, w).astype(jnp.float32))  # noqa: E731
    program = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*", program)
    assert len(dots) == 3, program
    for dot in dots:
        assert re.search(
            r": \(tensor<\d+x\d+xbf16>, tensor<\d+x\d+xbf16>\) -> tensor<\d+x\d+xf32>$", dot
        )
        assert "HIGHEST" not in dot


def x_dtype_of(t):
    return {torch.bfloat16: jnp.bfloat16, torch.float32: jnp.float32}[t.dtype]


def test_training_takes_the_fp8_head_and_evaluation_does_not(pair):
    """fp8_head=True: the loss with a key (training) is the record's GPT in train() with
    fp8_head; without one (eval), the plain head's."""
    ref, ours = pair
    fp8 = model_from(replace(ours.config, fp8_head=True), state_dict(ours))
    idx = tokens(seed=3)
    x, y = torch.as_tensor(idx[:-1].tolist() + [0]), torch.as_tensor(idx[1:].tolist() + [1])
    xj, yj = jnp.asarray(x.numpy())[None], jnp.asarray(y.numpy())[None]
    ref.fp8_head = True
    try:
        with torch.no_grad():
            trained = ref.train()(x, y, 2).item()
            evaluated = ref.eval()(x, y, 2).item()
    finally:
        ref.fp8_head = False
    ours_trained = float(fp8.loss(xj, yj, key=jax.random.key(0), window_blocks=2))
    ours_evaluated = float(fp8.loss(xj, yj, window_blocks=2))
    assert abs(ours_trained / trained - 1) < 1e-6 and abs(ours_evaluated / evaluated - 1) < 1e-6
    assert abs(trained / evaluated - 1) > 1e-4  # FP8 moved it
