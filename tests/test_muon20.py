"""python -m pytest tests/test_muon20.py -q

optimizer='muon20' (train_step.make_optimizer, muon.muon20) against modded-nanogpt's record 20 in
PyTorch (parity/speedrun20_training.py), on a tiny Record20GPT (8 layers, the 8th without
attention, width 32) with the reference's random weights and gradients: Muon's update at three
points of its momentum warmup (float32 Newton-Schulz; c_fc's (4C, C) scaled by 2, the fused qkv
as three matrices; in bfloat16, no further from float32 than the reference), Adam's three groups
at their rates, the groups themselves, the cooldown schedule and the momentum warmup against the
reference's formulas, three whole steps against make_optimizers in the record's step order, and
the settings' one-line errors. Params are held to check_train's fp32 tolerances, and to 1e-5 of
the distance each moved (check_train's alone would pass a wrong update smaller than a param's
1e-2)."""

import copy
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from helpers import assert_close, one_torch_thread

from archs import muon
from archs.models import model_from
from configurator import UsageError, configure
from dataio.pretrained import from_record20_state, record20_config, to_record20_state
from model import GPTConfig
from parity import speedrun20_training as record
from parity.speedrun20_reference import GPT
from parity.train_report import LR_TOL, PARAM_NORM_TOL, PARAM_TOL
from run import train_step
from run.settings import DEFAULTS, check_optimizer, validate

SHAPE = dict(vocab_size=200, num_layers=8, num_heads=2, model_dim=32)  # head: 256 padded rows
SETTINGS = dict(
    DEFAULTS,
    arch="speedrun20",
    optimizer="muon20",
    lr_schedule="cooldown",
    learning_rate=0.008,  # the record's rates: the head's (Adam's others: DEFAULTS)
    muon_learning_rate=0.05,
    beta1=0.8,
    beta2=0.95,
    weight_decay=0.0,
    muon_ns_dtype="float32",
    max_iters=500,
)
MOVED_TOL = 1e-5  # max |ours - the reference's| over the max distance the param moved
GROUPS = ("head", "embed", "scalar")  # Adam's, in make_optimizers' order


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():  # tiny tensors: one thread is faster (test_check_train)
        yield


@pytest.fixture(scope="module")
def start():
    """The reference with every param random, all-fp32; three random gradients {its name: array};
    our model holding its weights -> (reference, grads, graphdef, params)."""
    torch.manual_seed(0)
    ref = GPT(**SHAPE, embed_dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5 if p.ndim < 2 else p.shape[-1] ** -0.5)
    grads = [{k: torch.randn_like(p).numpy() for k, p in ref.named_parameters()} for _ in range(3)]
    state = from_record20_state(ref.state_dict())
    config = GPTConfig(**{**record20_config(state, SHAPE["num_heads"]), "block_size": 256})
    graphdef, params = nnx.split(model_from(config, state))
    return ref, grads, graphdef, params


def ours_tree(graphdef, params, named):
    """{the record's name: its array in torch's layout} -> a tree like `params`, in ours."""
    named = from_record20_state(named)
    by_path = {ours: named[name] for name, ours, _ in nnx.merge(graphdef, params).weight_rows()}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(by_path[muon._path(p)]), params
    )


def record_state(graphdef, params):
    """Our params -> {the record's name: float32 array in torch's layout}."""
    return to_record20_state(nnx.merge(graphdef, params))


def at_step(state, step, buffer):
    """tx's state as after `step` updates, with Muon's momentum `buffer` (a params tree)."""
    by_path = {muon._path(p): x for p, x in jax.tree_util.tree_leaves_with_path(buffer)}
    counted = (muon.Record20MomentumState, optax.ScaleByScheduleState)

    def one(s):
        if isinstance(s, muon.Record20MomentumState):
            momentum = jax.tree_util.tree_map_with_path(lambda p, _: by_path[muon._path(p)], s[1])
            return muon.Record20MomentumState(jnp.int32(step), momentum)
        return s._replace(count=jnp.int32(step)) if isinstance(s, counted) else s

    return jax.tree.map(one, state, is_leaf=lambda s: isinstance(s, counted))


def set_grads(ref, grads):
    for name, p in ref.named_parameters():
        p.grad = torch.tensor(grads[name]).to(p.dtype)  # record 20's bf16 tables: bf16


def off(ours, theirs, before, names):
    """{name: (max |Δ| / max |param|, ||Δ|| / ||param||, max |Δ| / max distance moved)}."""
    out = {}
    for k in names:
        o, t, b = (np.asarray(x, np.float64) for x in (ours[k], theirs[k], before[k]))
        d = np.abs(o - t)
        out[k] = (d.max() / np.abs(t).max(), np.linalg.norm(d) / np.linalg.norm(t))
        out[k] += (d.max() / np.abs(t - b).max(),)
    return out


def assert_within(figures, what):
    for name, (rel_max, rel_norm, moved) in figures.items():
        assert rel_max <= PARAM_TOL and rel_norm <= PARAM_NORM_TOL and moved <= MOVED_TOL, (
            f"{what}: {name} off the reference by {rel_max:.2g} (max), {rel_norm:.2g} (norm) of "
            f"the param, {moved:.2g} of its move"
        )


@functools.cache
def _optimizer(settings):
    tx = train_step.make_optimizer(dict(settings))
    return tx, jax.jit(tx.update)


def optimizer(c):
    """(make_optimizer(c), its update jitted), once per settings."""
    return _optimizer(tuple(sorted(c.items())))


def muon_update(start, at, ns_dtype="float32"):
    """One update of ours and of the reference's Muon at step `at` of 500, from the same random
    momentum buffer, Newton-Schulz in `ns_dtype` -> (ours, the reference's, the params before),
    {the record's name: array} of the blocks' matrices."""
    ref, grads, graphdef, params = copy.deepcopy(start[0]), *start[1:]
    _, opt = record.make_optimizers(ref, ns_dtype=getattr(torch, ns_dtype))
    rng = np.random.default_rng(at)
    hidden = [n for n, p in ref.named_parameters() if p.ndim >= 2 and n.startswith("blocks.")]
    buffer = {n: rng.standard_normal(ref.get_parameter(n).shape).astype(np.float32) for n in hidden}
    # ours: the buffer in our layout, the other params' zeros (Adam's; not compared)
    full = {n: buffer.get(n, np.zeros(p.shape, np.float32)) for n, p in ref.named_parameters()}
    tx, update = optimizer(dict(SETTINGS, muon_ns_dtype=ns_dtype))
    state = at_step(tx.init(params), at, ours_tree(graphdef, params, full))
    updates, _ = update(ours_tree(graphdef, params, grads[0]), state, params)
    ours = record_state(graphdef, optax.apply_updates(params, updates))
    before = {n: ref.get_parameter(n).detach().numpy().copy() for n in hidden}
    set_grads(ref, grads[0])
    for group in opt.param_groups:
        group["momentum"] = record.muon_momentum(at)
        group["lr"] = group["initial_lr"] * record.get_lr(at, SETTINGS["max_iters"])
    for n in hidden:
        opt.state[ref.get_parameter(n)]["momentum_buffer"] = torch.tensor(buffer[n])
    opt.step()
    theirs = {n: ref.get_parameter(n).detach().numpy() for n in hidden}
    return {n: ours[n] for n in hidden}, theirs, before


@pytest.mark.parametrize("at", [0, 150, 400])
def test_one_muon_update_in_the_momentum_warmup_equals_the_records(start, at):
    """From a momentum buffer and at step `at` of 500 (400: in the cooldown, at 0.55x), every
    block matrix: the lerps with m(at), Newton-Schulz, c_fc's scale 2, the qkv as three."""
    ours, theirs, before = muon_update(start, at)
    figures = off(ours, theirs, before, theirs)
    assert {"blocks.0.attn.qkv_w", "blocks.0.mlp.c_fc.weight"} <= figures.keys()
    assert len(figures) == 30  # 8 layers x 4 matrices, layer 7 without attention's 2
    assert_within(figures, f"Muon at step {at}")


# slow (make test-slow; CI runs it): a measurement of bf16, the fp32 updates are make test's
@pytest.mark.slow
def test_bfloat16_newton_schulz_is_as_close_to_float32_as_the_records(start):
    """Record 20's bf16 Newton-Schulz (ours rounds where torch.compile's fused kernels would, the
    reference where eager torch does): ours no further from the float32 update than the
    reference's bf16, in ||Δparam|| over the distance it moved, the mean and the worst matrix."""
    _, exact, before = muon_update(start, 150)
    ours, theirs, _ = muon_update(start, 150, "bfloat16")

    def off_float32(side):
        return [
            np.linalg.norm(side[k] - exact[k]) / np.linalg.norm(exact[k] - before[k]) for k in exact
        ]

    ours, theirs = off_float32(ours), off_float32(theirs)
    print(
        f"\nbf16 off float32, mean and worst: ours {np.mean(ours):.1e} {max(ours):.1e}, the "
        f"reference's {np.mean(theirs):.1e} {max(theirs):.1e}"
    )
    assert 0 < np.mean(ours) <= np.mean(theirs) and max(ours) <= max(theirs)


def adam_figures(c, start):
    """Three Adam steps of ours under `c` against torch's Adam with the record's three groups."""
    ref, grads, graphdef, params = copy.deepcopy(start[0]), *start[1:]
    adam, _ = record.make_optimizers(ref, ns_dtype=torch.float32)
    before = {k: v.detach().numpy().copy() for k, v in ref.named_parameters()}
    tx, update = optimizer(c)
    state = tx.init(params)
    for g in grads:
        updates, state = update(ours_tree(graphdef, params, g), state, params)
        params = optax.apply_updates(params, updates)
        set_grads(ref, g)
        adam.step()
    names = {id(p): n for n, p in ref.named_parameters()}
    theirs = {k: v.detach().numpy() for k, v in ref.named_parameters()}
    ours = record_state(graphdef, params)
    return {
        name: off(ours, theirs, before, [names[id(p)] for p in group["params"]])
        for name, group in zip(GROUPS, adam.param_groups)
    }


@pytest.mark.slow
def test_adams_three_groups_step_at_their_rates_as_torchs_adam(start):
    figures = adam_figures(SETTINGS, start)
    assert [len(figures[g]) for g in GROUPS] == [1, 4, 16]  # lm_head; wte, ve 0-2; the scalars
    for group, f in figures.items():
        assert_within(f, f"Adam's {group} group")


def bf16_table_steps(start):
    """Three Adam steps with the embedding tables and their gradients in bf16 (embed_dtype=
    'bfloat16'), ours and the record's fused Adam -> {table: (ours, the record's, the largest
    magnitude the record's took at each entry)}, float32 arrays of bf16 values."""
    ref, grads, graphdef, params = copy.deepcopy(start[0]), *start[1:]
    for m in ref.modules():
        if isinstance(m, torch.nn.Embedding):
            m.bfloat16()  # the record's
    tables = [n for n, p in ref.named_parameters() if p.dtype == torch.bfloat16]
    largest = {n: ref.get_parameter(n).float().detach().abs().numpy() for n in tables}
    adam, _ = record.make_optimizers(ref, ns_dtype=torch.float32)
    is_table = lambda p: muon.RECORD20_EMBEDDINGS.search(muon._path(p))  # noqa: E731
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x.astype(jnp.bfloat16) if is_table(p) else x, params
    )
    tx = train_step.make_optimizer(dict(SETTINGS))
    update, state = jax.jit(tx.update), tx.init(params)
    for g in grads:
        # as train_step hands them over: each rounded to its param's dtype
        ours = jax.tree.map(lambda g, p: g.astype(p.dtype), ours_tree(graphdef, params, g), params)
        updates, state = update(ours, state, params)
        params = optax.apply_updates(params, updates)
        set_grads(ref, g)
        adam.step()
        for n in tables:
            largest[n] = np.maximum(largest[n], ref.get_parameter(n).float().detach().abs().numpy())
    ours = record_state(graphdef, params)
    theirs = {n: ref.get_parameter(n).float().detach().numpy() for n in tables}
    return {n: (ours[n], theirs[n], largest[n]) for n in tables}


def bf16_agreement(tables):
    """(the fraction of entries equal, the largest difference in bf16 ulps at the largest magnitude
    the entry held: a rounding at step 1 is an ulp of a value that a later step may shrink)."""
    equal = np.mean([np.mean(ours == theirs) for ours, theirs, _ in tables.values()])
    ulps = 0.0
    for ours, theirs, largest in tables.values():
        ulp = np.spacing(largest.astype(ml_dtypes.bfloat16)).astype(np.float32)
        ulps = max(ulps, float(np.max(np.abs(ours - theirs) / ulp)))
    return equal, ulps


@pytest.mark.slow
def test_bf16_tables_step_as_the_records_fused_adam(start, monkeypatch):
    """The record's fused Adam computes in float32 and rounds each state and param to bf16 once a
    step (muon.in_float32): ours equal bit for bit but where a float32 sum in another order rounds
    to the neighbouring bf16 value (torch's CPU kernel lerps the first moment; its CUDA kernel, the
    record's, sums as optax does). Optax's Adam on the bf16 state as it is rounds at every
    operation: a third of the entries off."""
    tables = bf16_table_steps(start)
    assert len(tables) == 4 and all(o.dtype == np.float32 for o, _, _ in tables.values())
    equal, ulps = bf16_agreement(tables)
    assert equal >= 0.99 and ulps <= 1, (equal, ulps)
    monkeypatch.setattr(muon, "in_float32", lambda tx: tx)
    equal, _ = bf16_agreement(bf16_table_steps(start))
    assert equal < 0.9, equal


@pytest.mark.slow
def test_two_groups_rates_swapped_are_caught(start):
    """The head's and the scalars' rates swapped: both groups off torch's by more than check_train's
    bar, the embeddings' still on it."""
    swapped = dict(SETTINGS, learning_rate=0.04, scalar_learning_rate=0.008)
    figures = adam_figures(swapped, start)
    for group in ("head", "scalar"):
        assert all(f[0] > PARAM_TOL and f[2] > 0.5 for f in figures[group].values()), group
    assert_within(figures["embed"], "Adam's embed group")


def test_the_groups_are_the_records(start):
    """muon20_labels against make_optimizers' groups, param by param."""
    ref, _, graphdef, params = copy.deepcopy(start[0]), *start[1:]
    labels = muon.muon20_labels(params)
    by_path = {muon._path(p): v for p, v in jax.tree_util.tree_leaves_with_path(labels)}
    ours = {name: by_path[path] for name, path, _ in nnx.merge(graphdef, params).weight_rows()}
    adam, opt = record.make_optimizers(ref)
    names = {id(p): n for n, p in ref.named_parameters()}
    groups = [*zip(GROUPS, adam.param_groups), ("muon", opt.param_groups[0])]
    assert ours == {names[id(p)]: label for label, group in groups for p in group["params"]}


def test_cooldown_and_momentum_warmup_are_the_records():
    c = dict(SETTINGS, max_iters=1000)
    for cooldown_frac in (0.4, 1.0, 0.25):
        c["cooldown_frac"] = cooldown_frac
        for it in (0, 300, 600, 800, 999, 1000):
            factor = record.get_lr(it, c["max_iters"], cooldown_frac)
            what = f"at {it} of 1000, cooldown_frac {cooldown_frac}"
            for rate, ours in [
                (c["learning_rate"], train_step.get_lr(it, c)),  # the head's, train.py's log
                (c["muon_learning_rate"], train_step.get_muon_lr(it, c)),
                (c["embed_learning_rate"], train_step.scheduled(it, c, c["embed_learning_rate"])),
            ]:
                assert_close(ours, rate * factor, rtol=LR_TOL, what=what)
    # the floor at max_iters, and kept past it (the record's get_lr asserts it is never asked)
    assert train_step.cooldown(1000, c) == train_step.cooldown(1200, c) == np.float32(0.1)
    assert train_step.get_lr(900, dict(c, decay_lr=False)) == np.float32(0.008)
    for s in (0, 1, 150, 299, 300, 400):
        assert_close(muon.muon_momentum_at(s, c), record.muon_momentum(s), rtol=1e-7, what=f"{s}")
    mine = dict(c, muon_momentum_start=0.5, muon_momentum=0.9, muon_momentum_warmup=10)
    assert_close(muon.muon_momentum_at(5, mine), 0.7, rtol=1e-7)
    assert float(muon.muon_momentum_at(0, dict(mine, muon_momentum_warmup=0))) == np.float32(0.9)


@pytest.mark.slow
def test_three_steps_equal_make_optimizers_in_the_records_step_order(start):
    """Both optimizers, the record's loop body: Muon's momentum set for the step, every group's lr
    initial_lr * get_lr(step), opt.step(); a cooldown and a momentum warmup inside the 3 steps."""
    c = dict(SETTINGS, max_iters=4, cooldown_frac=0.8, muon_momentum_warmup=2)
    ref, grads, graphdef, params = copy.deepcopy(start[0]), *start[1:]
    optimizers = record.make_optimizers(ref, ns_dtype=torch.float32)
    before = {k: v.detach().numpy().copy() for k, v in ref.named_parameters()}
    tx, update = optimizer(c)
    state = tx.init(params)
    for it, g in enumerate(grads):
        assert int(train_step.schedule_count(state)) == it
        logged = train_step.get_lr(train_step.schedule_count(state), c)  # the step's metrics["lr"]
        updates, state = update(ours_tree(graphdef, params, g), state, params)
        params = optax.apply_updates(params, updates)
        set_grads(ref, g)
        for group in optimizers[1].param_groups:
            group["momentum"] = record.muon_momentum(it, c["muon_momentum_warmup"])
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * record.get_lr(it, 4, c["cooldown_frac"])
            opt.step()
        assert_close(logged, optimizers[0].param_groups[0]["lr"], rtol=LR_TOL, what=f"lr at {it}")
    assert int(train_step.schedule_count(state)) == 3
    theirs = {k: v.detach().numpy() for k, v in ref.named_parameters()}
    figures = off(record_state(graphdef, params), theirs, before, theirs)
    assert len(figures) == 51
    assert_within(figures, "after 3 steps")


BAD = [
    (dict(arch="gpt2"), r"optimizer='muon20' is record 20's .*: use it with --arch=speedrun20"),
    (dict(arch="speedrun"), "use it with --arch=speedrun20"),
    (dict(lr_schedule="trapezoid"), "takes record 20's schedule: set --lr_schedule=cooldown"),
    (dict(cooldown_frac=0.0), r"cooldown_frac must be in \(0, 1\]"),
    (dict(cooldown_frac=1.5), r"cooldown_frac must be in \(0, 1\]"),
    (dict(muon_learning_rate=0.0), r"needs --muon_learning_rate > 0 \(record 20: 0.05\)"),
    (dict(weight_decay=0.1), "no weight decay: set --weight_decay=0"),
    (dict(optimizer="muon21"), r"optimizer must be 'adamw' or 'muon' \(record 5\), 'muon20'"),
    (dict(lr_schedule="linear"), r"'cooldown' \(record 20\), 'warmdown' \(nanochat\) or 'sft'"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_bad_muon20_setting_is_one_line(change, message):
    check_optimizer(SETTINGS)  # the base: valid
    with pytest.raises(UsageError, match=message) as e:
        check_optimizer(dict(SETTINGS, **change))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--muon_momentum_warmup=-1", "muon_momentum_warmup must be >= 0"),
        ("--muon_momentum_start=1.0", r"muon_momentum_start must be in \[0, 1\)"),
        ("--embed_learning_rate=-0.6", "embed_learning_rate must be >= 0"),
        ("--scalar_learning_rate=-0.04", "scalar_learning_rate must be >= 0"),
        ("--cooldown_frac=-0.4", r"cooldown_frac must be in \(0, 1\]"),
    ],
)
def test_bad_range_is_one_line(arg, message):
    validate(configure(DEFAULTS, ["--lr_schedule=cooldown"]))  # any optimizer takes the cooldown
    with pytest.raises(UsageError, match=message) as e:
        validate(configure(DEFAULTS, [arg]))
    assert "\n" not in str(e.value)
