"""python -m pytest tests/test_numerics.py -q

bf16 numerics that cannot drift silently (docs/model.md: "keeps LayerNorm, softmax, the residual
stream and the loss in float32"): the dtypes of train.py's jitted step in bf16, read off its jaxpr,
forward and backward; and bf16 training within 2x of torch autocast's error against the fp32
reference (docs/parity.md), as a test."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import equations, one_torch_thread, tiny_config

import model as model_lib
from compute import layers
from model import GPT
from parity import check_train, train_report
from run import train_step
from run.settings import DEFAULTS

# what each claim is, found by the source of the equation (every equation of a jaxpr, the backward
# pass's too, keeps the traceback of the Python line that made it): LayerNorm is flax's, softmax
# jax.nn's (attention's), the loss ours
LAYER_NORM = ("flax/nnx/nn/normalization.py", "LayerNorm.__call__")
SOFTMAX = ("jax/_src/nn/functions.py", "softmax")
# the repository's modules: model.py, compute/layers.py, ...
OURS = os.path.dirname(os.path.abspath(model_lib.__file__))
LOSS = (os.path.join(OURS, "compute/layers.py"), "cross_entropy_terms")
BLOCK = (model_lib.__file__, "Block.__call__")  # the residual adds: `x = x + branch(...)`
VOCAB = 97  # the tiny model's vocabulary: no other of its dimensions is 97


def frames(eqn):
    tb = eqn.source_info.traceback
    return [] if tb is None else [(f.file_name, f.function_name, f.line_num) for f in tb.frames]


def made_in(eqn, where):
    """The equation comes from a call of `where` (file suffix, function), at any depth."""
    return any(file.endswith(where[0]) and fn == where[1] for file, fn, _ in frames(eqn))


def our_frame(eqn):
    """The innermost frame in one of the repository's modules (not jax's, flax's): (file, function,
    line)."""
    return next((f for f in frames(eqn) if os.path.dirname(f[0]) == OURS), ("?", "", 0))


def made_directly_in(eqn, where):
    """The equation's innermost frame of ours is `where`: the line itself, not a function it
    calls."""
    file, fn, _ = our_frame(eqn)
    return file.endswith(where[0]) and fn == where[1]


def float_dtypes(eqn):
    return {
        str(v.aval.dtype)
        for v in (*eqn.invars, *eqn.outvars)
        if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)
    }


def line(eqn):
    file, _, num = our_frame(eqn)
    return f"{os.path.basename(file)}:{num}"


def matmul_dtypes(fn, *args):
    """fn's one matmul (a dot_general, at any depth of its jaxpr): ([its operands' dtypes], its
    output's dtype)."""
    (dot,) = [
        e for e in equations(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "dot_general"
    ]
    return [str(v.aval.dtype) for v in dot.invars], str(dot.outvars[0].aval.dtype)


def not_float32(eqns):
    return [
        f"{e.primitive.name} {sorted(float_dtypes(e))} at {line(e)}"
        for e in eqns
        if float_dtypes(e) - {"float32"}
    ]


def bf16_step_jaxpr(**settings):
    """The jaxpr of train.py's step (train_step.on_leaves of make_train_step: what it compiles) for
    a tiny bf16 GPT, 2 micro-batches of 2 rows."""
    graphdef, params = nnx.split(GPT(tiny_config(dtype="bfloat16", **settings), nnx.Rngs(0)))
    tx = train_step.make_optimizer(dict(DEFAULTS))
    opt_state = tx.init(params)
    step = train_step.on_leaves(train_step.make_train_step(graphdef, tx, 1.0), params, opt_state)
    x = jnp.zeros((2, 2, 16), jnp.int32)
    args = jax.tree.leaves(params), jax.tree.leaves(opt_state), x, x, jax.random.key(0)
    return list(equations(jax.make_jaxpr(step)(*args).jaxpr))


# the paths a step takes: a loop of blocks, one scan (train.py's default on a TPU) with the chunked
# loss, remat. (Under scan with remat the traceback of a block's equations stops at the scan: the
# counts below would say so.)
@pytest.mark.parametrize(
    "settings",
    [{}, dict(scan_layers=True, loss_chunk=8), dict(remat="dots"), dict(dropout=0.1)],
    ids=["loop", "scan_layers, loss_chunk", "remat dots", "dropout (explicit attention)"],
)
def test_bf16_step_keeps_layernorm_softmax_residual_and_loss_in_float32(settings):
    """Each claim's equations, forward and backward, have only float32 operands and results; the
    matmuls do run in bf16 (else the test would prove nothing). Planted in model.py,
    LayerNorm(dtype=bf16) (its input rounded to bf16) and a residual stream held in bf16 each fail
    it (tools/plant_bugs.py)."""
    eqns = bf16_step_jaxpr(vocab_size=VOCAB, **settings)
    bf16_dots = [
        e for e in eqns if e.primitive.name == "dot_general" and "bfloat16" in float_dtypes(e)
    ]
    assert len(bf16_dots) >= 4, "the step runs no matmul in bf16: not a bf16 step"

    claims = {
        "LayerNorm": [e for e in eqns if made_in(e, LAYER_NORM)],
        "attention's softmax": [e for e in eqns if made_in(e, SOFTMAX)],
        "the loss": [e for e in eqns if made_in(e, LOSS)],
        "the residual adds": [
            e for e in eqns if e.primitive.name == "add" and made_directly_in(e, BLOCK)
        ],
    }
    # each claim's equations found, so that a renamed function cannot make the test vacuous: ln_1,
    # ln_2 and ln_f (one rsqrt each; a scanned block is traced once), a softmax, logsumexp,
    # attention's and the MLP's adds
    assert sum(e.primitive.name == "rsqrt" for e in claims["LayerNorm"]) >= 3
    assert sum(e.primitive.name == "exp" for e in claims["attention's softmax"]) >= 1
    assert {"log", "exp", "reduce_max"} <= {e.primitive.name for e in claims["the loss"]}
    assert len(claims["the residual adds"]) >= 2
    # the loss takes its logits in bf16, as autocast's cross_entropy does: its only bf16 are the
    # casts of the logits up to float32 and of their gradient back down
    # (test_training_takes_the_logits_in_bf16_...); its arithmetic is float32
    claims["the loss"] = [
        e
        for e in claims["the loss"]
        if not (
            e.primitive.name == "convert_element_type" and e.invars[0].aval.shape[-1:] == (VOCAB,)
        )
    ]
    broken = {claim: bad[:3] for claim, found in claims.items() if (bad := not_float32(found))}
    assert not broken, f"not in float32 (the first 3 equations of each): {broken}"


def test_bf16_linear_layers_give_bf16_with_the_bias_added_in_float32():
    """As torch autocast's: a Linear multiplies in the compute dtype (its float32 kernel cast down)
    and its output is in it; its bias is added in float32 first (a bias of 1 + 2^-9, which bf16
    cannot hold: the sum is rounded once, not twice)."""
    mlp = GPT(tiny_config(dtype="bfloat16"), nnx.Rngs(0)).h[0].mlp
    # split by output columns, and by input rows
    for layer, n_in in ((mlp.c_fc, 64), (mlp.c_proj, 256)):
        assert matmul_dtypes(layer, jnp.ones((1, n_in)))[0] == ["bfloat16"] * 2
    layer = mlp.c_fc
    layer.kernel.set_value(jnp.zeros_like(layer.kernel[...]).at[0, 0].set(1.0))
    layer.bias.set_value(jnp.full_like(layer.bias[...], 1 + 2**-9))
    y = layer(jnp.zeros((1, 64)).at[0, 0].set(2**-8))
    assert y.dtype == jnp.bfloat16
    # 2^-8 + 1 + 2^-9 in float32 rounds once to bf16's 1 + 2^-7; twice (the bias to 1, then 1 +
    # 2^-8, a tie, to 1): 1
    assert float(y[0, 0]) == 1 + 2**-7


def test_the_tied_head_multiplies_in_the_compute_dtype_into_float32_logits():
    """The head's matmul takes bf16 operands (the float32 embedding cast down) and accumulates into
    float32."""
    want = (["bfloat16"] * 2, "float32")
    assert (
        matmul_dtypes(
            functools.partial(layers.tied_head, dtype=jnp.bfloat16),
            jnp.ones((2, 64)),
            jnp.ones((128, 64)),
        )
        == want
    )
    # and the model's logits (sampling's and the scorers') ask for the model's compute dtype
    assert (
        matmul_dtypes(GPT(tiny_config(dtype="bfloat16"), nnx.Rngs(0)).logits, jnp.ones((2, 64)))
        == want
    )


def test_the_bf16_cached_step_takes_scores_and_softmax_in_float32():
    """decode spells attention out for generate's cached steps: bf16 q and k into float32 scores,
    the softmax in float32, its probabilities cast to bf16 for the product with the bf16 values, as
    the full forward's kernel does. The two products are the dot_generals of the scores' shape (B *
    nh, T, S), (4, 1, 24) here."""
    model = GPT(tiny_config(dtype="bfloat16"), nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda idx, cache: model.decode(idx, cache, 3))(
        jnp.zeros((2, 1), jnp.int32), model.init_cache(2, 24)
    )
    eqns = list(equations(jaxpr.jaxpr))
    attention = [
        [str(v.aval.dtype) for v in (*e.invars, *e.outvars)]
        for e in eqns
        if e.primitive.name == "dot_general"
        and (4, 1, 24) in [v.aval.shape for v in (*e.invars, *e.outvars)]
    ]
    assert (
        attention == [["bfloat16", "bfloat16", "float32"], ["bfloat16", "bfloat16", "bfloat16"]] * 2
    ), attention
    softmax = [e for e in eqns if made_in(e, SOFTMAX)]
    assert softmax and not not_float32(softmax), not_float32(softmax)


@pytest.mark.parametrize("settings", [{}, dict(loss_chunk=8)], ids=["whole", "loss_chunk"])
def test_training_takes_the_logits_in_bf16_and_the_heads_gradient_runs_in_bf16(settings):
    """As autocast's Linear: the loss's logits come out of the head in bf16 and are upcast in the
    loss; so the head's two backward matmuls (into the hidden states and into wte) take bf16
    operands. With float32 logits both ran in float32, a fifth of the 124M step on an H100
    (docs/benchmarks.md). The head's matmuls are the dot_generals with a vocabulary-sized
    dimension."""
    eqns = bf16_step_jaxpr(vocab_size=VOCAB, **settings)
    head = [
        e
        for e in eqns
        if e.primitive.name == "dot_general"
        and any(VOCAB in v.aval.shape for v in (*e.invars, *e.outvars))
    ]
    assert len(head) >= 3, "the head's forward matmul and its two backward ones"
    assert all(float_dtypes(e) == {"bfloat16"} for e in head), [
        sorted(float_dtypes(e)) for e in head
    ]


@pytest.mark.slow
def test_the_cross_entropys_own_gradient_is_autodiffs():
    """layers.token_nll's gradient (softmax - onehot, written once in the logits' dtype) against
    autodiff of the same forward, with ignored targets, under vmap (hellaswag.py's scorer) and jit:
    float32 to rounding, bf16 logits to one bf16 rounding of the same float32 value."""

    def by_autodiff(logits, targets):
        x = logits.astype(jnp.float32)
        valid = targets != -1
        nll = (
            jax.nn.logsumexp(x, axis=-1)
            - jnp.take_along_axis(x, jnp.where(valid, targets, 0)[..., None], -1)[..., 0]
        )
        return jnp.sum(jnp.where(valid, nll, 0.0)), jnp.sum(valid)

    # rows 300 apart: each row's logsumexp shifted by its own max (one max for all would underflow
    # the others' exps)
    offsets = jnp.array([0.0, -300.0, 300.0])[:, None, None]
    logits = 3 * jax.random.normal(jax.random.key(0), (3, 5, 11)) + offsets
    targets = jax.random.randint(jax.random.key(1), (3, 5), -1, 11).at[0, 0].set(-1)
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2**-8)):
        z = logits.astype(dtype)
        ours, theirs = (
            jax.jit(jax.value_and_grad(lambda z, f=f: f(z, targets)[0] / 7))(z)
            for f in (layers.cross_entropy_terms, by_autodiff)
        )
        assert ours[1].dtype == dtype and jnp.allclose(ours[0], theirs[0], rtol=1e-6)
        assert jnp.allclose(
            ours[1].astype(jnp.float32), theirs[1].astype(jnp.float32), rtol=tol, atol=1e-7
        )
        assert not jnp.any(ours[1][0, 0])  # an ignored target's position gets no gradient
        ours, theirs = (
            jax.vmap(jax.grad(lambda z, y, f=f: f(z, y)[0]))(z, targets).astype(jnp.float32)
            for f in (layers.cross_entropy_terms, by_autodiff)
        )
        assert jnp.allclose(ours, theirs, rtol=tol, atol=1e-7)

    # as accurate as autodiff's against float64, at logits of scale 5: a softmax taken as exp(x -
    # logsumexp) carries logsumexp's rounding into every probability (5x autodiff's error)
    logits = np.random.default_rng(0).normal(0, 5, (512, 128)).astype(np.float32)
    targets = np.random.default_rng(1).integers(0, 128, 512)
    exact = np.exp(logits - logits.max(-1, keepdims=True).astype(np.float64))
    exact /= exact.sum(-1, keepdims=True)
    exact[np.arange(512), targets] -= 1
    ours, theirs = (
        np.asarray(jax.grad(lambda z, f=f: f(z, jnp.asarray(targets))[0])(jnp.asarray(logits)))
        for f in (layers.cross_entropy_terms, by_autodiff)
    )
    error = [np.linalg.norm(g - exact) / np.linalg.norm(exact) for g in (ours, theirs)]
    assert error[0] <= 1.5 * error[1], error


@pytest.fixture
def one_thread():
    # the tiny model on 2 shared cores: one thread is faster (test_check_train)
    with one_torch_thread():
        yield


@pytest.mark.slow
def test_bf16_training_is_within_2x_of_torch_autocast(tmp_path, one_thread, capsys):
    """docs/parity.md's bf16 training row, on the tiny random GPT-2 for 10 steps: ours in bf16 and
    torch autocast-bf16, each against torch fp32 from the same weights on the same batches; our mean
    |Δloss|/loss, mean |Δgnorm|/gnorm and worst ||Δparam||/||param|| at most
    train_report.BF16_FACTOR (2) times autocast's."""
    check_train.pin_numerics()
    run = check_train.make_run(
        check_train.parse_args(["--steps", "10", "--batch-size", "16"]), str(tmp_path)
    )
    ok, figures = check_train.check(run, "bfloat16")
    assert ok and "bf16 training parity" in capsys.readouterr().out
    ours, autocast = figures["jax bf16"], figures["torch autocast-bf16"]
    assert train_report.BF16_FACTOR == 2.0  # the documented bar
    for k in train_report.BF16_JUDGED:
        # > 0: it really ran in bf16
        assert 0 < ours[k] <= 2.0 * autocast[k], (k, ours[k], autocast[k])
    assert ours["lr_rel"] <= train_report.LR_TOL
