"""python -m pytest tests/test_generate.py -q

Generation: KV-cache logits against full forwards, greedy tokens against transformers' generate,
sampling with and without the cache, the top-k/top-p/temperature filters against numpy and
transformers' warpers, the tokens generate samples against the filtered softmax (chi-square), one
compilation per shape, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config

from model import GPT
from parity.check_generate import (
    CACHE_LOGITS_TOL,
    bf16_ok,
    check_bf16,
    check_greedy,
    check_sampling,
    make_prompt,
    varied_hf_model,
)
from parity.common import max_abs, pin_numerics
from parity.sampling_checks import (
    FILTER_PROB_TOL,
    check_filters,
    chi_square,
    draw,
    hf_probs,
    reference_probs,
)

TINY = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=128)


def load_pair(tmp_path, seed, **config):
    pin_numerics()
    hf_model = varied_hf_model(seed, **config)
    hf_model.save_pretrained(tmp_path / "hf")
    return hf_model, GPT.from_pretrained(str(tmp_path / "hf"))


@pytest.mark.parametrize(
    "n_positions, batch, prompt_len, new_tokens",
    [
        # within block_size; the prompt takes two prefill chunks (PREFILL_CHUNK = 64)
        (192, 3, 100, 64),
        (32, 2, 8, 96),  # past block_size after 24 steps: the window slides, as nanoGPT's crop
        # a prompt longer than block_size: never a cached step (and the same compilation)
        (32, 2, 40, 64),
        # the second prefill chunk's padding rows lie past block_size (positions 100-127)
        (100, 2, 70, 40),
    ],
    ids=["within-block", "past-block", "prompt-past-block", "prefill-past-block"],
)
def test_greedy_equals_transformers_and_cache_logits_equal_full_forward(
    tmp_path, n_positions, batch, prompt_len, new_tokens
):
    hf_model, model = load_pair(tmp_path, n_positions + prompt_len, n_positions=n_positions, **TINY)
    f = check_greedy(
        model,
        hf_model,
        make_prompt(batch, prompt_len, TINY["vocab_size"], seed=prompt_len),
        new_tokens,
    )
    assert f["greedy_equal"], f
    assert f["distinct"] >= 5, f  # the decoding really decided something
    assert f["cache_rel"] <= CACHE_LOGITS_TOL, f


def test_the_checks_catch_a_cache_that_is_slightly_off(tmp_path, monkeypatch):
    """Keys cached 0.1% too large: the full-forward reference, computed without the cache, must see
    it."""
    from model import CausalSelfAttention

    decode = CausalSelfAttention.decode

    def skewed(self, x, kv, pos):
        y, (k, v) = decode(self, x, kv, pos)
        return y, (k * 1.001, v)

    monkeypatch.setattr(CausalSelfAttention, "decode", skewed)
    hf_model, model = load_pair(tmp_path, 3, n_positions=64, **TINY)
    # a shape no other test has
    f = check_greedy(model, hf_model, make_prompt(1, 3, TINY["vocab_size"], seed=3), 30)
    assert f["cache_rel"] > 10 * CACHE_LOGITS_TOL, f


@pytest.mark.slow
def test_sampling_with_and_without_cache_gives_identical_tokens(tmp_path):
    _, model = load_pair(tmp_path, 7, n_positions=32, **TINY)
    idx = make_prompt(2, 8, TINY["vocab_size"], seed=7)
    f = check_sampling(model, idx, 40, jax.random.key(0))  # crosses block_size at step 24
    assert f["sample_equal"] and f["sample_cache_rel"] <= CACHE_LOGITS_TOL, f
    # same key, same tokens; another key, other tokens (compiled once for all three calls)
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, return_logits=True)
    a = model.generate(idx, 40, key=jax.random.key(0), **kw)[0]
    assert np.array_equal(a, model.generate(idx, 40, key=jax.random.key(0), **kw)[0])
    assert not np.array_equal(a, model.generate(idx, 40, key=jax.random.key(1), **kw)[0])


@pytest.mark.slow
def test_bf16_cache_is_as_accurate_as_the_bf16_full_forward(tmp_path):
    load_pair(tmp_path, 5, n_positions=64, **TINY)
    # every step cached
    f = check_bf16(str(tmp_path / "hf"), make_prompt(2, 6, TINY["vocab_size"], seed=5), 40)
    assert bf16_ok(f), f


def test_filters_match_numpy_and_transformers():
    rows = check_filters()
    for setting, vs_numpy, same_support, vs_hf, same_support_hf in rows:
        assert same_support and same_support_hf, setting
        assert vs_numpy <= FILTER_PROB_TOL and vs_hf <= FILTER_PROB_TOL, (setting, vs_numpy, vs_hf)
    # and they bite: top_k=1 keeps the argmax alone (a tie-free row)
    from compute.generate import filter_logits

    logits = jax.random.normal(jax.random.key(0), (4, 100))
    kept = np.isfinite(np.asarray(filter_logits(logits, 0.7, top_k=1)))
    assert (kept.sum(-1) == 1).all() and (kept.argmax(-1) == np.asarray(logits).argmax(-1)).all()
    # and with no setting, nothing changes: the logits in float32 (bf16 ones too: the filters work
    # in float32)
    x = logits.astype(jnp.bfloat16)
    assert filter_logits(x).dtype == jnp.float32 and np.array_equal(
        filter_logits(x), x.astype(jnp.float32)
    )


def test_generate_draws_from_the_filtered_softmax():
    """20,000 tokens through generate (2,000 rows x 10 steps) from one fixed logit vector, against
    the filtered softmax of that vector in float64 numpy (parity.sampling_checks.reference_probs,
    written from the definitions; transformers' warpers give the same): nothing drawn outside the
    kept set, and Pearson's chi-square within its 1 - 1e-6 quantile, so a correct sampler fails with
    probability 1e-6 over keys (the key is fixed: the test is deterministic). At T=0.8, top_k=20,
    top_p=0.9 each filter changes the kept set (15 tokens; 16 without the temperature, 20 without
    top_p, 56 without top_k, 128 from the raw logits), so ignoring any one fails."""
    model = GPT(tiny_config(), nnx.Rngs(0))
    # ln_f's scale 0 makes every final hidden state ln_f's bias b, whatever the tokens: the logits
    # are wte @ b at every step, of std ~1.1 at this scale
    model.ln_f.scale.set_value(jnp.zeros(64))
    model.ln_f.bias.set_value(6 * jax.random.normal(jax.random.key(1), (64,)))
    sampling = (0.8, 20, 0.9)
    counts, logits = draw(model, [0], 2000, 10, sampling, jax.random.key(0))
    probs = reference_probs(logits[None], *sampling)[0]
    assert max_abs(probs, hf_probs(logits[None], *sampling)[0]) <= FILTER_PROB_TOL
    f = chi_square(counts, probs, alpha=1e-6)
    assert counts.sum() == 20000 and f["kept"] == 15, f
    assert f["ok"], f


def test_compiles_once_per_batch_size_and_total_length(monkeypatch):
    """A new prompt (even of another length, with the same total), a new key: no new trace; the loop
    over tokens lives inside the one compiled function."""
    traces = []
    init_cache = GPT.init_cache
    monkeypatch.setattr(
        GPT, "init_cache", lambda self, *a: traces.append(a) or init_cache(self, *a)
    )
    model = GPT(tiny_config(), nnx.Rngs(0))
    rng = np.random.default_rng(0)
    # batch 5: no other test compiles it
    out = model.generate(rng.integers(0, 128, (5, 6)), 10, temperature=0)
    assert len(traces) == 1 and out.shape == (5, 16)
    model.generate(rng.integers(0, 128, (5, 6)), 10, temperature=0)
    model.generate(rng.integers(0, 128, (5, 9)), 7, temperature=0, key=jax.random.key(3))
    model.generate(rng.integers(0, 128, (5, 1)), 15, temperature=0)
    assert len(traces) == 1


def test_the_kv_cache_is_held_in_the_compute_dtype():
    """bf16 compute, a bf16 cache (half float32's memory), in both layouts: one (k, v) per layer, or
    one stacked."""
    for scan in (False, True):
        config = tiny_config(dtype="bfloat16", scan_layers=scan)
        cache = nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))).init_cache(3, 16)
        shape = (3 * 2, 16, 32) if not scan else (2, 3 * 2, 16, 32)
        assert [(x.dtype, x.shape) for x in jax.tree.leaves(cache)] == [(jnp.bfloat16, shape)] * (
            4 if not scan else 2
        )


def test_streamed_tokens_and_vocab_limit():
    model = GPT(tiny_config(), nnx.Rngs(1))
    idx = np.random.default_rng(1).integers(0, 128, (2, 3))
    streamed = []
    out = model.generate(
        idx,
        20,
        temperature=1.0,
        key=jax.random.key(0),
        vocab_limit=50,
        on_token=lambda ids: streamed.append(np.asarray(ids)),
    )
    jax.effects_barrier()
    assert np.array_equal(np.stack(streamed, axis=1), out[:, 3:])  # every step, in order
    assert out[:, 3:].max() < 50  # without the limit, 78 of 128 ids would be fair game
    assert np.array_equal(out[:, :3], idx)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be a positive integer"),
        (dict(top_k=0), "top_k must be a positive integer"),
        (dict(top_k=-1), "top_k must be a positive integer"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(key=None), "needs a PRNG key"),
        (dict(idx=np.zeros((2, 0), np.int32)), "time >= 1"),
        (dict(idx=np.zeros(4, np.int32)), "shape"),
        (dict(idx=np.full((1, 3), 128)), r"must be in \[0, 128\)"),
    ],
)
def test_bad_generate_arguments_are_one_line_errors(kwargs, message):
    model = GPT(tiny_config(), nnx.Rngs(0))
    args = {
        **dict(
            idx=np.zeros((1, 3), np.int32), max_new_tokens=4, temperature=1.0, key=jax.random.key(0)
        ),
        **kwargs,
    }
    with pytest.raises(ValueError, match=message) as e:
        model.generate(**args)
    assert "\n" not in str(e.value)


def test_generate_hands_on_its_settings_and_takes_each_one_at_its_bounds(monkeypatch):
    """What generate() passes to the compiled loop (caught before it compiles): nanoGPT's default
    temperature 1, the least max_new_tokens, top_k and vocab_limit it takes and the whole
    vocabulary; past those bounds, one line."""
    from compute import generate as gen

    class Compiling(Exception):
        pass

    passed = []

    def loop(*args, sampling, **kwargs):
        passed.append(sampling)
        raise Compiling

    monkeypatch.setattr(gen, "generate_in_jit", loop)
    model, idx, key = GPT(tiny_config(), nnx.Rngs(0)), [[1, 2]], jax.random.key(3)

    def sampling(*args, **kwargs):
        with pytest.raises(Compiling):
            gen.generate(model, idx, *args, **kwargs)
        return passed[-1]

    assert sampling(1, key=key) == (1.0, None, None, None)
    with pytest.raises(Compiling):
        # the model's method, nanoGPT's GPT.generate, has the same default
        model.generate(idx, 1, key=key)
    assert passed[-1] == (1.0, None, None, None)
    assert sampling(2, top_k=1, top_p=1.0, vocab_limit=1, key=key) == (1.0, 1, None, 1)
    # greedy: no key needed
    assert sampling(2, temperature=0, vocab_limit=128) == (0.0, None, None, 128)
    for kwargs, message in [
        ({"vocab_limit": 0}, r"vocab_limit must be in \[1, 128\], got 0$"),
        ({"vocab_limit": 129}, r"vocab_limit must be in \[1, 128\], got 129$"),
        ({"top_k": 0}, r"top_k must be a positive integer"),
        (
            {"temperature": 0.5, "key": None},
            r"^sampling \(temperature > 0\) needs a PRNG key: key=jax\.random\.key\(seed\)$",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            gen.generate(model, idx, 2, **{"temperature": 0, **kwargs})
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        gen.generate(model, idx, 0, temperature=0)
