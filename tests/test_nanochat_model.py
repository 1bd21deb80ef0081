"""python -m pytest tests/test_nanochat_model.py -q

arch='nanochat' (archs/nanochat.py) against the torch reference written from nanochat's gpt.py
(parity/nanochat_reference.py), float32 on both sides: logits, loss and every gradient on tiny
configs with grouped key/value heads, short windows that bite (sequences past 128 tokens) and odd
and even depths; nanochat's state dict in and out; the init; KV-cache decoding past the short
window; the config's refusals. With NANOCHAT_CHECKOUT=/path/to/nanochat, the logits also against
nanochat's own gpt.py (python -m parity.check_nanochat --own CHECKOUT checks generation too)."""

import os
import re
import sys
from dataclasses import asdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import assert_close, one_torch_thread

from archs import models
from archs.nanochat import NanochatGPT, config_from_nanochat
from archs.nanochat_attention import window_sizes
from compute.generate import generate
from model import GPTConfig
from parity import nanochat_reference as ref
from parity.check_nanochat import perturbed
from parity.common import pin_numerics

# n_head 4 over n_kv_head 2 (GQA); block_size 256: short windows of 128 tokens, which T=160 passes;
# vocab 100: a head of 128 rows, sliced
ODD = dict(
    sequence_len=256,
    vocab_size=100,
    n_layer=3,
    n_head=4,
    n_kv_head=2,
    n_embd=32,
    window_pattern="SSL",
)
EVEN = {**ODD, "n_layer": 4, "window_pattern": "SL"}
T = 160
# float32 both sides: the logits (scale ~10) differ by rounding, ~1e-5 at most here as in
# parity/check_nanochat.py, where torch's own float32 run is as far (9e-6) from its float64 one
LOGIT_TOL = 2e-5
# the mean loss: one float32 sum of 320 terms of ~5
LOSS_TOL = 1e-5
# gradients relative to each tensor's largest entry: the backward pass adds a few float32 roundings
# per op on top of the forward's
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def numerics():
    pin_numerics()
    with one_torch_thread():
        yield


def weights(config, seed=0):
    """nanochat's state dict from the reference's init, moved by noise: nothing zero or
    constant."""
    torch.manual_seed(seed)
    return perturbed(
        {k: v.numpy() for k, v in ref.GPT(ref.Config(**config)).state_dict().items()}, seed
    )


def both(config, state):
    """(the reference, ours) holding `state`."""
    reference = ref.GPT(ref.Config(**config))
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return reference.eval(), NanochatGPT.from_nanochat(config, state)


# jitted: op by op, JAX compiles each of the model's ops alone (seconds more each test)
forward = nnx.jit(lambda model, *args: model(*args))


def tokens(config, seed=0, batch=2, length=T):
    idx = np.random.default_rng(seed).integers(0, config["vocab_size"], (batch, length))
    targets = np.roll(idx, -1, axis=1)
    targets[:, ::5] = -1  # ignored
    return idx, targets


@pytest.mark.parametrize("config", [ODD, EVEN], ids=["odd-depth", "even-depth"])
def test_logits_and_loss_equal_the_references(config):
    reference, ours = both(config, weights(config))
    idx, targets = tokens(config)
    with torch.no_grad():
        expected = reference(torch.from_numpy(idx)).numpy()
        expected_loss = float(reference(torch.from_numpy(idx), torch.from_numpy(targets)))
    logits, loss = forward(ours, jnp.asarray(idx), jnp.asarray(targets))
    assert logits.shape == (2, T, config["vocab_size"])
    assert_close(logits, expected, atol=LOGIT_TOL, what="logits")
    assert abs(float(loss) - expected_loss) <= LOSS_TOL
    loss_alone = nnx.jit(lambda m, i, t: m.loss(i, t))(ours, jnp.asarray(idx), jnp.asarray(targets))
    assert float(loss_alone) == pytest.approx(float(loss))
    # the short windows bite: all-long windows give other logits
    _, long_only = both({**config, "window_pattern": "L"}, weights(config))
    long_logits = forward(long_only, jnp.asarray(idx))[0]
    assert np.abs(np.asarray(long_logits) - expected).max() > 100 * LOGIT_TOL


def test_windows_tile_the_pattern_with_the_last_layer_long():
    c = config_from_nanochat({**ODD, "n_layer": 6, "window_pattern": "ssl"})
    assert window_sizes(c) == [128, 128, 256, 128, 128, 256]
    assert window_sizes(config_from_nanochat({**ODD, "window_pattern": "S"})) == [128, 128, 256]
    assert window_sizes(config_from_nanochat({**ODD, "sequence_len": 2048})) == [512, 512, 2048]
    assert window_sizes(config_from_nanochat({**ODD, "sequence_len": 640})) == [256, 256, 640]


def test_gradients_equal_the_references():
    config = ODD
    reference, ours = both(config, weights(config, seed=1))
    idx, targets = tokens(config, seed=1)
    reference(torch.from_numpy(idx), torch.from_numpy(targets)).backward()
    expected = {k: p.grad.numpy() for k, p in reference.named_parameters()}
    grads = nnx.jit(nnx.grad(lambda m: m.loss(jnp.asarray(idx), jnp.asarray(targets))))(ours)
    grads = dict(nnx.to_flat_state(grads))
    assert len(ours.weight_rows()) == len(expected)
    for name, path, linear in ours.weight_rows():
        g = np.asarray(grads[tuple(_keys(path))][...])
        g = g.T if linear else g
        scale = np.abs(expected[name]).max()
        assert scale > 0, name
        assert_close(g, expected[name], atol=GRAD_RTOL * scale, what=name)


def _keys(path):
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def test_a_nanochat_state_dict_round_trips(tmp_path):
    state = weights(ODD)
    # as nanochat saves them on a GPU: torch.compile's prefix, bf16 tables
    saved = {"_orig_mod." + k: torch.from_numpy(v) for k, v in state.items()}
    saved["_orig_mod.transformer.wte.weight"] = saved["_orig_mod.transformer.wte.weight"].bfloat16()
    ours = NanochatGPT.from_nanochat(ODD, saved)
    out = ours.nanochat_state()
    assert out.keys() == state.keys()
    for k, v in state.items():
        if k == "transformer.wte.weight":
            v = torch.from_numpy(v).bfloat16().float().numpy()
        np.testing.assert_array_equal(out[k], v, err_msg=k)
    torch.save({k: torch.from_numpy(v) for k, v in out.items()}, tmp_path / "model_000001.pt")
    loaded = torch.load(tmp_path / "model_000001.pt", weights_only=True)
    ref.GPT(ref.Config(**ODD)).load_state_dict(loaded, strict=True)  # nanochat's names and shapes
    # a checkpoint from before the lambdas: neutral ones, as nanochat's checkpoint_manager patches
    old = {k: v for k, v in state.items() if not k.endswith("0_lambdas") and k != "resid_lambdas"}
    patched = NanochatGPT.from_nanochat({**ODD}, old).nanochat_state()
    np.testing.assert_array_equal(patched["resid_lambdas"], np.ones(ODD["n_layer"]))
    np.testing.assert_array_equal(patched["x0_lambdas"], np.zeros(ODD["n_layer"]))


def init_distributions(n_embd):
    """nanochat's init_weights, by state-dict name: ('uniform', low, high) or ('normal', std)."""
    s = np.sqrt(3 / n_embd)
    return [
        (r"transformer\.wte\.weight", ("normal", 0.8)),
        (r"lm_head\.weight", ("normal", 0.001)),
        (r".*attn\.c_[qkv]\.weight|value_embeds\..*", ("uniform", -s, s)),
        (r".*mlp\.c_fc\.weight", ("uniform", -0.4 * s, 0.4 * s)),
        (r".*(ve_gate|smear_gate)\.weight", ("uniform", 0.0, 0.02)),
    ]


@pytest.mark.parametrize("side", ["ours", "reference"])
def test_init_draws_nanochats_distributions_and_its_constants(side):
    config = {**ODD, "n_embd": 64, "vocab_size": 1000}
    if side == "ours":
        state = NanochatGPT(config_from_nanochat(config), nnx.Rngs(0)).nanochat_state()
    else:
        torch.manual_seed(0)
        state = {k: v.numpy() for k, v in ref.GPT(ref.Config(**config)).state_dict().items()}
    distributions = init_distributions(config["n_embd"])
    drawn = set()
    for name, v in state.items():
        spec = next((d for p, d in distributions if re.fullmatch(p, name)), None)
        if spec is None:
            continue
        drawn.add(name)
        # 5 standard errors of the sample's mean and std: a wrong bound or std (by 10% at the
        # largest tensors, 2x at the 24-entry gates) fails, a right one by chance ~1e-6
        n = v.size
        if spec[0] == "uniform":
            low, high = spec[1:]
            assert low <= v.min() and v.max() <= high, name
            mean, std = (low + high) / 2, (high - low) / np.sqrt(12)
        else:
            mean, std = 0.0, spec[1]
        assert abs(v.mean() - mean) <= 5 * std / np.sqrt(n), name
        assert abs(v.std() / std - 1) <= 5 / np.sqrt(n), name
    # deterministic: the projections zero, the lambdas' values exactly
    for name in set(state) - drawn:
        if name.endswith("c_proj.weight") or name == "smear_lambda":
            assert not state[name].any(), name
    d = np.float64(max(config["n_layer"] - 1, 1))
    expected_resid = [np.float32(1.15 - 0.10 * i / d) for i in range(3)]
    expected_x0 = [np.float32(0.20 - 0.15 * i / d) for i in range(3)]
    np.testing.assert_array_equal(state["resid_lambdas"], expected_resid)
    np.testing.assert_array_equal(state["x0_lambdas"], expected_x0)
    np.testing.assert_array_equal(state["backout_lambda"], [np.float32(0.2)])
    assert len(drawn) + 2 * config["n_layer"] + 4 == len(state)  # every tensor accounted for


def test_kv_cache_decoding_equals_the_full_forward_past_the_short_window():
    config = EVEN
    reference, ours = both(config, weights(config, seed=2))
    idx, _ = tokens(config, seed=2, batch=1, length=T)
    full = np.asarray(forward(ours, jnp.asarray(idx))[0])
    # prefill in chunks of 64 (the second and third start past position 0), then a token a step
    cache, logits = ours.init_cache(1, 192), []
    decode = nnx.jit(lambda m, x, c, pos: (lambda y: (m.logits(y[0]), y[1]))(m.decode(x, c, pos)))
    for start, n in [(0, 64), (64, 64), (128, 2)] + [(p, 1) for p in range(130, T)]:
        out, cache = decode(ours, jnp.asarray(idx[:, start : start + n]), cache, start)
        logits.append(np.asarray(out))
    assert_close(np.concatenate(logits, axis=1), full, atol=LOGIT_TOL, what="decoded logits")
    # greedy generation: ours cached, ours uncached, and the reference's through its cache
    prompt, steps = idx[:, :140], 30
    cached = generate(ours, prompt, steps, temperature=0)
    np.testing.assert_array_equal(cached, generate(ours, prompt, steps, 0, use_cache=False))
    np.testing.assert_array_equal(cached, reference.greedy(torch.from_numpy(prompt), steps))


def test_flops_and_parameters_count_as_nanochats():
    """6 x every matmul's weights (each Linear's, the padded head's) + 12·H·hs·min(window, T) per
    layer (nanochat's estimate_flops), counted on the reference's modules."""
    reference, ours = both(EVEN, weights(EVEN))
    matmuls = sum(m.weight.numel() for m in reference.modules() if isinstance(m, torch.nn.Linear))
    hs = EVEN["n_embd"] // EVEN["n_head"]
    T = EVEN["sequence_len"]
    attention = sum(12 * EVEN["n_head"] * hs * min(w, T) for w in reference.windows)
    assert ours.flops_per_token() == 6 * matmuls + attention
    assert ours.num_params(non_embedding=False) == sum(p.numel() for p in reference.parameters())
    tables = [p.numel() for n, p in reference.named_parameters() if "wte" in n or "value_emb" in n]
    assert ours.num_params() == ours.num_params(non_embedding=False) - sum(tables)


def test_bad_configs_are_refused_in_one_line():
    base = config_from_nanochat(ODD)
    cases = [
        (dict(n_kv_head=3), "needs n_kv_head"),
        (dict(n_embd=36), "n_embd / n_head must be even, got 9"),
        (dict(window_pattern="SXL"), "window_pattern of the letters S and L, got 'SXL'"),
        (dict(bias=True), "has no biases"),
    ]
    for change, message in cases:
        config = GPTConfig(**{**asdict(base), **change})
        with pytest.raises(ValueError, match=message) as e:
            models.check_config(config)
        assert "\n" not in str(e.value) and str(e.value).startswith("arch='nanochat'")
    # its fields belong to it: another architecture refuses them
    with pytest.raises(ValueError, match=r"^n_kv_head is nanochat's key/value heads"):
        models.check_config(GPTConfig(n_kv_head=2))
    with pytest.raises(ValueError, match=r"^window_pattern is nanochat's attention windows"):
        models.check_config(GPTConfig(window_pattern="L"))


@pytest.mark.skipif(
    not os.environ.get("NANOCHAT_CHECKOUT"),
    reason="set NANOCHAT_CHECKOUT=/path/to/nanochat to compare against nanochat's own gpt.py",
)
def test_logits_equal_nanochats_own_gpt():
    os.environ.setdefault("NANOCHAT_DTYPE", "float32")
    sys.path.insert(0, os.environ["NANOCHAT_CHECKOUT"])
    from nanochat import gpt

    for config in (ODD, EVEN):
        state = weights(config)
        theirs = gpt.GPT(gpt.GPTConfig(**config))
        theirs.init_weights()
        theirs.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
        idx, targets = tokens(config)
        with torch.no_grad():
            expected = theirs(torch.from_numpy(idx)).numpy()
            expected_loss = float(theirs(torch.from_numpy(idx), torch.from_numpy(targets)))
        logits, loss = NanochatGPT.from_nanochat(config, state)(
            jnp.asarray(idx), jnp.asarray(targets)
        )
        assert_close(logits, expected, atol=LOGIT_TOL, what="logits vs nanochat's own")
        assert abs(float(loss) - expected_loss) <= LOSS_TOL
        ours = NanochatGPT.from_nanochat(config, state)
        assert ours.flops_per_token() == theirs.estimate_flops()
        assert ours.num_params(non_embedding=False) == theirs.num_scaling_params()["total"]


def test_its_arch_answers_its_kernel_and_refuses_others():
    arch = models.arch_of("nanochat")
    cpu = jax.devices("cpu")[0]
    assert arch.kernel(config_from_nanochat(ODD), cpu) == "windows-xla"
    arch.check_run(config_from_nanochat(ODD, attention="xla"), cpu)
    with pytest.raises(Exception, match="cannot run arch='nanochat'"):
        arch.check_run(config_from_nanochat(ODD, attention="cudnn"), cpu)
    assert not arch.scans
