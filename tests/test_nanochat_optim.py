"""python -m pytest tests/test_nanochat_optim.py -q

nanochat's MuonAdamW (archs/nanochat_optim.py) against its torch reference written from
nanochat/optim.py (parity/nanochat_optim_reference.py), on a tiny nanochat-shaped param tree (3
layers, width 32, one KV head: square, wide and tall matrices, ve_gate in layers 0 and 2, all six
AdamW groups), six steps with random gradients, the run's schedules moving the rate, Muon's
momentum (warmup and warmdown) and its cautious weight decay between steps. With
NANOCHAT_CHECKOUT=/path/to/nanochat, the same steps against nanochat's own MuonAdamW, its groups
from its own GPT.setup_optimizer on a GPT holding the same values (its fused steps run eagerly:
torch.compile's CPU build takes minutes and computes the same float32 arithmetic)."""

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from helpers import one_torch_thread

from archs import nanochat_optim as ours
from parity import nanochat_optim_reference as reference

N_LAYER, N_EMBD, N_HEAD, N_KV_HEAD, VOCAB = 3, 32, 2, 1, 128  # VOCAB: already a multiple of 64
RATES = dict(unembedding_lr=0.008, embedding_lr=0.3, matrix_lr=0.02, scalar_lr=0.5)  # base_train's
WEIGHT_DECAY = 0.28
# a 6-step run whose schedules turn within it: warmup 2, warmdown from step 3, momentum warmup 3
RUN = dict(num_iterations=6, warmup_steps=2, warmdown_ratio=0.5, final_lr_frac=0.05)
MOMENTUM_WARMUP = 3
# Each param against the other side: within two float32 roundings of its largest value (each side
# rounds the param once a step) plus 1e-5 of the distance it moved (float32 error through Polar
# Express's matmuls); the largest diff seen, ours or the reference's against nanochat's own, is a
# third of this
EPS32 = float(np.finfo(np.float32).eps)
MOVED_TOL = 1e-5


def has_ve(i):
    """nanochat's layers with a value embedding: alternating, the last always."""
    return i % 2 == (N_LAYER - 1) % 2


def nanochat_shapes():
    """{nanochat's state-dict name: torch shape} of a GPT of this test's size."""
    head_dim, kv = N_EMBD // N_HEAD, N_KV_HEAD * N_EMBD // N_HEAD
    shapes = {"transformer.wte.weight": (VOCAB, N_EMBD)}
    for i in range(N_LAYER):
        layer = {
            "attn.c_q": (N_HEAD * head_dim, N_EMBD),
            "attn.c_k": (kv, N_EMBD),
            "attn.c_v": (kv, N_EMBD),
            "attn.c_proj": (N_EMBD, N_EMBD),
            **({"attn.ve_gate": (N_KV_HEAD, 12)} if has_ve(i) else {}),
            "mlp.c_fc": (4 * N_EMBD, N_EMBD),
            "mlp.c_proj": (N_EMBD, 4 * N_EMBD),
        }
        shapes |= {f"transformer.h.{i}.{k}.weight": s for k, s in layer.items()}
    shapes |= {"lm_head.weight": (VOCAB, N_EMBD), "resid_lambdas": (N_LAYER,)}
    shapes |= {"x0_lambdas": (N_LAYER,), "smear_gate.weight": (1, 24)}
    shapes |= {"smear_lambda": (1,), "backout_lambda": (1,)}
    return shapes | {f"value_embeds.{i}.weight": (VOCAB, kv) for i in range(N_LAYER) if has_ve(i)}


def our_path(name):
    """nanochat's name -> our path: the nnx attributes mirror it, Linear weights as (in, out)
    kernels, Embedding weights as embeddings."""
    names = name.removeprefix("transformer.").split(".")
    if names[-1] == "weight":
        names[-1] = "embedding" if names[0] in ("wte", "value_embeds") else "kernel"
    return names


def to_tree(named):
    """{nanochat's name: array} -> our nested dict, kernels transposed."""
    tree = {}
    for name, a in named.items():
        *parents, leaf = our_path(name)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(a.T if leaf == "kernel" else a)
    return tree


def leaf(tree, name):
    """The leaf of nanochat's `name` in our nested dict."""
    for key in our_path(name):
        tree = tree[key]
    return tree


def from_tree(tree):
    """Our nested dict -> {nanochat's name: numpy array in torch's layout}."""
    named = {name: np.asarray(leaf(tree, name)) for name in nanochat_shapes()}
    return {n: a.T if our_path(n)[-1] == "kernel" else a for n, a in named.items()}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def start():
    """Random params ({name: float32 array}, matrices at 1/sqrt(fan_in)) and six random
    gradients."""
    rng = np.random.default_rng(0)
    shapes = nanochat_shapes()
    draw = lambda s, scale: (rng.normal(size=s) * scale).astype(np.float32)  # noqa: E731
    params = {n: draw(s, 0.5 if len(s) < 2 else s[-1] ** -0.5) for n, s in shapes.items()}
    grads = [{n: draw(s, 1.0) for n, s in shapes.items()} for _ in range(6)]
    return params, grads


def base_train_schedules(it):
    """(lr multiplier, Muon momentum, Muon weight decay) at `it`: base_train's formulas, written
    here in float64 for RUN (its momentum warmup MOMENTUM_WARMUP steps in place of 400)."""
    n, warmdown = RUN["num_iterations"], round(RUN["warmdown_ratio"] * RUN["num_iterations"])
    if it < RUN["warmup_steps"]:
        lrm = (it + 1) / RUN["warmup_steps"]
    elif it <= n - warmdown:
        lrm = 1.0
    else:
        progress = (n - it) / warmdown
        lrm = progress + (1 - progress) * RUN["final_lr_frac"]
    if it < MOMENTUM_WARMUP:
        momentum = (1 - it / MOMENTUM_WARMUP) * 0.85 + it / MOMENTUM_WARMUP * 0.97
    elif it >= n - warmdown:
        progress = (it - (n - warmdown)) / warmdown
        momentum = 0.97 * (1 - progress) + 0.90 * progress
    else:
        momentum = 0.97
    return lrm, momentum, WEIGHT_DECAY * 0.5 * (1 + math.cos(math.pi * it / n))


def run_ours(params, grads):
    """Our optimizer jitted, a step per gradient -> each step's params, by nanochat's names."""
    rates = ours.group_rates(N_EMBD, **RATES)
    run = dict(RUN, momentum_warmup=MOMENTUM_WARMUP)
    num_iterations = run.pop("num_iterations")
    tx = ours.muon_adamw(rates, *ours.schedules(num_iterations, WEIGHT_DECAY, **run))
    tree = to_tree(params)
    state, update = tx.init(tree), jax.jit(tx.update)
    steps = []
    for g in grads:
        updates, state = update(to_tree(g), state, tree)
        tree = optax.apply_updates(tree, updates)
        steps.append(from_tree(tree))
    return steps


def run_torch(optimizer, named, grads):
    """A torch MuonAdamW over `named` (torch params), each step's hyperparameters set as
    base_train's loop sets them -> each step's params."""
    steps = []
    for it, g in enumerate(grads):
        for name, p in named.items():
            p.grad = torch.tensor(g[name])
        lrm, momentum, weight_decay = base_train_schedules(it)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"], group["weight_decay"] = momentum, weight_decay
        optimizer.step()
        steps.append({n: p.detach().numpy().copy() for n, p in named.items()})
    return steps


def assert_steps_close(actual, expected, start, what):
    """Every param at every step within two float32 roundings of its size plus MOVED_TOL of the
    distance it moved."""
    for it, (a_step, e_step) in enumerate(zip(actual, expected, strict=True)):
        for name, e in e_step.items():
            moved = np.abs(e - start[name]).max()
            tol = 2 * EPS32 * np.abs(e).max() + MOVED_TOL * moved
            diff = np.abs(a_step[name] - e).max()
            assert diff <= tol, f"{what}: step {it} {name}: |diff| {diff:.3g} > {tol:.3g}"


def test_labels_put_every_param_in_its_nanochat_group(start):
    tree = ours.param_labels(to_tree(start[0]))
    labels = {name: leaf(tree, name) for name in nanochat_shapes()}
    expect = {"transformer.wte.weight": "embedding", "lm_head.weight": "lm_head"}
    expect |= {"resid_lambdas": "resid", "x0_lambdas": "x0", "smear_gate.weight": "smear"}
    expect |= {"smear_lambda": "smear", "backout_lambda": "smear"}
    for name in nanochat_shapes():
        if name.startswith("transformer.h."):
            expect[name] = "muon"
        elif name.startswith("value_embeds."):
            expect[name] = "value_embeds"
    assert labels == expect
    with pytest.raises(ValueError, match="ln_f.scale is in none"):
        ours.param_labels({"ln_f": {"scale": jnp.ones(3)}})
    with pytest.raises(ValueError, match="not a matrix"):
        ours.param_labels({"h": [{"norm": {"scale": jnp.ones(3)}}]})


def test_labels_read_an_nnx_state():
    """An nnx model's state (Variables, nnx.List, nnx.Dict) labels as a plain dict does."""

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.wte = nnx.Embed(8, 4, rngs=rngs)
            self.h = nnx.List([nnx.Dict(c_fc=nnx.Linear(4, 16, use_bias=False, rngs=rngs))])
            self.value_embeds = nnx.Dict({"0": nnx.Embed(8, 4, rngs=rngs)})
            self.x0_lambdas = nnx.Param(jnp.zeros(1))

    labels = ours.param_labels(nnx.state(Tiny(nnx.Rngs(0)), nnx.Param))
    assert labels["h"][0]["c_fc"]["kernel"].get_value() == "muon"
    assert labels["value_embeds"]["0"]["embedding"].get_value() == "value_embeds"
    assert labels["x0_lambdas"].get_value() == "x0"


def test_second_moment_takes_torch_orientation():
    """NorMuon's buffer: per row of torch's (out, in) when out >= in, else per column; our
    (in, out) kernels hold it transposed."""
    tx = ours.nanochat_muon(lambda c: 0.02, lambda c: 0.95, lambda c: 0.0)
    kernels = {"tall": jnp.ones((32, 128)), "wide": jnp.ones((128, 32)), "square": jnp.ones((8, 8))}
    second = tx.init(kernels).second_moment
    # torch: tall (128, 32) -> (128, 1); wide (32, 128) -> (1, 128); square (8, 8) -> (8, 1);
    # ours, each transposed
    assert {k: v.shape for k, v in second.items()} == {
        "tall": (1, 128),
        "wide": (128, 1),
        "square": (1, 8),
    }


@pytest.mark.slow
def test_stacked_blocks_step_as_each_layer_alone():
    """scan_layers' stacked kernels (n_layer, in, out): each layer's update as its own leaf's;
    AdamW keeps a bfloat16 table (nanochat's embeddings on a bf16 GPU) and its state bfloat16."""
    key = jax.random.key(1)
    layers = [jax.random.normal(k, (32, 128)) / 8 for k in jax.random.split(key, 3)]
    grads = [jax.random.normal(k, (32, 128)) for k in jax.random.split(jax.random.key(2), 3)]
    wte = jax.random.normal(key, (16, 8)).astype(jnp.bfloat16)
    tx = ours.muon_adamw(ours.group_rates(32, 0.008, 0.3, 0.02, 0.5), *ours.schedules(10, 0.2))
    stacked = {"h": {"mlp": {"c_proj": {"kernel": jnp.stack(layers)}}}, "wte": {"embedding": wte}}
    updates, state = jax.jit(tx.update)(
        {"h": {"mlp": {"c_proj": {"kernel": jnp.stack(grads)}}}, "wte": {"embedding": wte}},
        tx.init(stacked),
        stacked,
    )
    for i, (p, g) in enumerate(zip(layers, grads)):
        one = {"h": [{"mlp": {"c_proj": {"kernel": p}}}]}
        alone, _ = tx.update({"h": [{"mlp": {"c_proj": {"kernel": g}}}]}, tx.init(one), one)
        np.testing.assert_allclose(
            updates["h"]["mlp"]["c_proj"]["kernel"][i],
            alone["h"][0]["mlp"]["c_proj"]["kernel"],
            rtol=1e-6,
            atol=1e-9,  # the same float32 arithmetic, batched or not
        )
    assert optax.apply_updates(stacked, updates)["wte"]["embedding"].dtype == jnp.bfloat16
    dtypes = {x.dtype for x in jax.tree.leaves(state) if x.shape == wte.shape}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}


@pytest.fixture(scope="module")
def reference_steps(start):
    """The torch reference's six steps from `start`."""
    params, grads = start
    named = {n: torch.nn.Parameter(torch.tensor(a)) for n, a in params.items()}
    groups = reference.param_groups(named, weight_decay=WEIGHT_DECAY, **RATES)
    return run_torch(reference.MuonAdamW(groups), named, grads)


def test_steps_equal_the_reference(start, reference_steps):
    params, grads = start
    assert_steps_close(run_ours(params, grads), reference_steps, params, "ours vs reference")


@pytest.mark.parametrize(
    "broken",
    [
        ("cautious_decay", lambda g, param, lr, wd: lr * wd * param),  # every param decays
        ("update_scale", lambda rows, cols: 1.0),  # c_fc's rate not doubled
    ],
    ids=["no-caution", "no-shape-scale"],
)
def test_the_check_catches_a_broken_muon(start, reference_steps, broken, monkeypatch):
    """One step of ours with Muon's caution or its shape scale removed lands outside the
    tolerance of the reference's (the check can fail)."""
    params, grads = start
    monkeypatch.setattr(ours, *broken)
    with pytest.raises(AssertionError, match="transformer.h"):
        assert_steps_close(run_ours(params, grads[:1]), reference_steps[:1], params, broken[0])


def test_bfloat16_polar_express_stays_near_float32():
    """COMPUTE_DTYPE bf16 (CUDA sm80+): Polar Express in bfloat16, within bfloat16's error of the
    float32 result on a tall, a wide and a square matrix, and not equal to it."""
    key = jax.random.key(0)
    for shape in ((128, 32), (32, 128), (32, 32)):
        g = jax.random.normal(key, shape)
        f32 = ours.polar_express(g, dtype=jnp.float32)
        bf16 = ours.polar_express(g, dtype=jnp.bfloat16)
        rel = float(jnp.abs(bf16 - f32).max() / jnp.abs(f32).max())
        assert 0 < rel < 5e-2, (shape, rel)


def nanochat_checkout():
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip(
            "nanochat's own MuonAdamW: set NANOCHAT_CHECKOUT to a karpathy/nanochat checkout"
        )
    sys.path.insert(0, checkout)
    return checkout


def test_steps_equal_nanochat_own(start):
    nanochat_checkout()
    from nanochat import gpt

    params, grads = start
    config = gpt.GPTConfig(
        sequence_len=32,
        vocab_size=VOCAB,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_kv_head=N_KV_HEAD,
        n_embd=N_EMBD,
        window_pattern="L",
    )
    model = gpt.GPT(config)
    named = dict(model.named_parameters())
    assert {n: tuple(p.shape) for n, p in named.items()} == nanochat_shapes()
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(torch.tensor(params[name]))
    optimizer = model.setup_optimizer(weight_decay=WEIGHT_DECAY, **RATES)
    rates = ours.group_rates(N_EMBD, **RATES)
    kinds = [g["kind"] for g in optimizer.param_groups]
    assert [g["initial_lr"] for g in optimizer.param_groups] == [
        rates[k] for k in ours.ADAM_GROUPS
    ] + [rates["muon"]] * kinds.count("muon")
    with torch.compiler.set_stance("force_eager"):
        own = run_torch(optimizer, named, grads)
    assert_steps_close(run_ours(params, grads), own, params, "ours vs nanochat")
    mine = {n: torch.nn.Parameter(torch.tensor(a)) for n, a in params.items()}
    groups = reference.param_groups(mine, weight_decay=WEIGHT_DECAY, **RATES)
    assert_steps_close(run_torch(reference.MuonAdamW(groups), mine, grads), own, params, "ref")
