"""
Every architecture by its GPTConfig.arch: GPT-2 (model.py) and the speedrun's records
(archs/speedrun_model.py). The rest of the project builds, restores and loads a model here, then
uses the interface every one of them has (docs/model.md): train_step, checkpoint, generate,
hellaswag, eval and parity never ask which architecture they hold.
"""

from dataclasses import replace

from flax import nnx

from archs import window_attention
from archs.speedrun_model import Record5GPT, Record20GPT
from compute import attention
from dataio import pretrained
from model import ARCHS, GPT, GPTConfig

MODELS = {"gpt2": GPT, "speedrun": Record5GPT, "speedrun20": Record20GPT}
assert tuple(MODELS) == ARCHS


def check_config(config: GPTConfig):
    """ValueError if config.arch's model cannot take `config` (GPTConfig checks the rest)."""
    MODELS[config.arch].check_config(config)


def check_run(config: GPTConfig, device):
    """A one-line UsageError if config.attention cannot run on `device`'s kind, before anything is
    written: record 20's windowed kernels (window_attention.check_run), or the others'."""
    kernels = window_attention if config.arch == "speedrun20" else attention
    kernels.check_run(config, device)


def build(config: GPTConfig, rngs: nnx.Rngs):
    """A new model of config.arch, its params drawn from `rngs`."""
    return MODELS[config.arch](config, rngs)


def model_from(config: GPTConfig, state, mesh=None):
    """A model of config.arch holding `state` ({HF name: array}), with no random init on the way."""
    return MODELS[config.arch].from_state(config, state, mesh)


def load_pretrained(name_or_path, mesh=None, n_head=None, **settings):
    """(model, training config or None) from a GPT-2 hub name, an HF directory, a nanoGPT ckpt.pt
    (a file or a nanoGPT out_dir) or a modded-nanogpt state_step*.pt: the config carries a nanoGPT
    run's dataset, for its meta.pkl. n_head: a state_step*.pt's (pretrained.read_modded). settings:
    GPTConfig's run choices (model.RUNTIME_FIELDS)."""
    config_args, state, train_config = pretrained.read_pretrained(name_or_path, n_head=n_head)
    config = replace(GPTConfig(**config_args), **settings)
    return model_from(config, state, mesh), train_config
