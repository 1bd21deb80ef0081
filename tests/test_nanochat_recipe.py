"""python -m pytest tests/test_nanochat_recipe.py -q

nanochat's depth dial (archs/nanochat_recipe.py) and its schedules (archs/nanochat_optim.py)
against base_train's: the widths, scaling params and batch sizes nanochat's own docs state
(dev/LOG.md) for depths 8 to 50; the schedules at chosen steps against base_train's formulas
written here in float64; the rules' edges. With NANOCHAT_CHECKOUT=/path/to/nanochat, every figure
for depths 12, 20 and 26 (and runs given num_iterations, target_flops, a batch, several devices)
against base_train.py's own statements, run on nanochat's own GPT built on the meta device, and
the schedules against its own get_lr_multiplier, get_muon_momentum and get_weight_decay."""

import math
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from archs import nanochat_optim, nanochat_recipe
from configurator import UsageError

# float32 schedules against float64 formulas: a few roundings of values <= 1
SCHEDULE_TOL = 1e-6


@pytest.mark.parametrize("depth, width, heads", [(12, 768, 6), (20, 1280, 10), (26, 1664, 13)])
def test_widths_nanochat_states(depth, width, heads):
    """LOG.md: d12 is 768 wide, d20 1280 (its weight-decay sweep), d26 1664 (its MLP benchmark,
    65536x1664 @ 1664x6656); heads of 128."""
    shape = nanochat_recipe.model_shape(depth)
    assert (shape["n_embd"], shape["n_head"], shape["n_kv_head"]) == (width, heads, heads)


def test_width_rounds_up_to_whole_heads():
    shape = nanochat_recipe.model_shape(5, aspect_ratio=64, head_dim=128)  # 320 -> 384
    assert (shape["n_embd"], shape["n_head"]) == (384, 3)


@pytest.mark.parametrize(
    "depth, scaling_millions, tokens_billions, batch",
    [
        (8, 42, 0.44, 2**18),
        (12, None, None, 2**19),
        (18, 324, 3.4, 2**20),
        (26, 918, 9.6, 2**20),
        (32, 1700, 17.6, 2**21),
        (50, 6200, 65.6, 2**21),
    ],
)
def test_batch_sizes_nanochat_states(depth, scaling_millions, tokens_billions, batch):
    """LOG.md, 2026-02-05 (Auto Batch Size Scaling, then at a data:param ratio of 10.5): the
    scaling params, target tokens and auto batch of depths 8 to 50."""
    recipe = nanochat_recipe.resolve(depth, target_param_data_ratio=10.5)
    assert recipe.total_batch_size == batch
    if scaling_millions is not None:
        digits = 1 if scaling_millions >= 1000 else 0  # the table's: 42M, 1.7B
        scale = 1e6 * 10 ** (3 * digits)
        assert round(recipe.scaling_params / scale, digits) == scaling_millions / 1000**digits
        assert round(recipe.target_tokens / 1e9, 1 if tokens_billions >= 1 else 2) == (
            tokens_billions
        )


def test_d12_is_the_reference():
    """At d12 the batch is B_ref, no rate or weight decay is scaled, and the horizon is the
    ratio's tokens over the batch."""
    recipe = nanochat_recipe.resolve(12)
    assert (recipe.total_batch_size, recipe.batch_lr_scale) == (2**19, 1.0)
    assert recipe.weight_decay == pytest.approx(0.28, rel=1e-15)
    assert recipe.num_iterations == int(12.0 * recipe.scaling_params) // 2**19
    assert recipe.rates["muon"] == 0.02 and recipe.rates["smear"] == 0.2
    assert recipe.rates["value_embeds"] == recipe.rates["embedding"] / 2


def test_horizon_precedence_and_accumulation():
    given = nanochat_recipe.resolve(20, num_iterations=100, target_flops=1e18)
    assert (given.num_iterations, given.horizon) == (100, "given")
    by_flops = nanochat_recipe.resolve(20, target_flops=1e18)
    assert by_flops.num_iterations == round(
        1e18 / (by_flops.flops_per_token * by_flops.total_batch_size)
    )
    recipe = nanochat_recipe.resolve(20, device_batch_size=16, devices=8, total_batch_size=2**19)
    assert recipe.grad_accum_steps == 2**19 // (16 * 2048 * 8)
    with pytest.raises(UsageError, match="must be a multiple"):
        nanochat_recipe.resolve(20, device_batch_size=24)
    with pytest.raises(UsageError, match="no training horizon"):
        nanochat_recipe.resolve(20, target_param_data_ratio=-1)


def test_summary_says_the_figures():
    recipe = nanochat_recipe.resolve(20)
    text = recipe.summary()
    for figure in (recipe.num_iterations, recipe.total_batch_size, recipe.scaling_params):
        assert f"{figure:,}" in text
    assert f"gradient accumulation steps: {recipe.grad_accum_steps}" in text


def lr_multiplier_formula(it, n, warmup, ratio, final):
    """base_train's get_lr_multiplier, in float64."""
    warmdown = round(ratio * n)
    if it < warmup:
        return (it + 1) / warmup
    if it <= n - warmdown:
        return 1.0
    progress = (n - it) / warmdown
    return progress * 1.0 + (1 - progress) * final


def momentum_formula(it, n, ratio):
    """base_train's get_muon_momentum, in float64."""
    warmdown = round(ratio * n)
    start = n - warmdown
    if it < 400:
        return (1 - it / 400) * 0.85 + it / 400 * 0.97
    if it >= start:
        return 0.97 * (1 - (it - start) / warmdown) + 0.90 * (it - start) / warmdown
    return 0.97


RUNS = [(10, 0.65), (1000, 0.65), (5000, 0.5), (7, 0.5)]  # 10 x 0.65 rounds half to even: 6


def chosen_steps(n):
    return sorted({0, 1, 39, 40, 41, 200, 399, 400, n // 2, n - 1, n} & set(range(n + 1)))


@pytest.mark.parametrize("n, ratio", RUNS)
def test_schedules_equal_base_train_formulas(n, ratio):
    lrm, momentum, wd = nanochat_optim.schedules(n, 0.2, 40, ratio, 0.05)
    for it in chosen_steps(n):
        expect = (
            lr_multiplier_formula(it, n, 40, ratio, 0.05),
            momentum_formula(it, n, ratio),
            0.2 * 0.5 * (1 + math.cos(math.pi * it / n)),
        )
        got = [float(f(it)) for f in (lrm, momentum, wd)]
        np.testing.assert_allclose(got, expect, rtol=SCHEDULE_TOL, atol=SCHEDULE_TOL, err_msg=it)


def test_warmdown_rounds_half_to_even():
    """round(0.65 x 10) = 6 (not 7): the warmdown starts after step 4."""
    assert nanochat_optim.warmdown_iters(10, 0.65) == 6
    assert float(nanochat_optim.lr_multiplier(4, 10, 1, 0.65)) == 1.0
    assert float(nanochat_optim.lr_multiplier(5, 10, 1, 0.65)) < 1.0


# --- nanochat's own base_train (NANOCHAT_CHECKOUT)

# base_train.py's statements that resolve the run, between these lines (the model's shape, the
# scaling rules, the horizon and schedules, the accumulation); its arguments stand in for argparse
SECTIONS = [
    ("def build_model_meta(depth):", "# Build the model, move to device"),
    ("param_counts = model.num_scaling_params()", "# Initialize the Optimizer"),
    ("# num_iterations: either it is given", "# Training loop"),
    ("# Figure out the needed gradient accumulation", "# Go!"),
]
ARGS = dict(
    aspect_ratio=64,
    head_dim=128,
    max_seq_len=2048,
    window_pattern="SSSL",
    num_iterations=-1,
    target_flops=-1.0,
    target_param_data_ratio=12.0,
    device_batch_size=32,
    total_batch_size=-1,
    embedding_lr=0.3,
    unembedding_lr=0.008,
    matrix_lr=0.02,
    scalar_lr=0.5,
    weight_decay=0.28,
    warmup_steps=40,
    warmdown_ratio=0.65,
    final_lr_frac=0.05,
)


def base_train_own(checkout, depth, devices=1, **args):
    """base_train.py's own statements run for `depth` on nanochat's GPT (meta device): their
    namespace (total_batch_size, num_iterations, get_lr_multiplier, ...) and its optimizer's
    groups from setup_optimizer as base_train calls it."""
    sys.path.insert(0, checkout)
    import torch
    from nanochat import gpt

    source = open(os.path.join(checkout, "scripts", "base_train.py")).read()
    args = SimpleNamespace(depth=depth, **(ARGS | args))
    space = dict(args=args, vocab_size=32768, GPT=gpt.GPT, GPTConfig=gpt.GPTConfig, torch=torch)
    space |= dict(math=math, print0=lambda *a, **k: None, ddp_world_size=devices)
    for i, (start, end) in enumerate(SECTIONS):
        begin = source.index(start)
        exec(source[begin : source.index(end, begin)], space)
        if i == 0:
            space["model"] = space["build_model_meta"](depth)
    b = space["batch_lr_scale"]
    optimizer = space["model"].setup_optimizer(
        unembedding_lr=args.unembedding_lr * b,
        embedding_lr=args.embedding_lr * b,
        scalar_lr=args.scalar_lr * b,
        matrix_lr=args.matrix_lr * b,
        weight_decay=space["weight_decay_scaled"],
    )
    return space, [g["initial_lr"] for g in optimizer.param_groups]


def nanochat_checkout():
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip(
            "nanochat's own base_train: set NANOCHAT_CHECKOUT to a karpathy/nanochat checkout"
        )
    return checkout


OWN_RUNS = [
    (12, {}, 1),
    (20, {}, 1),
    (26, {}, 1),
    (20, dict(num_iterations=1234), 1),
    (26, dict(target_flops=4e19, device_batch_size=16), 8),
    (20, dict(total_batch_size=2**18, aspect_ratio=48, max_seq_len=1024), 2),
]


@pytest.mark.parametrize("depth, args, devices", OWN_RUNS)
def test_recipe_equals_base_train_own(depth, args, devices):
    space, own_rates = base_train_own(nanochat_checkout(), depth, devices, **args)
    recipe = nanochat_recipe.resolve(depth, devices=devices, **args)
    config = space["model"].config
    assert recipe.model == {k: getattr(config, k) for k in recipe.model}
    assert recipe.param_counts == space["param_counts"]
    assert recipe.flops_per_token == space["num_flops_per_token"]
    own = {k: space[k] for k in ("num_scaling_params", "target_tokens", "total_batch_size")}
    own |= {k: space[k] for k in ("batch_lr_scale", "num_iterations", "grad_accum_steps")}
    ours = dict(num_scaling_params=recipe.scaling_params, target_tokens=recipe.target_tokens)
    ours |= dict(total_batch_size=recipe.total_batch_size, batch_lr_scale=recipe.batch_lr_scale)
    ours |= dict(num_iterations=recipe.num_iterations, grad_accum_steps=recipe.grad_accum_steps)
    assert ours == own
    assert recipe.weight_decay == space["weight_decay_scaled"]
    muon_groups = len(own_rates) - len(nanochat_optim.ADAM_GROUPS)
    assert (
        own_rates
        == [recipe.rates[g] for g in nanochat_optim.ADAM_GROUPS]
        + [recipe.rates["muon"]] * muon_groups
    )
    lrm, momentum, wd = recipe.schedules()
    for it in chosen_steps(recipe.num_iterations):
        expect = [
            space[f](it) for f in ("get_lr_multiplier", "get_muon_momentum", "get_weight_decay")
        ]
        got = [float(f(it)) for f in (lrm, momentum, wd)]
        np.testing.assert_allclose(got, expect, rtol=SCHEDULE_TOL, atol=SCHEDULE_TOL, err_msg=it)
