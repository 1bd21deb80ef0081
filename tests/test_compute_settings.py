"""python -m pytest tests/test_compute_settings.py -q

The run's compute settings (GPTConfig's attention, remat, loss_chunk; train.py's settings of the
same names): which attention kernel each backend gets, the same logits, loss and gradients with
every setting (fp32), and the memory they save by XLA's analysis of the compiled gradient
computation (step_memory)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, tiny_config

from archs.models import build
from compute import attention, layers, sharding
from configurator import UsageError
from model import GPT, GPTConfig


def step_memory(config, batch_size):
    """{temp, peak} bytes of jit(value_and_grad(GPT.loss)) on (batch_size, block_size) tokens: XLA's
    analysis of the compiled computation, from ShapeDtypeStructs (train.py's whole step:
    bench/train.py --memory)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((batch_size, config.block_size), jnp.int32)

    def loss(params, x, y):
        return nnx.merge(graphdef, params).loss(x, y)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens, tokens).compile()
    return {
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "peak": sharding.step_peak_bytes(compiled),
    }


def test_attention_setting_picks_cudnn_only_where_it_runs(monkeypatch):
    """attention.choose on a GPU (setting, dtype, head size, CUDA compute capability or None),
    against the limits of jax/_src/cudnn/fused_attention_stablehlo.py; 'cudnn' where it cannot run
    is a one-line ValueError. (Splash and the TPU: tests/test_attention.py.)"""

    def pick(setting, dtype, head_size, capability):
        return attention.choose(
            setting,
            platform="gpu",
            dtype=dtype,
            seq_len=1024,
            head_size=head_size,
            capability=capability,
        )

    assert pick("auto", "bfloat16", 64, (8, 0)) == "cudnn"  # A100
    assert pick("auto", "bfloat16", 64, (9, 0)) == "cudnn"  # H100
    assert pick("auto", "bfloat16", 64, None) == "xla"  # AMD GPU
    assert pick("auto", "bfloat16", 64, (7, 5)) == "xla"  # Turing
    assert pick("auto", "float32", 64, (9, 0)) == "xla"
    assert (
        pick("auto", "bfloat16", 160, (8, 0)) == "xla"
        and pick("auto", "bfloat16", 160, (9, 0)) == "cudnn"
    )
    assert (
        pick("auto", "bfloat16", 288, (9, 0)) == "xla"
        and pick("auto", "bfloat16", 36, (9, 0)) == "xla"
    )
    assert pick("xla", "bfloat16", 64, (9, 0)) == "xla"
    assert pick("cudnn", "bfloat16", 128, (8, 6)) == "cudnn"
    for args, why in [
        (("bfloat16", 64, None), "NVIDIA GPUs only"),
        (("bfloat16", 64, (7, 5)), "this GPU has 7.5"),
        (("float32", 64, (9, 0)), "bfloat16 only"),
        (("bfloat16", 160, (8, 0)), "<= 128, got 160"),
    ]:
        with pytest.raises(ValueError, match=f"^attention='cudnn' cannot run here: .*{why}"):
            pick("cudnn", *args)
    # this machine: auto is xla; cudnn fails as the model is traced, in one line, not when XLA
    # compiles it
    chosen = []
    monkeypatch.setattr(
        attention, "causal_attention", lambda q, k, v, kernel: chosen.append(kernel) or q
    )
    GPT(tiny_config(), nnx.Rngs(0))(np.zeros((1, 32), np.int32))
    assert chosen == ["xla", "xla"]
    with pytest.raises(ValueError, match="NVIDIA GPUs only"):
        GPT(tiny_config(attention="cudnn", dtype="bfloat16"), nnx.Rngs(0))(
            np.zeros((1, 32), np.int32)
        )
    # traced for an H100 (sharding.target_device: the mesh's first device), the model asks with that
    # GPU's capability
    h100 = types.SimpleNamespace(
        platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0"
    )
    monkeypatch.setattr(sharding, "target_device", lambda: h100)
    monkeypatch.setattr(sharding, "target_platform", lambda: "gpu")
    chosen.clear()
    GPT(tiny_config(dtype="bfloat16"), nnx.Rngs(0))(np.zeros((1, 32), np.int32))
    assert chosen == ["cudnn", "cudnn"]
    # train.py's check: it runs there
    attention.check_run(tiny_config(attention="cudnn", dtype="bfloat16"), h100)
    with pytest.raises(UsageError, match="bfloat16 only"):
        attention.check_run(tiny_config(attention="cudnn"), h100)
    for bad, match in [
        (dict(attention="flash2"), "attention must be one of"),
        (dict(remat="all"), "remat must be"),
        (dict(loss_chunk=-1), "loss_chunk must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            tiny_config(**bad)


def logits_loss_grads(config, idx, targets):
    """The model's logits, and GPT.loss (training's path) and its gradients, fp32."""
    graphdef, params = nnx.split(build(config, nnx.Rngs(0)))

    def logits_and_loss(params):
        model = nnx.merge(graphdef, params)
        return model.loss(idx, targets), model(idx)[0]

    (loss, logits), grads = jax.jit(jax.value_and_grad(logits_and_loss, has_aux=True))(params)
    return logits, loss, jax.tree.leaves(grads)


ARCHS = {"gpt2": {}, "speedrun": dict(arch="speedrun", bias=False)}  # GPT-2 and record 5


# record 5's model: make test-slow (CI runs it), the same four settings as GPT-2's; make test
# holds record 5's default computation against the record (test_check_speedrun.py)
@pytest.fixture(scope="module", params=["gpt2", pytest.param("speedrun", marks=pytest.mark.slow)])
def batch_and_reference(request):
    """Per architecture: its settings, tokens (4, 32), targets with some -1, and the default
    model's logits, loss and gradients on them."""
    rng = np.random.default_rng(0)
    idx, targets = (rng.integers(0, 128, (4, 32)) for _ in range(2))
    targets[0, :7] = targets[3, -2:] = -1
    idx, targets = jnp.asarray(idx), jnp.asarray(targets)
    arch = ARCHS[request.param]
    return arch, idx, targets, logits_loss_grads(tiny_config(**arch), idx, targets)


@pytest.mark.parametrize(
    "setting", ["explicit attention", "remat block", "remat dots", "loss_chunk 5"]
)
def test_each_setting_computes_the_same_logits_loss_and_gradients(
    setting, batch_and_reference, monkeypatch
):
    """Against the default (attention 'xla' on a CPU, no remat, the whole logits): within 1e-5
    relative in fp32. 'explicit attention' is the einsum path that attention dropout takes, in place
    of dot_product_attention. loss_chunk 5 does not divide T = 32: the last chunk is padded with
    ignored targets; some targets are -1."""
    arch, idx, targets, reference = batch_and_reference
    calls = []
    if setting == "explicit attention":

        def explicit(q, k, v, is_causal, implementation):
            calls.append(implementation)
            return attention.explicit_attention(q, k, v, 0.0, None)

        monkeypatch.setattr(jax.nn, "dot_product_attention", explicit)
        config = tiny_config(**arch)
    else:
        name, value = setting.split()
        config = tiny_config(**arch, **{name: int(value) if name == "loss_chunk" else value})
    logits, loss, grads = logits_loss_grads(config, idx, targets)
    assert calls or setting != "explicit attention"

    assert_close(logits, reference[0], atol=1e-5 * np.abs(reference[0]).max(), what="logits")
    assert_close(loss, reference[1], rtol=1e-5, what="loss")
    assert len(grads) == len(reference[2])
    for g, ref in zip(grads, reference[2]):
        assert_close(g, ref, atol=1e-5 * np.abs(ref).max(), what="gradient")


# make test-slow (CI runs it): make test holds each remat's smaller peak
# (tests/test_auto_settings.py)
@pytest.mark.slow
def test_remat_block_cuts_the_step_peak_3x():
    """6 layers whose activations (the (B, nh, T, T) attention scores and probabilities above all)
    dwarf the params: remat='block' keeps only each block's input, so the compiled step's peak drops
    >= 3x; 'dots' keeps the matmul outputs too, in between."""
    config = dict(block_size=256, vocab_size=128, n_layer=6, n_head=4, n_embd=64)
    peak = {
        remat: step_memory(GPTConfig(**config, remat=remat), batch_size=8)["peak"]
        for remat in ("none", "block", "dots")
    }
    assert peak["none"] >= 3 * peak["block"], peak
    assert peak["block"] < peak["dots"] < peak["none"], peak


def test_remat_qkv_proj_keeps_what_it_names_and_block_nothing(capsys):
    """Besides a block's params and input, remat='qkv_proj' keeps for the backward exactly q, k, v
    (B, T, 3C) and the attention's output projection (B, T, C), by the names the model gives them;
    'block' keeps nothing more."""
    graphdef, state = nnx.split(GPT(tiny_config(), nnx.Rngs(0)).h[0])
    for remat, want in [
        ("qkv_proj", ["f32[2,16,192] named 'qkv'", "f32[2,16,64] named 'attn_proj'"]),
        ("block", []),
    ]:
        block = jax.checkpoint(
            lambda state, x: nnx.merge(graphdef, state)(x), policy=layers.REMAT[remat]
        )
        jax.ad_checkpoint.print_saved_residuals(block, state, jnp.ones((2, 16, 64)))
        saved = [
            line.split(" from ")[0]
            for line in capsys.readouterr().out.splitlines()
            if " from the argument " not in line
        ]
        assert saved == want, (remat, saved)


def test_a_scanned_block_keeps_its_activations_unless_remat_says_otherwise(capsys):
    """layers.block_fn, a block as the scanned model runs it: with remat='none' the backward reads
    the activations the forward kept; with 'block' nothing but the block's params and input (it
    recomputes the rest)."""
    graphdef, state = nnx.split(GPT(tiny_config(), nnx.Rngs(0)).h[0])
    for remat in ("none", "block"):
        block = layers.block_fn(graphdef, layers.REMAT[remat])
        jax.ad_checkpoint.print_saved_residuals(
            lambda state, x: block(state, x, None), state, jnp.ones((2, 16, 64))
        )
        saved = [
            line
            for line in capsys.readouterr().out.splitlines()
            if " from the argument " not in line
        ]
        assert (len(saved) > 10) if remat == "none" else saved == [], (remat, saved)


def test_the_scanned_model_keeps_for_the_backward_what_remat_says(capsys):
    """scan_layers runs the blocks with the remat setting's policy: out of the scan, 'block' keeps
    only the blocks' inputs (n_layer, B, T, C); 'dots' the Linear layers' outputs too (q, k, v and
    the MLP's c_fc among them); 'none' everything, attention's (B, nh, T, T) probabilities among
    them."""
    idx = jnp.zeros((2, 16), jnp.int32)
    kept = {}
    for remat in ("none", "block", "dots"):
        graphdef, state = nnx.split(GPT(tiny_config(scan_layers=True, remat=remat), nnx.Rngs(0)))
        jax.ad_checkpoint.print_saved_residuals(
            lambda state: nnx.merge(graphdef, state).loss(idx, idx), state
        )
        kept[remat] = [
            line.split()[0]
            for line in capsys.readouterr().out.splitlines()
            if " output of scan " in line
        ]
    assert kept["block"] == ["f32[2,2,16,64]"], kept["block"]
    assert {"f32[2,2,16,192]", "f32[2,32,256]"} <= set(kept["dots"]) and len(kept["dots"]) < 6, (
        kept["dots"]
    )
    assert "f32[2,1,2,2,16,16]" in kept["none"] and len(kept["none"]) > 10, kept["none"]


def test_chunked_loss_holds_no_whole_batch_logits():
    """A large vocabulary on a small model, so that the (B, T, vocab) float32 logits and their
    gradient are most of the step: the whole loss's temporaries hold at least two such buffers, the
    chunked loss's not one (its chunk is 1/16 of one)."""
    config = dict(block_size=128, vocab_size=16384, n_layer=2, n_head=2, n_embd=64)
    B = 8
    logits_bytes = B * config["block_size"] * config["vocab_size"] * 4
    whole = step_memory(GPTConfig(**config), B)["temp"]
    chunked = step_memory(GPTConfig(**config, loss_chunk=8), B)["temp"]
    assert whole >= 2 * logits_bytes and chunked < logits_bytes, (whole, chunked, logits_bytes)
