"""python -m pytest tests/test_model.py -q

The GPT-2 model: init, tying, the fusion barrier, loss, dropout, LayerNorm, bf16 compute, parameter
counts and crop, tokenizer, and bad config and input (its logits against transformers:
test_logits.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import assert_close, tiny_config

from archs.models import build, check_config
from compute import layers
from compute.layers import dropout
from configurator import UsageError
from dataio.tokenizer import get_encoding
from model import GPT, GPTConfig, cross_entropy, layer_norm
from run.settings import resolve_dtype


def test_init_statistics():
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=4, n_head=4, n_embd=128)
    model = GPT(config, nnx.Rngs(0))
    proj_std = 0.02 / math.sqrt(2 * config.n_layer)
    for block in model.h:
        for layer, std in [
            (block.attn.c_attn, 0.02),
            (block.mlp.c_fc, 0.02),
            (block.attn.c_proj, proj_std),
            (block.mlp.c_proj, proj_std),
        ]:
            k = np.asarray(layer.kernel[...])
            assert abs(k.std() - std) < 0.05 * std and abs(k.mean()) < 0.05 * std
            assert not np.asarray(layer.bias[...]).any()
        for ln in (block.ln_1, block.ln_2):
            assert (np.asarray(ln.scale[...]) == 1).all() and not np.asarray(ln.bias[...]).any()
            assert ln.epsilon == 1e-5
    for emb in (model.wte, model.wpe):
        assert abs(np.asarray(emb.embedding[...]).std() - 0.02) < 0.001
    assert model.ln_f.epsilon == 1e-5


def test_head_is_tied_to_wte_and_its_gradient_gets_both_contributions():
    model = GPT(tiny_config(), nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(params)}
    assert not any("lm_head" in n for n in names)
    assert model.num_params(non_embedding=False) == sum(x.size for x in jax.tree.leaves(params))

    idx = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    grads = nnx.jit(nnx.grad(lambda m: m(idx, idx)[1]))(model)  # op by op: ~10x the time
    tied = np.asarray(grads["wte"]["embedding"][...])

    # untie by hand: gradient through the embedding lookup and through the head, separately
    def loss_untied(w_embed, w_head):
        x = jnp.take(w_embed, idx, axis=0) + model.wpe(jnp.arange(idx.shape[1]))
        for block in model.h:
            x = block(x)
        return cross_entropy(model.ln_f(x) @ w_head.T, idx)

    w = model.wte.embedding[...]
    g_embed, g_head = jax.jit(jax.grad(loss_untied, argnums=(0, 1)))(w, w)
    assert np.abs(g_embed).max() > 0 and np.abs(g_head).max() > 0
    assert_close(tied, g_embed + g_head, atol=1e-7, what="tied wte grad")


def test_fusion_barrier_keeps_gradients_and_survives_xla():
    """layers.fusion_barrier_in_grad: the same gradients (to float32 rounding: fusion reorders some
    sums), and XLA:CPU keeps its conditional (one per block) in the compiled backward; if a new XLA
    folded it away, training would silently slow down."""
    model = GPT(tiny_config(), nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    grad_fn = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p)(idx, idx)[1]))
    with_barrier = jax.tree.leaves(grad_fn(params))
    assert grad_fn.lower(params).compile().as_text().count(" conditional(") == model.config.n_layer

    original = layers.fusion_barrier_in_grad
    layers.fusion_barrier_in_grad = lambda x: x
    try:
        without = jax.tree.leaves(
            jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p)(idx, idx)[1]))(params)
        )
    finally:
        layers.fusion_barrier_in_grad = original
    for a, b in zip(with_barrier, without):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=0, atol=1e-6 * np.abs(np.asarray(b)).max()
        )


def test_loss_equals_direct_cross_entropy_with_ignore_index():
    model = GPT(tiny_config(), nnx.Rngs(0))
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 128, (2, 16))
    targets = rng.integers(0, 128, (2, 16))
    targets[0, :5] = -1
    targets[1, -3:] = -1
    logits, loss = model(jnp.asarray(idx), jnp.asarray(targets))
    ref = torch.nn.functional.cross_entropy(
        torch.from_numpy(np.array(logits)).view(-1, 128),
        torch.from_numpy(targets).view(-1),
        ignore_index=-1,
    )
    assert_close(loss, ref.item(), rtol=1e-6, what="loss")
    assert logits.shape == (2, 16, 128) and logits.dtype == jnp.float32
    # a single target left: its own cross-entropy, not a share of it
    one = np.full_like(targets, -1)
    one[1, 7] = targets[1, 7]
    ref = torch.nn.functional.cross_entropy(
        torch.from_numpy(np.array(logits[1, 7])), torch.tensor(targets[1, 7])
    )
    assert_close(
        model(jnp.asarray(idx), jnp.asarray(one))[1],
        ref.item(),
        rtol=1e-6,
        what="loss of one target",
    )


def test_padded_vocab_model_from_scratch_trains_a_step():
    model = GPT(tiny_config(vocab_size=50304), nnx.Rngs(0))
    idx, targets = jnp.asarray(np.random.default_rng(0).integers(0, 50257, (2, 2, 32)))
    # jitted, as training runs it: op by op it compiles ~160 times
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: m(idx, targets)[1]))(model)
    assert abs(float(loss) - math.log(50304)) < 0.1  # ~uniform at init
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_bf16_compute_keeps_float32_params_and_logits():
    config = tiny_config(dtype="bfloat16")
    model = GPT(config, nnx.Rngs(0))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    logits, loss = model(idx, idx)
    assert logits.dtype == jnp.float32
    fp32 = GPT(tiny_config(), nnx.Rngs(0))
    ref, ref_loss = fp32(idx, idx)
    diff = np.abs(np.asarray(logits) - np.asarray(ref)).max()
    # bf16 rounding, not a different function
    assert 0 < diff < 0.05 * np.abs(np.asarray(ref)).max()
    assert abs(float(loss) - float(ref_loss)) < 0.02


def zero_out(linear):
    """A Linear that outputs zeros: a block's branch through it adds nothing to the residual
    stream."""
    for p in (linear.kernel, linear.bias):
        p.set_value(jnp.zeros_like(p[...]))


def test_dropout_uses_the_key_and_eval_is_deterministic():
    model = GPT(tiny_config(dropout=0.1), nnx.Rngs(0))
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    a, b = model(idx)[0], model(idx)[0]
    np.testing.assert_array_equal(a, b)
    k1, k2 = model(idx, key=jax.random.key(1))[0], model(idx, key=jax.random.key(1))[0]
    np.testing.assert_array_equal(k1, k2)
    assert np.abs(np.asarray(k1) - np.asarray(a)).max() > 1e-3
    assert np.abs(np.asarray(model(idx, key=jax.random.key(2))[0]) - np.asarray(k1)).max() > 1e-3
    # training's path (the loss without the logits) drops the same units for the same key
    targets = jnp.roll(idx, -1, axis=1)
    trained, evaluated = model.loss(idx, targets, key=jax.random.key(1)), model.loss(idx, targets)
    np.testing.assert_allclose(trained, model(idx, targets, key=jax.random.key(1))[1], rtol=1e-6)
    np.testing.assert_allclose(evaluated, model(idx, targets)[1], rtol=1e-6)
    assert abs(float(trained) - float(evaluated)) > 1e-4
    # each branch drops units with its key: with one branch's output projection zeroed, the key
    # still changes a block's output, through the other's dropout
    x = jax.random.normal(jax.random.key(3), (2, 16, 64))
    for zeroed in ("attn", "mlp"):
        block = GPT(tiny_config(dropout=0.1), nnx.Rngs(0)).h[0]
        zero_out(getattr(block, zeroed).c_proj)
        assert np.abs(np.asarray(block(x, jax.random.key(1)) - block(x))).max() > 1e-3, zeroed


def test_dropout_is_inverted_dropout_in_the_inputs_dtype():
    """torch's F.dropout: each unit zeroed with probability rate, the kept ones scaled by 1 / (1 -
    rate), so that the mean is unchanged; in x's dtype."""
    out = dropout(jnp.ones((100, 1000), jnp.bfloat16), 0.25, jax.random.key(0))
    y = np.asarray(out, np.float32)
    assert out.dtype == jnp.bfloat16 and set(np.unique(y)) == {0.0, float(jnp.bfloat16(4 / 3))}
    # 100,000 draws: 3.7 standard deviations (0.0014 each)
    assert abs((y == 0).mean() - 0.25) < 0.005


def test_the_embeddings_are_dropped():
    """nanoGPT's transformer.drop(tok_emb + pos_emb): with every branch's output projection zeroed
    the blocks add nothing, so the residual stream after the first block is the dropped embedding,
    each unit 0 or x / (1 - p)."""
    model = GPT(tiny_config(dropout=0.5), nnx.Rngs(0))
    for block in model.h:
        zero_out(block.attn.c_proj)
        zero_out(block.mlp.c_proj)
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)))
    dropped = np.asarray(model.hidden_states(idx, key=jax.random.key(0))[0][0])
    x, kept = np.asarray(model.embed(idx, jnp.arange(16))), dropped != 0
    assert 0.45 < kept.mean() < 0.55 and np.allclose(dropped[kept], 2 * x[kept], rtol=1e-6)


def test_attention_drops_its_probabilities_as_well_as_its_output():
    """As torch's GPT-2 (attn_dropout, then resid_dropout): with dropout and a key, attention's
    probabilities are dropped too. One position (its probability 1) and the output projection the
    identity: each unit left is v / (1 - p)^2, dropped and scaled twice; with only the output's
    dropout it would be v / (1 - p)."""
    attn = GPT(tiny_config(dropout=0.5), nnx.Rngs(0)).h[0].attn
    attn.c_proj.kernel.set_value(jnp.eye(64))
    attn.c_proj.bias.set_value(jnp.zeros(64))
    x = jax.random.normal(jax.random.key(0), (1, 1, 64))
    v = np.asarray(attn.qkv(x)[2]).reshape(64)
    y = np.stack([np.asarray(attn(x, jax.random.key(seed))).reshape(64) for seed in range(8)])
    kept = y != 0
    assert kept.sum() > 50 and np.allclose(
        y[kept], np.broadcast_to(4 * v, y.shape)[kept], rtol=1e-6
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(n_head=3), r"n_embd=64 must be divisible by n_head=3"),
        (dict(dtype="float16"), r"dtype must be 'float32' or 'bfloat16', got 'float16'"),
        (dict(gelu="relu"), r"gelu must be 'tanh' \(GPT-2\) or 'exact' \(nanoGPT\), got 'relu'"),
        (
            dict(attention="flash2"),
            r"attention must be one of 'auto', 'xla', 'cudnn', 'splash', 'flash', got 'flash2'",
        ),
        (dict(remat="all"), r"remat must be one of 'none', 'block', 'dots', 'qkv_proj', got 'all'"),
        (dict(loss_chunk=-1), r"loss_chunk must be >= 0, an integer \(0: no chunks\), got -1"),
        (dict(loss_chunk=2.0), r"loss_chunk must be >= 0, an integer \(0: no chunks\), got 2.0"),
        (dict(scan_layers="yes"), r"scan_layers must be True or False, got 'yes'"),
    ],
)
def test_a_bad_model_config_is_one_line_naming_the_choices(settings, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        tiny_config(**settings)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(), r"arch='speedrun' has no biases \(modded-nanogpt's record 5\): set bias=False"),
        (
            dict(bias=False, n_embd=60, n_head=4),
            r"arch='speedrun' rotates the halves of each head: the head size n_embd / n_head must "
            r"be even, got 15",
        ),
    ],
)
def test_a_config_records_model_cannot_take_is_one_line(settings, message):
    """What record 5 adds to GPTConfig's checks (record5.Record5GPT.check_config): the
    settings check, and building the model refuses too."""
    config = tiny_config(arch="speedrun", **settings)
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_config(config)
    with pytest.raises(ValueError, match=f"^{message}$"):
        build(config, nnx.Rngs(0))


def test_the_model_configs_bounds_are_accepted():
    """The least values each check takes: a head size of 2 for speedrun's halves, of 1 for GPT-2's,
    no loss chunks."""
    for settings in (
        dict(arch="speedrun", bias=False, n_head=32),
        dict(loss_chunk=0),
        dict(loss_chunk=1),
        dict(scan_layers=True),
        dict(gelu="exact"),
        dict(dtype="bfloat16"),
        dict(n_head=64),
    ):
        assert all(getattr(tiny_config(**settings), k) == v for k, v in settings.items())


def test_layer_norm_is_torchs_with_gpt2s_eps_and_the_two_pass_variance():
    """torch's LayerNorm (eps 1e-5), its variance the mean of the squared deviations: nnx's default,
    E[x^2] - E[x]^2, loses it to cancellation on rows with a large mean (the first), eps shows on a
    row of tiny variance (the second). With bias=False it has no bias, as nanoGPT's."""
    rng = np.random.default_rng(0)
    x = (np.array([[1000.0], [0.0]]) + np.array([[1.0], [1e-3]]) * rng.normal(size=(2, 64))).astype(
        np.float32
    )
    weight, bias = (rng.normal(size=64).astype(np.float32) for _ in range(2))
    ln = layer_norm(tiny_config(), nnx.Rngs(0))
    ln.scale.set_value(jnp.asarray(weight))
    ln.bias.set_value(jnp.asarray(bias))
    want = torch.nn.functional.layer_norm(
        torch.from_numpy(x), (64,), torch.from_numpy(weight), torch.from_numpy(bias), eps=1e-5
    ).numpy()
    assert_close(ln(jnp.asarray(x)), want, atol=2e-3, what="LayerNorm")
    assert ln(jnp.asarray(x)).dtype == jnp.float32
    assert sorted(nnx.state(layer_norm(tiny_config(bias=False), nnx.Rngs(0)), nnx.Param)) == [
        "scale"
    ]


def test_a_dtype_setting_names_the_choices():
    assert [resolve_dtype("auto", p) for p in ("cpu", "gpu", "tpu")] == [
        "float32",
        "bfloat16",
        "bfloat16",
    ]
    with pytest.raises(
        UsageError, match=r"^dtype must be 'auto', 'float32' or 'bfloat16', got 'float16'$"
    ):
        resolve_dtype("float16", "cpu")


def test_num_params_and_crop():
    # GPT-2 124M as HF counts it (124,439,808), and nanoGPT's "123.65M" without the position
    # embeddings
    gpt2 = nnx.eval_shape(lambda: GPT(GPTConfig(vocab_size=50257), nnx.Rngs(0)))
    assert (gpt2.num_params(non_embedding=False), gpt2.num_params()) == (124_439_808, 123_653_376)
    # the FLOPs behind the MFU train.py logs: nanoGPT's estimate_mfu, 6N + 12·L·H·Q·T, at block_size
    # 1024
    assert gpt2.flops_per_token() == 6 * 123_653_376 + 12 * 12 * 12 * 64 * 1024 == 855_166_464
    model = GPT(tiny_config(), nnx.Rngs(0))
    # by hand: wte 128x64, wpe 32x64, ln_f 2x64; a block: 2 LayerNorms 4x64, c_attn 64x192+192,
    # attn.c_proj 64x64+64, c_fc 64x256+256, mlp.c_proj 256x64+64
    block = 4 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    assert (
        model.num_params(non_embedding=False) == 128 * 64 + 32 * 64 + 2 * 64 + 2 * block == 110_336
    )
    assert model.num_params() == 110_336 - 32 * 64
    # bias=False (nanoGPT's option): no Linear or LayerNorm biases, 5 LayerNorms of 64 and a block's
    # 576
    assert (
        GPT(tiny_config(bias=False), nnx.Rngs(0)).num_params(non_embedding=False)
        == 110_336 - 5 * 64 - 2 * 576
    )
    # its own block size: nothing to crop, as nanoGPT's `assert block_size <= ...`
    model.crop_block_size(32)
    assert model.config.block_size == 32 and model.wpe.embedding.shape == (32, 64)
    model.crop_block_size(16)
    assert (
        model.config.block_size == 16
        and model.wpe.embedding.shape == (16, 64)
        and model.wpe.num_embeddings == 16
    )
    idx = jnp.zeros((1, 16), jnp.int32)
    assert model(idx)[0].shape == (1, 16, 128)
    with pytest.raises(ValueError, match="block_size"):
        model(jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="cannot grow"):
        model.crop_block_size(64)


def test_token_ids_outside_the_vocabulary_are_rejected():
    model = GPT(tiny_config(), nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 128\)"):
        model(jnp.asarray([[1, 2, 128]]))
    with pytest.raises(ValueError, match=r"^token ids must be in \[0, 128\), got min -1, max 2$"):
        model(jnp.asarray([[-1, 2]]))
    for idx, message in [
        (
            jnp.zeros(4, jnp.int32),
            r"^expected token ids of shape \(batch, time\), got shape \(4,\)$",
        ),
        (
            jnp.zeros((1, 33), jnp.int32),
            r"^cannot forward a sequence of length 33: block_size is 32$",
        ),
        (jnp.zeros((1, 3)), r"^token ids must be integers, got float32$"),
    ]:
        with pytest.raises(ValueError, match=message):
            model(idx)


def test_tokenizer_known_ids_and_round_trip():
    enc = get_encoding()
    assert enc.encode_ordinary("Hello, I'm a language model,") == [
        15496,
        11,
        314,
        1101,
        257,
        3303,
        2746,
        11,
    ]
    assert enc.eot_token == 50256 and enc.n_vocab == 50257
    text = "First Citizen:\nBefore we proceed any further, hear me speak. ünïcödé 🤖  "
    text += "tabs\tand  spaces"
    assert enc.decode(enc.encode_ordinary(text)) == text
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
