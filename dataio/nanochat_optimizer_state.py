"""
nanochat's optimizer state, in and out: optim_NNNNNN_rank0.pt, torch.save of its MuonAdamW's
state_dict, which its base_train saves beside each model_NNNNNN.pt and chat_sft loads (its default
--load-optimizer=1) to warm-start finetuning. A torch optimizer's state_dict numbers the params
0, 1, ... in the order of its param_groups (gpt.py's setup_optimizer: the head, the token
embeddings, the value embeddings, resid, x0, the smear group, then a Muon group per matrix shape,
sorted) and keeps {'state': {number: its state}, 'param_groups': [each group's settings and its
numbers]}. AdamW's state is per param ('step', 'exp_avg', 'exp_avg_sq'); a Muon group's is one
stack of its K matrices under its first param's number ('momentum_buffer' (K, rows, cols),
'second_momentum_buffer' (K, rows, 1) when rows >= cols, else (K, 1, cols)), one rank's whole
(rank 0 of one process).

Here the state is NanochatOptimizerState: each group as (kind, its params' names in its order,
its settings), and each param's own state by its name in torch's layout, a Muon group's stack
split per matrix. Read as torch's load_state_dict maps it (the n-th number of the file's group to
the n-th param of ours), checked first: a file that is not this model's state is one line naming
--load_optimizer=False.
"""

import os
from dataclasses import dataclass

import numpy as np

from configurator import UsageError
from dataio.weights import LazyState, torch_load

FIX = "--load_optimizer=False starts the optimizer fresh"
# a block's params in the order its modules register them (its Block, CausalSelfAttention, MLP)
BLOCK_ORDER = ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "attn.ve_gate", "mlp.c_fc")
BLOCK_ORDER += ("mlp.c_proj",)
ADAMW_HEAD = (("lm_head", ["lm_head.weight"]), ("embedding", ["transformer.wte.weight"]))
ADAMW_SCALARS = (("resid", ["resid_lambdas"]), ("x0", ["x0_lambdas"]))
SMEAR = ("smear", ["smear_gate.weight", "smear_lambda", "backout_lambda"])
MUON_KEYS = ("momentum_buffer", "second_momentum_buffer")
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's, beside its "step"


def optim_file(step, rank=0):
    return f"optim_{step:06d}_rank{rank:d}.pt"


@dataclass
class NanochatOptimizerState:
    """groups: [(label, [its params' names], {its settings: lr, betas, weight_decay, ...})] in
    setup_optimizer's order (label: archs/nanochat_optim.py's group names, 'muon' for each shape);
    state: {name: {'step': int, 'exp_avg', 'exp_avg_sq'} or {'momentum_buffer' (rows, cols),
    'second_momentum_buffer' (rows, 1) or (1, cols)}}, numpy float32 in torch's layout."""

    groups: list
    state: dict

    def muon_weight_decay(self):
        """The weight decay the file's Muon groups hold (base_train's last step set it; chat_sft's
        load keeps it): one value, else one line."""
        found = {float(h["weight_decay"]) for label, _, h in self.groups if label == "muon"}
        if len(found) > 1:
            raise UsageError(f"its Muon groups hold different weight decays {sorted(found)}")
        return found.pop() if found else 0.0


class WithOptimizerState(LazyState):
    """A checkpoint's weights ({name: array}, read lazily) and the optimizer state saved beside
    them, which train.py's init_state takes as the warm start."""

    def __init__(self, weights, optimizer_state):
        super().__init__(list(weights), weights.__getitem__)
        self.optimizer_state = optimizer_state


def torch_order(shapes):
    """setup_optimizer's groups over a GPT of `shapes` ({its state-dict name: torch shape}):
    [(label, [names])], each group's params in the order it lists them."""
    blocks = [n for n in shapes if n.startswith("transformer.h.")]

    def block_key(name):  # transformer.h.<layer>.<module>.weight
        _, _, layer, rest = name.split(".", 3)
        return int(layer), BLOCK_ORDER.index(rest.removesuffix(".weight"))

    blocks.sort(key=block_key)
    value_embeds = sorted((n for n in shapes if n.startswith("value_embeds.")), key=layer_of)
    groups = [*ADAMW_HEAD, ("value_embeds", value_embeds), *ADAMW_SCALARS, SMEAR]
    for shape in sorted({tuple(shapes[n]) for n in blocks}):
        groups.append(("muon", [n for n in blocks if tuple(shapes[n]) == shape]))
    return groups


def layer_of(name):
    return int(name.split(".")[1])


def read_optimizer_state(directory, step, shapes):
    """The state in `directory`'s optim_<step>_rank0.pt for a GPT of `shapes` ({its name: torch
    shape}), else None where there is no such file (chat_sft's fresh start)."""
    path = os.path.join(directory, optim_file(step))
    if not os.path.exists(path):
        return None
    try:
        saved = torch_load(path)
    except UsageError as e:
        raise UsageError(f"{e}; {FIX}") from None
    try:
        return from_state_dict(saved, shapes)
    except (UsageError, KeyError, TypeError, ValueError, AttributeError) as e:
        why = str(e) if isinstance(e, UsageError) else f"{type(e).__name__}: {e}"
        raise UsageError(
            f"{path} is not the optimizer state of this model ({why}): {FIX}"
        ) from None


def from_state_dict(saved, shapes):
    """A MuonAdamW state_dict (nanochat's) as NanochatOptimizerState, checked against `shapes`."""
    ours = torch_order(shapes)
    if set(saved) != {"state", "param_groups"}:
        raise UsageError(f"it holds {sorted(map(str, saved))[:4]}, not a torch optimizer's")
    theirs = saved["param_groups"]
    sizes = [len(g["params"]) for g in theirs]
    if sizes != [len(names) for _, names in ours]:
        raise UsageError(
            f"its groups hold {sizes} params, setup_optimizer's of this model "
            f"{[len(names) for _, names in ours]}"
        )
    groups, state = [], {}
    for (label, names), group in zip(ours, theirs):
        if group.get("kind") != ("muon" if label == "muon" else "adamw"):
            raise UsageError(f"its group of {names[0]} is {group.get('kind')!r}")
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append((label, names, settings))
        held = [saved["state"].get(i, {}) for i in group["params"]]
        if label == "muon":
            state |= split_muon(held[0], names, shapes)
        else:
            state |= {name: adamw_of(s, name, shapes[name]) for name, s in zip(names, held)}
    return NanochatOptimizerState(groups, state)


def as_numpy(x):
    return x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x, np.float32)


def checked(a, shape, what):
    if tuple(a.shape) != tuple(shape):
        raise UsageError(f"{what} is {tuple(a.shape)}, this model's {tuple(shape)}")
    return a


def adamw_of(held, name, shape):
    """One AdamW param's state (a param never stepped: step 0, zero moments, as torch's fresh)."""
    if not held:
        zeros = np.zeros(shape, np.float32)
        return {"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros}
    moments = {k: checked(as_numpy(held[k]), shape, f"{name}'s {k}") for k in MOMENTS}
    return {"step": int(float(held["step"])), **moments}


def second_moment_shape(shape):
    """NorMuon's buffer of a (rows, cols) matrix: per row when rows >= cols, else per column."""
    rows, cols = shape
    return (rows, 1) if rows >= cols else (1, cols)


def split_muon(held, names, shapes):
    """A Muon group's stacked buffers, one matrix each by name (never stepped: zeros)."""
    shape = tuple(shapes[names[0]])
    stacked = {}
    for key, each in zip(MUON_KEYS, (shape, second_moment_shape(shape))):
        found = held.get(key)
        full = (len(names), *each)
        stacked[key] = (
            np.zeros(full, np.float32)
            if found is None
            else checked(as_numpy(found), full, f"the {shape} group's {key}")
        )
    return {n: {k: stacked[k][i] for k in MUON_KEYS} for i, n in enumerate(names)}


def to_state_dict(optimizer_state):
    """NanochatOptimizerState as torch's state_dict of nanochat's MuonAdamW (torch tensors)."""
    import torch

    state, param_groups, number = {}, [], 0
    for label, names, settings in optimizer_state.groups:
        numbers = list(range(number, number + len(names)))
        number += len(names)
        param_groups.append({**settings, "params": numbers})
        held = [optimizer_state.state[n] for n in names]
        if label == "muon":
            state[numbers[0]] = {k: torch.tensor(np.stack([h[k] for h in held])) for k in MUON_KEYS}
            continue
        for i, h in zip(numbers, held):
            if h["step"]:  # torch keeps no state for a param never stepped
                state[i] = {"step": int(h["step"])}
                state[i] |= {k: torch.tensor(np.asarray(h[k])) for k in MOMENTS}
    return {"state": state, "param_groups": param_groups}


def save_optimizer_state(directory, step, optimizer_state):
    """optim_<step>_rank0.pt in a local `directory`, as nanochat's save_checkpoint writes it."""
    import torch

    torch.save(to_state_dict(optimizer_state), os.path.join(directory, optim_file(step)))
