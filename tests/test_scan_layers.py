"""python -m pytest tests/test_scan_layers.py -q

scan_layers: the blocks' params stacked on a leading layer axis and run by one lax.scan. The same
numbers as the Python loop (logits, loss, gradients, with each remat policy), the same generated
tokens, the same tensors in and out of HF and nanoGPT files, and checkpoints that restore into
either layout, bit for bit."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, settings, tiny_config
from safetensors.numpy import load_file

import export
import train
from compute import sharding
from compute.layers import relayout_blocks
from configurator import ConfigError, UsageError, configure
from dataio.pretrained import read_nanogpt
from dataio.weights import state_dict
from model import GPT
from parity.common import save_random_hf_model
from run import checkpoint, train_step
from run.settings import DEFAULTS, validate


def tokens(shape, vocab=128, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


# remat dots scanned: make test-slow (CI runs it); make test holds remat dots on the loop
# (test_compute_settings.py) and what the scanned body keeps for the backward under each remat
@pytest.mark.parametrize("remat", ["none", pytest.param("dots", marks=pytest.mark.slow)])
def test_scanned_model_computes_what_the_loop_computes(remat):
    """Built from the same seed, the scanned model holds the same weights (the blocks are drawn in
    the same order, then stacked); its logits, loss and gradients equal the loop's to float32
    rounding (XLA fuses a scan's body differently from n_layer unrolled copies)."""
    loop = GPT(tiny_config(remat=remat), nnx.Rngs(0))
    scan = GPT(tiny_config(remat=remat, scan_layers=True), nnx.Rngs(0))
    assert nnx.state(scan.h)["attn"]["c_attn"]["kernel"][...].shape == (2, 64, 192)
    for k, v in state_dict(loop).items():
        np.testing.assert_array_equal(state_dict(scan)[k], v, err_msg=k)
    idx, targets = tokens((2, 32)), tokens((2, 32), seed=1)
    # each jitted (op by op, JAX compiles every op of the model alone: many times the time)
    logits = nnx.jit(lambda m: m(idx)[0])
    assert_close(logits(scan), logits(loop), rtol=1e-6, atol=1e-6, what="logits")
    loss_and_grads = nnx.jit(nnx.value_and_grad(lambda m: m.loss(idx, targets)))
    loss_scan, grads_scan = loss_and_grads(scan)
    loss_loop, grads_loop = loss_and_grads(loop)
    assert abs(float(loss_scan) / float(loss_loop) - 1) < 1e-6
    grads_loop = relayout_blocks(nnx.to_pure_dict(grads_loop), nnx.to_pure_dict(grads_scan))
    for (path, g), h in zip(
        jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads_scan)),
        jax.tree.leaves(grads_loop),
    ):
        assert_close(g, h, rtol=1e-5, atol=1e-7, what=jax.tree_util.keystr(path))
    # per-layer residual streams, stacked: what parity.check_logits compares layer by layer
    hidden_states = nnx.jit(lambda m: m.hidden_states(idx)[0])
    states_scan, states_loop = hidden_states(scan), hidden_states(loop)
    assert states_scan.shape == (2, 2, 32, 64)
    for a, b in zip(states_scan, states_loop):
        assert_close(a, b, rtol=1e-6, atol=1e-6, what="hidden states")


def test_one_scanned_layer_computes_what_one_looped_layer_computes():
    loop = GPT(tiny_config(n_layer=1), nnx.Rngs(0))
    scan = GPT(tiny_config(n_layer=1, scan_layers=True), nnx.Rngs(0))
    idx = tokens((2, 32))
    assert_close(scan(idx)[0], loop(idx)[0], rtol=1e-6, atol=1e-6, what="logits")


@pytest.mark.slow
def test_dropout_draws_a_key_per_layer_as_the_loop():
    """The same dropout with the blocks under one scan, and in the loop with each block recomputed
    (remat)."""
    loop = GPT(tiny_config(dropout=0.1), nnx.Rngs(0))
    scan = GPT(tiny_config(dropout=0.1, scan_layers=True), nnx.Rngs(0))
    remat = GPT(tiny_config(dropout=0.1, remat="block"), nnx.Rngs(0))
    idx, key = tokens((2, 32)), jax.random.key(7)
    want = float(loop.loss(idx, idx, key=key))
    assert want != float(loop.loss(idx, idx, key=jax.random.key(8)))  # the key drops units
    for model in (scan, remat):
        assert abs(float(model.loss(idx, idx, key=key)) / want - 1) < 1e-6


@pytest.mark.slow
def test_generation_with_a_scanned_model_equals_the_loop_token_for_token():
    loop = GPT(tiny_config(block_size=48), nnx.Rngs(1))
    scan = GPT(tiny_config(block_size=48, scan_layers=True), nnx.Rngs(1))
    prompt = np.asarray(tokens((3, 5), seed=2))
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=20, key=jax.random.key(3))):
        # 60 tokens: past block_size, where the window slides (the full forward, not the cache)
        np.testing.assert_array_equal(
            scan.generate(prompt, 60, **kw), loop.generate(prompt, 60, **kw)
        )


@pytest.mark.slow
def test_hf_in_scanned_model_export_out_gives_back_the_same_tensors(tmp_path):
    """HF directory -> a scanned model -> a checkpoint -> export.py to HF and to nanoGPT: every
    tensor as it was."""
    hf_dir = save_random_hf_model(
        tmp_path / "hf",
        seed=5,
        n_layer=3,
        n_head=2,
        n_embd=32,
        n_positions=16,
        vocab_size=64,
        activation_function="gelu",
    )  # nanoGPT's exact GELU
    model = GPT.from_pretrained(str(hf_dir), scan_layers=True)
    assert model.h.attn.c_attn.kernel.shape == (3, 32, 96)
    mngr = checkpoint.manager(tmp_path / "run")
    meta = checkpoint.meta_for(model.config, {"dataset": "x"}, 1, 1.0, {})
    checkpoint.save(mngr, 1, nnx.state(model), {"count": np.zeros((), np.int32)}, meta)
    mngr.wait_until_finished()
    mngr.close()
    original = load_file(hf_dir / "model.safetensors")
    assert (
        export.main([f"--out_dir={tmp_path / 'run'}", "--format=hf", f"--to={tmp_path / 'out_hf'}"])
        == 0
    )
    exported = load_file(tmp_path / "out_hf" / "model.safetensors")
    assert exported.keys() == original.keys() - {"lm_head.weight"}
    for k, v in exported.items():
        np.testing.assert_array_equal(v, original[k], err_msg=k)
    assert (
        export.main(
            [f"--out_dir={tmp_path / 'run'}", "--format=nanogpt", f"--to={tmp_path / 'nano'}"]
        )
        == 0
    )
    _, nano, _ = read_nanogpt(str(tmp_path / "nano" / "ckpt.pt"))  # HF's names and layout again
    assert set(nano) == set(exported)
    for k in nano:
        np.testing.assert_array_equal(nano[k], original[k], err_msg=k)


# the other direction in make test-slow (CI runs it)
@pytest.mark.parametrize("saved_scanned", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_checkpoint_restores_into_the_other_layout_bit_for_bit(tmp_path, saved_scanned):
    """Params and Adam's moments saved in one layout come back in the other, each layer's row
    exact."""
    config = tiny_config(scan_layers=saved_scanned)
    tx = train_step.make_optimizer(dict(DEFAULTS))
    model = GPT(config, nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    opt_state = tx.init(params)
    _, opt_state = tx.update(grads, opt_state, params)  # moments that are not zeros
    mngr = checkpoint.manager(tmp_path)
    meta = checkpoint.meta_for(config, {}, 3, 1.0, {})
    checkpoint.save(mngr, 3, params, opt_state, meta)
    mngr.wait_until_finished()
    mngr.close()
    other = tiny_config(scan_layers=not saved_scanned)
    want = relayout_blocks((params, opt_state), checkpoint_templates(other, tx))
    for mesh in (None, sharding.make_mesh()):  # the first device (sample.py's), or train.py's mesh
        got_params, got_opt = checkpoint.restore_state(tmp_path, None, meta, other, tx, mesh)
        assert jax.tree.structure((got_params, got_opt)) == jax.tree.structure(want)
        assert all(
            x.sharding
            == (
                jax.sharding.SingleDeviceSharding(jax.devices()[0])
                if mesh is None
                else jax.sharding.NamedSharding(mesh, x.sharding.spec)
            )
            for x in jax.tree.leaves((got_params, got_opt))
        )
        for a, b in zip(jax.tree.leaves((got_params, got_opt)), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def layer1(params, stacked):  # the MLP's c_fc kernel of layer 1
        return (
            params["h"]["mlp"]["c_fc"]["kernel"][...][1]
            if stacked
            else params["h"][1]["mlp"]["c_fc"]["kernel"][...]
        )

    np.testing.assert_array_equal(
        np.asarray(layer1(got_params, not saved_scanned)), np.asarray(layer1(params, saved_scanned))
    )


def checkpoint_templates(config, tx):
    params = nnx.state(nnx.eval_shape(lambda: GPT(config, nnx.Rngs(0))))
    return params, jax.eval_shape(tx.init, params)


@pytest.mark.slow
def test_training_scanned_takes_the_loops_steps(dataset, tmp_path):
    """train.py's steps with scan_layers: the same losses and grad norms as the loop's (each stacked
    param in the optimizer's groups as its per-layer self: biases and LayerNorms undecayed)."""
    params = {
        sc: nnx.state(GPT(tiny_config(scan_layers=sc), nnx.Rngs(0)), nnx.Param)
        for sc in (False, True)
    }
    groups = {
        sc: {
            (re.sub(r"\.\d+\.", ".", jax.tree_util.keystr(k, simple=True, separator=".")), decays)
            for k, decays in jax.tree_util.tree_leaves_with_path(train_step.decay_mask(p))
        }
        for sc, p in params.items()
    }
    assert groups[True] == groups[False] and ("h.ln_1.scale.value", False) in groups[True]
    logs = {}
    for sc in (False, True):  # the tests' tiny run (the loop's is in the compilation cache)
        train.Trainer(
            settings(dataset, tmp_path / str(sc), "--max_iters=5", f"--scan_layers={sc}")
        ).run()
        with open(tmp_path / str(sc) / "log.jsonl") as f:
            logs[sc] = [(r["loss"], r["grad_norm"]) for r in map(json.loads, f) if "loss" in r]
    assert len(logs[True]) == 5
    for (loss_loop, gnorm_loop), (loss_scan, gnorm_scan) in zip(logs[False], logs[True]):
        assert abs(loss_scan / loss_loop - 1) < 1e-6 and abs(gnorm_scan / gnorm_loop - 1) < 1e-5


def test_scan_layers_setting():
    """train.py's scan_layers: True, False or 'auto' (on TPU, off on GPU and CPU); anything else is
    one line."""
    assert configure(DEFAULTS, ["--scan_layers=True"])["scan_layers"] is True
    assert train.resolve_scan_layers("auto", "tpu") is True
    assert (
        train.resolve_scan_layers("auto", "gpu") is False
        and train.resolve_scan_layers("auto", "cpu") is False
    )
    with pytest.raises(UsageError, match="scan_layers must be True, False or 'auto', got 'maybe'"):
        validate(configure(DEFAULTS, ["--scan_layers=maybe"]))
    with pytest.raises(UsageError, match="scan_layers must be True, False or 'auto', got 1"):
        # an int passes for an 'auto' (--loss_chunk=0), not here
        validate(configure(DEFAULTS, ["--scan_layers=1"]))
    with pytest.raises(ConfigError, match="scan_layers must be str"):
        configure(DEFAULTS, ["--scan_layers=1.5"])
