"""
nanochat's own optimizer state (dataio/nanochat_optimizer_state.py: {its param's name: its state},
torch's layout) into and out of our MuonAdamW's (archs/nanochat_optim.py): a warm start from its
optim_*.pt as its chat_sft's load_state_dict takes one, and the state our export writes for it.
Each of our leaves is found by its param's path among the model's weight_rows, (its name, our
path, nn.Linear weight?): a Linear weight's state is the transpose of ours, (out, in) and (in,
out), NorMuon's buffer too.
"""

import jax
import jax.numpy as jnp
import numpy as np

from archs.nanochat_optim import ADAM_GROUPS, MUON_BETA2, AdamWState, path_names

TORCH_KEYS = {  # our state's fields -> its state's keys
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "momentum_buffer": "momentum_buffer",
    "second_moment": "second_momentum_buffer",
}


def state_leaves(state, rows):
    """(group's inner state, field, its name, Linear weight?, leaf) of every moment and buffer of
    our MuonAdamW state. rows: the model's weight_rows, (its name, our path, Linear weight?)."""
    by_path = {ours: (name, linear) for name, ours, linear in rows}
    for masked in state.inner_states.values():
        inner = masked.inner_state
        for field in TORCH_KEYS:
            for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(inner, field, ()))[0]:
                yield inner, field, *by_path[".".join(path_names(path))], leaf


def warm_started(state, named, rows):
    """Our MuonAdamW state `state` (a fresh one: its layout) holding nanochat's, `named` ({its
    name: its state}, torch's layout: NanochatOptimizerState.state), as its load_state_dict puts
    it: the moments, the buffers and AdamW's step counts (as steps_before); the run's own counts
    0. A Linear weight's state transposed to our (in, out); a group whose params' steps differ,
    or a shape that differs, is a ValueError."""
    taken = {}
    for inner, field, name, linear, leaf in state_leaves(state, rows):
        a = np.asarray(named[name][TORCH_KEYS[field]])
        a = a.T if linear else a
        if a.shape != leaf.shape:
            raise ValueError(f"{name}'s {field} is {a.shape} (ours), the model's {leaf.shape}")
        taken.setdefault(id(inner), []).append((jnp.asarray(a, leaf.dtype), name))
    groups = {}
    for group, masked in state.inner_states.items():
        inner, held = masked.inner_state, iter(taken.get(id(masked.inner_state), []))
        fields = {
            f: jax.tree.map(lambda _: next(held)[0], getattr(inner, f))
            for f in TORCH_KEYS
            if f in inner._fields
        }
        if isinstance(inner, AdamWState):
            steps = {named[n]["step"] for _, n in taken.get(id(inner), [])}
            if len(steps) > 1:
                raise ValueError(f"the {group} group's params hold different steps {steps}")
            fields["steps_before"] = jnp.asarray(steps.pop() if steps else 0, jnp.int32)
        groups[group] = masked._replace(inner_state=inner._replace(**fields))
    return state._replace(inner_states=groups)


def nanochat_named(state, rows):
    """warm_started's inverse: {nanochat's name: its state} (numpy float32, torch's layout) of our
    MuonAdamW state, AdamW's step its moments' updates in all (steps_before + the run's)."""
    named = {}
    for inner, field, name, linear, leaf in state_leaves(state, rows):
        a = np.asarray(leaf, np.float32)
        named.setdefault(name, {})[TORCH_KEYS[field]] = a.T if linear else a
        if isinstance(inner, AdamWState):
            named[name]["step"] = int(inner.schedule.count) + int(inner.steps_before)
    return named


def group_settings(label, rates, muon_weight_decay, momentum=0.95):
    """A group's settings as setup_optimizer puts them in param_groups: its rate (`rates`:
    group_rates's) as lr and initial_lr, AdamW's betas, eps and decay, Muon's."""
    if label == "muon":
        hyper = dict(momentum=momentum, ns_steps=5, beta2=MUON_BETA2)
        hyper |= dict(weight_decay=muon_weight_decay, initial_lr=rates[label])
        return dict(kind="muon", lr=rates[label], **hyper)
    (beta1, beta2), eps, weight_decay = ADAM_GROUPS[label]
    hyper = dict(lr=rates[label], betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    return dict(kind="adamw", **hyper) | {"initial_lr": rates[label]}


def check_group_settings(groups):
    """The settings nanochat's load_state_dict keeps from a file's groups ((label, names,
    settings)) and our optimizer fixes (AdamW's betas, eps and decay, Muon's beta2 and
    iterations) are ours, else a ValueError naming the first that is not."""
    for label, names, settings in groups:
        ours = group_settings(label, dict.fromkeys([label], 0.0), 0.0)
        for key in ("betas", "eps", "weight_decay") if label != "muon" else ("beta2", "ns_steps"):
            if tuple(np.atleast_1d(settings.get(key))) != tuple(np.atleast_1d(ours[key])):
                raise ValueError(
                    f"{names[0]}'s group has {key}={settings.get(key)}, ours {ours[key]}"
                )
