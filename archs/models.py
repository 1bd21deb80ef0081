"""
Every architecture by its GPTConfig.arch: GPT-2 (model.py) and the speedrun's records
(archs/record5.py, archs/record20.py), each registered below by its Arch (archs/arch.py: what the
rest of the project asks it). The rest of the project builds, restores and loads a model here, then
uses the interface every one of them has (docs/model.md): train_step, checkpoint, generate,
hellaswag, eval and parity never ask which architecture they hold.
"""

from dataclasses import replace

from flax import nnx

from archs.arch import GPT2
from archs.nanochat import Nanochat
from archs.record5 import Record5
from archs.record20 import Record20
from configurator import UsageError
from dataio import pretrained
from model import GPTConfig

# the registry: an architecture is its module in archs/ and its line here
ARCHS = {a.model.arch: a for a in (GPT2, Record5, Record20, Nanochat)}


def arch_of(name):
    """The Arch registered as `name`; ValueError naming those there are."""
    if name not in ARCHS:
        names = ", ".join(map(repr, ARCHS))
        raise ValueError(
            f"arch must be {' or '.join(names.rsplit(', ', 1))} "
            f"({', '.join(a.model.title for a in ARCHS.values())}), got {name!r}"
        )
    return ARCHS[name]


def check_config(config: GPTConfig):
    """ValueError if config.arch's model cannot take `config` (GPTConfig checks the rest), or if
    `config` sets a field another architecture owns."""
    arch = arch_of(config.arch)
    for owner in ARCHS.values():
        for field, what in owner.own_settings.items():
            if owner is not arch and getattr(config, field) != getattr(GPTConfig, field):
                raise ValueError(
                    f"{field} is {what}: it needs arch={owner.model.arch!r}, not {config.arch!r}"
                )
    arch.model.check_config(config)


def check_settings(c):
    """A one-line UsageError for a run's setting (train.py's `c`) that its architecture refuses:
    an optimizer or a setting another one owns, or its own refusals (Arch.check_settings)."""
    arch = arch_of(c["arch"])
    for owner in ARCHS.values():
        if owner is arch:
            continue
        if what := owner.own_optimizers.get(c["optimizer"]):
            raise UsageError(
                f"optimizer={c['optimizer']!r} is {what}: use it with --arch={owner.model.arch}"
            )
        for key, (off, what) in owner.own_run_settings.items():
            if c[key] != off:
                raise UsageError(f"{key} is {what}: use it with --arch={owner.model.arch}")
    arch.check_settings(c)


def check_run(config: GPTConfig, device):
    """A one-line UsageError if config.attention cannot run on `device`'s kind, before anything is
    written (each architecture's kernels: Arch.check_run)."""
    arch_of(config.arch).check_run(config, device)


def build(config: GPTConfig, rngs: nnx.Rngs):
    """A new model of config.arch, its params drawn from `rngs`."""
    return arch_of(config.arch).model(config, rngs)


def model_from(config: GPTConfig, state, mesh=None):
    """A model of config.arch holding `state` ({HF name: array}), with no random init on the way."""
    return arch_of(config.arch).model.from_state(config, state, mesh)


def load_pretrained(name_or_path, mesh=None, n_head=None, **settings):
    """(model, training config or None) from a GPT-2 hub name, an HF directory, a nanoGPT ckpt.pt
    (a file or a nanoGPT out_dir) or a modded-nanogpt state_step*.pt: the config carries a nanoGPT
    run's dataset, for its meta.pkl. n_head: a state_step*.pt's (pretrained.read_modded). settings:
    GPTConfig's run choices (model.RUNTIME_FIELDS)."""
    config_args, state, train_config = pretrained.read_pretrained(name_or_path, n_head=n_head)
    config = replace(GPTConfig(**config_args), **settings)
    return model_from(config, state, mesh), train_config
