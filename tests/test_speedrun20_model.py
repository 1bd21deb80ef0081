"""python -m pytest tests/test_speedrun20_model.py -q

arch='speedrun20' (modded-nanogpt's record 20) on its own: the masks its attention takes, KV-cache
generation against the full forward with documents and short windows, the soft-capped logits, and
a bad config, one line. Against the torch reference: test_speedrun20_parity.py."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_diff

from archs import record20, window_attention
from archs.models import build
from archs.window_attention import WINDOW_BLOCK, window_mask
from compute.generate import generate
from model import GPTConfig
from parity.check_generate import CACHE_LOGITS_TOL

TINY20 = dict(
    arch="speedrun20", bias=False, n_layer=4, n_head=2, n_embd=32, block_size=256, vocab_size=64
)


@pytest.fixture(autouse=True, scope="module")
def small_end_of_text():
    """Documents split at id 63 of a 64-token vocabulary, not GPT-2's 50256: the same masks, a head
    of 128 rows instead of 50304."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(window_attention, "EOT", 63)
        yield


def randomized(model, seed=0, scale=0.3):
    """Every param drawn anew: the record's zero head and projections, and its lambdas' 0 and 1,
    would hide a wrong mix, skip or mask."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(
        model,
        jax.tree.unflatten(
            treedef, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
        ),
    )
    return model


def with_documents(shape, seed=0, every=37):
    """Token ids with an <|endoftext|> every `every` tokens or so: documents that split blocks."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, window_attention.EOT, shape)
    idx[rng.random(shape) < 1 / every] = window_attention.EOT
    return idx


def test_window_mask_is_block_wise_document_causal():
    """Query 200 (block 1) with a one-block window sees keys 128..200 of its document; with two
    blocks, 0..200 of it; a document starting at 150 cuts both."""
    pos = jnp.arange(256)
    one_doc = jnp.zeros((1, 256), jnp.int32)
    row = lambda docs, w: np.flatnonzero(window_mask(pos, pos, docs, docs, w)[0, 200])  # noqa: E731
    assert row(one_doc, 1).tolist() == list(range(128, 201))
    assert row(one_doc, 0).tolist() == list(range(128, 201))  # the short window at step 0
    assert row(one_doc, 2).tolist() == list(range(0, 201))
    two_docs = (pos >= 150).astype(jnp.int32)[None]
    assert row(two_docs, 2).tolist() == list(range(150, 201))
    assert np.flatnonzero(
        window_attention.window_mask(pos, pos, two_docs, two_docs, 2)[0, 140]
    ).tolist() == list(range(0, 141))


def test_documents_start_at_each_end_of_text():
    eot = window_attention.EOT
    idx = jnp.array([[5, eot, 7, 8, eot, eot, 9]])
    assert window_attention.documents(idx).tolist() == [[0, 1, 1, 1, 2, 3, 3]]


@pytest.mark.parametrize("window_size", [record20.WINDOW_SIZE, 128])
def test_kv_cache_generation_is_the_full_forward(window_size):
    """Greedy tokens and each step's logits, cache or not, with documents in the prompt and past
    128-token blocks; a 128-token window (long 1 block, short 0) makes the windows cut."""
    model = randomized(build(GPTConfig(**TINY20, window_size=window_size), nnx.Rngs(0)))
    prompt = with_documents((2, 120))
    full, full_logits = generate(
        model, prompt, 40, temperature=0, use_cache=False, return_logits=True
    )
    cached, logits = generate(model, prompt, 40, temperature=0, use_cache=True, return_logits=True)
    np.testing.assert_array_equal(cached, full)
    assert rel_diff(logits, full_logits) < CACHE_LOGITS_TOL
    assert logits.shape[-1] == 128  # the head's padded rows


@pytest.mark.slow
def test_a_window_changes_the_logits_only_past_it():
    """Positions in the first block see the same keys at any window; later ones do not."""
    model = randomized(build(GPTConfig(**TINY20), nnx.Rngs(0)))
    idx = jnp.asarray(with_documents((1, 256), every=10_000))
    wide, _ = model(idx, window_blocks=2)
    narrow, _ = model(idx, window_blocks=1)
    np.testing.assert_array_equal(wide[:, :128], narrow[:, :128])
    assert np.abs(wide[:, 128:] - narrow[:, 128:]).max() > 1e-3


# make test-slow (CI runs it): make test holds layers.chunked_terms through GPT-2's chunked loss
@pytest.mark.slow
def test_the_loss_in_chunks_is_the_whole_loss_and_gradient():
    """loss_chunk=48 (the last chunk padded): the whole loss and its gradient. (The FP8 head takes
    each chunk's logits the same way: its rounding is tested whole, test_speedrun20_parity.py.)"""
    idx = jnp.asarray(with_documents((2, 257)))
    x, y = idx[:, :-1], idx[:, 1:]

    def loss_and_grads(loss_chunk):
        config = GPTConfig(**TINY20, loss_chunk=loss_chunk)
        model = randomized(build(config, nnx.Rngs(0)))
        loss, grads = nnx.value_and_grad(lambda m: m.loss(x, y, key=jax.random.key(0)))(model)
        return loss, jax.tree.leaves(nnx.state(grads))

    with jax.default_matmul_precision("highest"):
        whole, chunked = loss_and_grads(0), loss_and_grads(48)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
    for a, b in zip(chunked[1], whole[1]):  # sums in another order
        assert rel_diff(a, b) < 1e-4


def test_logits_are_soft_capped_and_the_loss_is_their_cross_entropy():
    model = randomized(build(GPTConfig(**TINY20), nnx.Rngs(0)), scale=3.0)
    idx = jnp.asarray(with_documents((2, 128)))
    logits, loss = model(idx[:, :-1].repeat(1, axis=0), idx[:, 1:])
    assert 0 < logits.min() and logits.max() < 30 and logits.max() > 25
    logp = jax.nn.log_softmax(logits, axis=-1)
    expected = -jnp.take_along_axis(logp, idx[:, 1:, None], axis=-1).mean()
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(n_layer=3), "even n_layer"),
        (dict(block_size=200), "multiple of 128"),
        (dict(bias=True), "bias=False"),
        (dict(n_head=4, n_embd=24), "multiple of 4"),
        (dict(scan_layers=True), "scan_layers=False"),
        (dict(dropout=0.1), "dropout=0.0"),
        (dict(attention="cudnn"), "token-wise sliding window cannot express"),
    ],
)
def test_a_config_the_record_cannot_take_is_one_line(change, says):
    with pytest.raises(ValueError, match=says) as e:
        build(GPTConfig(**{**TINY20, **change}), nnx.Rngs(0))
    assert "\n" not in str(e.value) and "record 20" in str(e.value)


@pytest.mark.parametrize("window", [0, 1, 2, 3])
def test_the_banded_kernel_is_the_masked_one(window):
    """window_attention.banded_window_attention (the record's long sequences: a band of kv blocks
    per query block) against masked attention over window_mask, documents splitting blocks."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 1024, 2, 8)), jnp.float32) for _ in range(3))
    docs = window_attention.documents(jnp.asarray(with_documents((2, 1024), every=150)))
    pos = jnp.arange(1024)
    with jax.default_matmul_precision("highest"):
        dense = window_attention.masked_attention(
            q, k, v, window_attention.window_mask(pos, pos, docs, docs, window), 0.12
        )
        banded = window_attention.banded_window_attention(q, k, v, docs, jnp.int32(window), 3, 0.12)
    np.testing.assert_allclose(banded, dense, rtol=0, atol=1e-6)


def test_a_sequence_longer_than_the_band_takes_the_banded_kernel(monkeypatch):
    """With window_size 256 (2 blocks; short: 1) a 4-block sequence runs banded: the logits of the
    masked kernel's run, at the same window."""
    idx = jnp.asarray(with_documents((1, 512), every=150))
    config = GPTConfig(**{**TINY20, "block_size": 512})

    def logits(model):
        """Jitted (op by op a forward compiles ~70 times), a new function traced at each call: the
        second after the patch, whatever jit's cache holds."""
        return nnx.jit(lambda m: m(idx, window_blocks=2)[0])(model)

    with jax.default_matmul_precision("highest"):
        masked = logits(randomized(build(config, nnx.Rngs(0))))
        # only the banded kernel can run
        monkeypatch.setattr(window_attention, "masked_attention", None)
        banded = logits(randomized(build(replace(config, window_size=256), nnx.Rngs(0))))
    np.testing.assert_allclose(banded, masked, rtol=0, atol=1e-5)


# make test-slow (CI runs it): make test holds both kernels against the masked one at three windows
# and under a mesh (test_window_attention.py, test_attention.py), and GPT-2's whole model through
# splash (test_attention.py)
@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["splash", "flash"])
def test_the_model_with_splash_or_flash_computes_what_it_computes_with_xla(kernel):
    """attention='splash' and 'flash' (window_attention's Pallas kernels, interpret mode) against
    'xla' (the banded kernel) in a whole model, fp32, 1024 tokens with documents, window_size 256
    (long and short layers) at a window of 2 and 1: the loss, and every gradient within 3e-5 of its
    tensor's largest, twice the 1.4e-5 by which XLA's own masked and banded kernels differ here
    (summed in another order). The window reaches the kernels as data, in one jitted step."""
    idx = jnp.asarray(with_documents((1, 1025), every=400))
    config = GPTConfig(**{**TINY20, "block_size": 1024, "window_size": 256})

    @nnx.jit
    def loss_and_grads(model, window):
        loss = lambda m: m(idx[:, :-1], idx[:, 1:], window_blocks=window)[1]  # noqa: E731
        return loss(model), nnx.grad(loss)(model)

    for window in (2, 1):
        out = {}
        for setting in (kernel, "xla"):
            model = randomized(build(replace(config, attention=setting), nnx.Rngs(0)))
            loss, grads = loss_and_grads(model, jnp.int32(window))
            out[setting] = loss, jax.tree.leaves(nnx.to_pure_dict(grads))
        (loss_s, grads_s), (loss_x, grads_x) = out[kernel], out["xla"]
        assert abs(float(loss_s) / float(loss_x) - 1) < 1e-6
        for a, b in zip(grads_s, grads_x):
            np.testing.assert_allclose(a, b, rtol=0, atol=3e-5 * float(jnp.abs(b).max()))


@pytest.mark.slow
def test_the_window_grows_as_the_records_to_window_size():
    """window_schedule, as record 20's Arch gives it to the train step and the eval, against the
    torch reference's window_size at every step of the record's run, and at a window_size of 256:
    the schedule's span and the model's band follow the setting."""
    from parity import speedrun20_training as training

    n = 1393
    for window_size in (1728, 256):
        c = dict(max_iters=n, window_size=window_size)
        inputs = record20.Record20.step_inputs(c, 1)["inputs"]
        for step in range(n + 1):
            expected = training.window_size(step, n, span=window_size) // WINDOW_BLOCK
            evaluated = record20.Record20.eval_inputs(step, c)["window_blocks"]
            assert inputs(step)["window_blocks"] == expected == int(evaluated), (window_size, step)
    assert record20.window_schedule(n, n) == 14  # the record's final 1792 tokens
    model = build(GPTConfig(**{**TINY20, "window_size": 256}), nnx.Rngs(0))
    assert model.final_window() == 2 and {b.attn.band for b in model.h if b.attn} == {2, 1}
    # one block: the short window's band too (its own block), and a 2-block sequence runs banded
    config = GPTConfig(**{**TINY20, "window_size": 100, "block_size": 256})
    model = randomized(build(config, nnx.Rngs(0)))
    assert model.final_window() == 1 and {b.attn.band for b in model.h if b.attn} == {1}
    logits, _ = model(jnp.asarray(with_documents((1, 256), every=10_000)))
    assert np.isfinite(np.asarray(logits)).all()


def test_bf16_tables_are_the_float32_ones_rounded_and_their_gradient_is_summed_in_float32():
    """embed_dtype='bfloat16' (the record's .bfloat16() of its initialised tables): the token and
    value embeddings in bf16, drawn as the float32 model's and rounded, every other param the same
    float32 one; the loss and gradient those of the float32 model holding the rounded tables, the
    tables' gradient its gradient rounded once (summed over the tokens in float32, as torch's CUDA
    embedding backward sums it)."""
    f32 = build(GPTConfig(**TINY20), nnx.Rngs(0))
    fresh = [(path, a[...]) for path, a in nnx.to_flat_state(nnx.state(f32, nnx.Param))]
    randomized(f32)  # built once: its draws (fresh) taken first
    bf16 = build(GPTConfig(**TINY20, embed_dtype="bfloat16"), nnx.Rngs(0))
    init = nnx.to_flat_state(nnx.state(bf16, nnx.Param))
    assert {path[0] for path, x in init if x.dtype == jnp.bfloat16} == {"wte", "ve"}
    assert all(x.dtype == jnp.float32 for path, x in init if path[0] not in ("wte", "ve"))
    for (path, b), (_, a) in zip(init, fresh):
        np.testing.assert_array_equal(a.astype(b.dtype), b[...], err_msg=str(path))
    # the random weights into both, the tables rounded
    nnx.update(bf16, jax.tree.map(lambda a, b: a.astype(b.dtype), nnx.state(f32), nnx.state(bf16)))
    nnx.update(f32, jax.tree.map(lambda b: b.astype(jnp.float32), nnx.state(bf16)))
    idx = jnp.asarray(with_documents((2, 257), every=50))  # each table row takes many tokens
    x, y = idx[:, :-1], idx[:, 1:]
    # jitted, as training runs it: op by op each compiles ~80 times
    loss_and_grads = nnx.jit(nnx.value_and_grad(lambda m: m.loss(x, y)))
    losses, grads = zip(*(loss_and_grads(model) for model in (f32, bf16)))
    assert losses[0] == losses[1]
    for (path, a), (_, b) in zip(*(nnx.to_flat_state(nnx.state(g)) for g in grads)):
        assert b.dtype == (jnp.bfloat16 if path[0] in ("wte", "ve") else jnp.float32), path
        np.testing.assert_array_equal(a[...].astype(b.dtype), b[...], err_msg=str(path))
