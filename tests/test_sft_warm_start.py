"""python -m pytest tests/test_sft_warm_start.py -q

Finetuning's optimizer warm-started from the pretraining state, as nanochat's chat_sft does it
(--load-optimizer=1): a MuonAdamW stepped three times in torch on a tiny nanochat GPT (3 layers,
width 32, one KV head: every AdamW group, value embeddings and ve_gate on layers 0 and 2, square,
wide and tall Muon groups), its state_dict saved as base_train saves it (optim_NNNNNN_rank0.pt);
ours reads it tensor for tensor, puts it in our MuonAdamW, and takes the first finetuning step
that torch takes after its load_state_dict (its fresh SFT rates times init_lr_frac, the step
counts continuing for AdamW's bias correction, Muon's weight decay the file's, chat_sft's momentum
at step 0). The torch side is parity/nanochat_optim_reference.py's MuonAdamW (its state_dict and
load_state_dict done here as torch's Optimizer does them), or with
NANOCHAT_CHECKOUT=/path/to/nanochat nanochat's own MuonAdamW from its own GPT.setup_optimizer
(eagerly). A slip (the step counts reset to 0) is caught; a missing, corrupt or foreign file is
what chat_sft and our one-line rule say.
"""

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

from archs import models, nanochat_optim, nanochat_optim_state, nanochat_sft
from configurator import UsageError
from dataio import nanochat_optimizer_state as optim_file
from model import GPTConfig
from parity import nanochat_optim_reference as reference

CONFIG = dict(n_layer=3, n_head=2, n_kv_head=1, n_embd=32, vocab_size=128, block_size=16)
RATES = dict(unembedding_lr=0.008, embedding_lr=0.3, matrix_lr=0.02, scalar_lr=0.5)
SFT_RATES = dict(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.03, scalar_lr=0.5)
PRETRAIN_STEPS, LAST_WEIGHT_DECAY, INIT_LR_FRAC = 3, 0.0123, 0.8
# ours against torch, each param after the step: within two float32 roundings of its size plus
# 1e-5 of the distance it moved (Polar Express's float32 matmuls), as tests/test_nanochat_optim.py
EPS32 = float(np.finfo(np.float32).eps)
MOVED_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def model():
    """Our tiny nanochat GPT (its params nanochat's names: weight_rows)."""
    config = GPTConfig(arch="nanochat", bias=False, window_pattern="L", **CONFIG)
    return models.build(config, nnx.Rngs(0))


def checkout():
    found = os.environ.get("NANOCHAT_CHECKOUT")
    if found and found not in sys.path:
        sys.path.insert(0, found)
    return found


def torch_model(params, sft=False):
    """(named torch params, optimizer): nanochat's own GPT and setup_optimizer with a checkout,
    else the reference's groups; pretraining's rates and weight decay, or chat_sft's (decay 0)."""
    rates, weight_decay = (SFT_RATES, 0.0) if sft else (RATES, 0.28)
    if checkout():
        from nanochat import gpt

        own = gpt.GPT(gpt.GPTConfig(sequence_len=16, window_pattern="L", **without_block(CONFIG)))
        named = dict(own.named_parameters())
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(torch.tensor(params[name]))
        return named, own.setup_optimizer(weight_decay=weight_decay, **rates)
    named = {n: torch.nn.Parameter(torch.tensor(params[n])) for n in registered(params)}
    groups = reference.param_groups(named, weight_decay=weight_decay, **rates)
    return named, reference.MuonAdamW(groups)


# the order nanochat's GPT registers its params (gpt.py's __init__; a block's: attn's c_q, c_k,
# c_v, c_proj, ve_gate, then mlp's c_fc, c_proj), which its groups list them in
TOP = ("transformer.wte", "transformer.h", "lm_head", "resid_lambdas", "x0_lambdas", "smear_gate")
TOP += ("smear_lambda", "backout_lambda", "value_embeds")
BLOCK = (
    "attn.c_q",
    "attn.c_k",
    "attn.c_v",
    "attn.c_proj",
    "attn.ve_gate",
    "mlp.c_fc",
    "mlp.c_proj",
)


def registered(names):
    """nanochat's names in named_parameters' order."""

    def key(name):
        top = next(i for i, t in enumerate(TOP) if name.startswith(t))
        if name.startswith(("transformer.h.", "value_embeds.")):
            layer, rest = name.removeprefix("transformer.").split(".", 2)[1:]
            return top, int(layer), BLOCK.index(rest.removesuffix(".weight")) if "h." in name else 0
        return top, 0, 0

    return sorted(names, key=key)


def without_block(config):
    return {k: v for k, v in config.items() if k != "block_size"}


def grads_for(params, seed):
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=a.shape).astype(np.float32) for n, a in params.items()}


def stepped(optimizer, named, grads):
    for name, p in named.items():
        p.grad = torch.tensor(grads[name])
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()


def state_dict(optimizer):
    """torch's Optimizer.state_dict of a MuonAdamW (nanochat's own, or the reference's in
    nanochat's keys: Muon's 'momentum_buffer' and 'second_momentum_buffer')."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.state_dict()
    numbers = {}
    groups = []
    for group in optimizer.param_groups:
        ids = [numbers.setdefault(p, len(numbers)) for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    state = {}
    for p, s in optimizer.state.items():
        if "momentum" in s:
            s = {"momentum_buffer": s["momentum"], "second_momentum_buffer": s["second"]}
        state[numbers[p]] = {k: v.clone() if hasattr(v, "clone") else v for k, v in s.items()}
    return {"state": state, "param_groups": groups}


def load_state_dict(optimizer, saved):
    """torch's Optimizer.load_state_dict (the n-th saved number to the n-th param, every group
    setting the file's), then chat_sft's: its fresh rates back, times init_lr_frac."""
    fresh = [g["lr"] for g in optimizer.param_groups]
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(saved)
    else:
        for group, theirs in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            for p, i in zip(group["params"], theirs["params"], strict=True):
                s = saved["state"].get(i)
                if s is not None and "momentum_buffer" in s:
                    s = {"momentum": s["momentum_buffer"], "second": s["second_momentum_buffer"]}
                if s is not None:
                    optimizer.state[p] = {
                        k: getattr(v, "clone", lambda v=v: v)() for k, v in s.items()
                    }
            group.update({k: v for k, v in theirs.items() if k != "params"})
    for group, lr in zip(optimizer.param_groups, fresh):
        group["lr"] = group["initial_lr"] = lr * INIT_LR_FRAC


@pytest.fixture(scope="module")
def pretrained(model, tmp_path_factory):
    """(directory, the state_dict saved there, the params after it): three pretraining steps,
    the last at Muon weight decay LAST_WEIGHT_DECAY (base_train's schedule by then), saved."""
    named, optimizer = torch_model(model.nanochat_state())
    for step in range(PRETRAIN_STEPS):
        for group in optimizer.param_groups:
            if group["kind"] == "muon":
                group["weight_decay"] = LAST_WEIGHT_DECAY if step == PRETRAIN_STEPS - 1 else 0.28
        stepped(optimizer, named, grads_for(named, step))
    directory = tmp_path_factory.mktemp("base")
    saved = state_dict(optimizer)
    torch.save(saved, directory / optim_file.optim_file(PRETRAIN_STEPS))
    params = {n: p.detach().numpy().copy() for n, p in named.items()}
    return str(directory), saved, params


def torch_shapes(model):
    return {n: a.shape for n, a in model.nanochat_state().items()}


def test_the_state_read_is_the_files_tensor_for_tensor(model, pretrained):
    directory, saved, _ = pretrained
    read = optim_file.read_optimizer_state(directory, PRETRAIN_STEPS, torch_shapes(model))
    numbered = [n for _, names, _ in read.groups for n in names]
    assert len(numbered) == len(torch_shapes(model))
    for (label, names, settings), group in zip(read.groups, saved["param_groups"], strict=True):
        assert settings == {k: v for k, v in group.items() if k != "params"}
        held = [saved["state"][i] for i in group["params"][: 1 if label == "muon" else None]]
        for i, name in enumerate(names):
            ours = read.state[name]
            if label == "muon":
                for key in optim_file.MUON_KEYS:
                    np.testing.assert_array_equal(ours[key], held[0][key][i].numpy())
            else:
                assert ours["step"] == PRETRAIN_STEPS == held[i]["step"]
                for key in optim_file.MOMENTS:
                    np.testing.assert_array_equal(ours[key], held[i][key].numpy())
    assert read.muon_weight_decay() == pytest.approx(LAST_WEIGHT_DECAY)


def sft_optimizer(read):
    """Ours as a finetuning run from `read` sets it: chat_sft's rates times init_lr_frac (its
    multiplier 1 at progress 0), its momentum, Muon's weight decay the file's."""
    rates = nanochat_optim.group_rates(CONFIG["n_embd"], **SFT_RATES)
    return nanochat_optim.muon_adamw(
        rates,
        lambda it: INIT_LR_FRAC * nanochat_sft.lr_multiplier(0.0),
        nanochat_sft.muon_momentum,
        lambda it: read.muon_weight_decay(),
    )


def our_first_step(model, ours, params, grads, steps_before=None):
    """Our MuonAdamW (tx, its jitted update) at chat_sft's step 0 from `read`, one update of
    `params` by `grads`."""
    tx, update, read = ours
    tree = nnx.state(models.model_from(model.config, params), nnx.Param)
    state = nanochat_optim_state.warm_started(tx.init(tree), read.state, model.weight_rows())
    if steps_before is not None:  # a slip
        state = jax.tree.map(
            lambda x: jnp.int32(steps_before) if x.dtype == jnp.int32 and x.ndim == 0 else x,
            state,
        )
    g = nnx.state(models.model_from(model.config, grads), nnx.Param)
    updates, _ = update(g, state, tree)
    new = nnx.merge(nnx.graphdef(model), optax.apply_updates(tree, updates))
    return new.nanochat_state()


def torch_first_step(saved, params, grads):
    named, optimizer = torch_model(params, sft=True)
    load_state_dict(optimizer, saved)
    for group in optimizer.param_groups:  # chat_sft's step 0: lrm 1 at progress 0
        group["lr"] = group["initial_lr"] * 1.0
        if group["kind"] == "muon":
            group["momentum"] = 0.85
    stepped(optimizer, named, grads)
    return {n: p.detach().numpy().copy() for n, p in named.items()}


def assert_step_close(ours, theirs, start):
    for name, e in theirs.items():
        moved = np.abs(e - start[name]).max()
        tol = 2 * EPS32 * np.abs(e).max() + MOVED_TOL * moved
        diff = np.abs(ours[name] - e).max()
        assert diff <= tol, f"{name}: |diff| {diff:.3g} > {tol:.3g} (moved {moved:.3g})"


@pytest.fixture(scope="module")
def first_step(model, pretrained):
    directory, saved, params = pretrained
    read = optim_file.read_optimizer_state(directory, PRETRAIN_STEPS, torch_shapes(model))
    grads = grads_for(params, 99)
    tx = sft_optimizer(read)
    ours = (tx, jax.jit(tx.update), read)  # the update compiled once for both tests
    return ours, params, grads, torch_first_step(saved, params, grads)


def test_the_first_step_from_it_is_torchs_after_load_state_dict(model, first_step):
    ours, params, grads, theirs = first_step
    assert_step_close(our_first_step(model, ours, params, grads), theirs, params)


def test_step_counts_reset_to_zero_are_caught(model, first_step):
    """AdamW's bias correction from t=1 rather than t=4: the head's and embeddings' steps land
    outside the tolerance."""
    ours, params, grads, theirs = first_step
    slipped = our_first_step(model, ours, params, grads, steps_before=0)
    with pytest.raises(AssertionError, match="lm_head|wte|value_embeds|lambda"):
        assert_step_close(slipped, theirs, params)


def test_ours_written_back_is_the_same_state(model, pretrained):
    """The export's direction: our state as nanochat's state_dict reads back tensor for tensor
    (the step counts: steps_before plus the run's)."""
    directory, _, params = pretrained
    read = optim_file.read_optimizer_state(directory, PRETRAIN_STEPS, torch_shapes(model))
    rows = model.weight_rows()
    tx = nanochat_optim.muon_adamw(
        nanochat_optim.group_rates(32, **SFT_RATES), lambda it: 1.0, lambda it: 0.9, lambda it: 0
    )
    state = nanochat_optim_state.warm_started(
        tx.init(nnx.state(model, nnx.Param)), read.state, rows
    )
    named = nanochat_optim_state.nanochat_named(state, rows)
    again = optim_file.from_state_dict(
        optim_file.to_state_dict(optim_file.NanochatOptimizerState(read.groups, named)),
        torch_shapes(model),
    )
    for name, held in read.state.items():
        assert again.state[name].keys() == held.keys()
        for key, value in held.items():
            np.testing.assert_array_equal(again.state[name][key], value)


def test_a_missing_file_is_none_and_a_bad_one_is_one_line(model, pretrained, tmp_path):
    directory, saved, _ = pretrained
    shapes = torch_shapes(model)
    assert optim_file.read_optimizer_state(str(tmp_path), PRETRAIN_STEPS, shapes) is None
    (tmp_path / optim_file.optim_file(1)).write_bytes(b"not a torch file")
    with pytest.raises(UsageError, match="not a torch checkpoint.*--load_optimizer=False"):
        optim_file.read_optimizer_state(str(tmp_path), 1, shapes)
    fewer = dict(saved, param_groups=saved["param_groups"][:-1])
    torch.save(fewer, tmp_path / optim_file.optim_file(2))
    with pytest.raises(UsageError, match=r"not the optimizer state of this model.*groups hold"):
        optim_file.read_optimizer_state(str(tmp_path), 2, shapes)
    wide = {n: (s[0], s[1] * 2) if len(s) == 2 else s for n, s in shapes.items()}
    with pytest.raises(UsageError, match="--load_optimizer=False"):
        optim_file.read_optimizer_state(directory, PRETRAIN_STEPS, wide)
