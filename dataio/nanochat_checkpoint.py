"""
nanochat's checkpoints (nanochat/checkpoint_manager.py), in and out: a directory holding, for each
saved step, model_NNNNNN.pt (torch.save of its GPT's state dict: keys under torch.compile's
_orig_mod. where it was compiled, the embeddings bf16 where it trained in bf16) and
meta_NNNNNN.json (base_train's: step, val_bpb, model_config with its GPTConfig's fields, ...).
Read as its build_model reads one, written as its base_train writes one, so that its build_model
loads ours strictly. torch reads and writes the .pt (the parity extras), imported only then.
"""

import json
import os
import re

import numpy as np

from configurator import UsageError
from dataio import storage
from dataio.weights import LazyState, check_export, torch_load

COMPILED_PREFIX = "_orig_mod."  # torch.compile'd models save their state dict under it
MODEL_FILE = re.compile(r"^model_(\d+)\.pt$")
# its GPTConfig's fields, as its meta's model_config holds them
GPTCONFIG_FIELDS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
SAVED_BY = "as nanochat's base_train saves them"


def model_file(step):
    return f"model_{step:06d}.pt"


def meta_file(step):
    return f"meta_{step:06d}.json"


def steps_in(directory):
    """The steps of the model_NNNNNN.pt files in a local `directory`, sorted."""
    return sorted(int(m[1]) for m in map(MODEL_FILE.match, os.listdir(directory)) if m)


def nanochat_checkpoint(init_from):
    """(directory, step) of the nanochat checkpoint `init_from` names: a model_NNNNNN.pt file, or
    a directory holding model_*.pt (the largest step, as its find_last_step) or meta_*.json
    (then one line: its weights are missing); else None."""
    name = os.path.basename(init_from)
    if os.path.isfile(init_from) and MODEL_FILE.match(name):
        return os.path.dirname(init_from) or ".", int(MODEL_FILE.match(name)[1])
    if not os.path.isdir(init_from):
        return None
    steps = steps_in(init_from)
    if steps:
        return init_from, steps[-1]
    if any(re.match(r"^meta_\d+\.json$", f) for f in os.listdir(init_from)):
        raise UsageError(
            f"{init_from} holds nanochat's meta_*.json but no model_NNNNNN.pt: copy its weights "
            "beside them (nanochat saves model_NNNNNN.pt with each meta_NNNNNN.json)"
        )
    return None


def config_args(model_config):
    """GPTConfig's arguments from nanochat's GPTConfig fields (a meta's model_config):
    sequence_len is block_size, window_pattern 'L' when absent (as its checkpoint_manager patches
    checkpoints from before the windows)."""
    return {
        "arch": "nanochat",
        "bias": False,
        "block_size": model_config["sequence_len"],
        **{k: model_config[k] for k in GPTCONFIG_FIELDS if k != "sequence_len"},
        "window_pattern": model_config.get("window_pattern", "L"),
    }


def model_config_of(c):
    """nanochat's GPTConfig fields of our GPTConfig `c` (n_kv_head 0, one per head, spelled)."""
    return {
        "sequence_len": c.block_size,
        "vocab_size": c.vocab_size,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_kv_head": c.n_kv_head or c.n_head,
        "n_embd": c.n_embd,
        "window_pattern": c.window_pattern,
    }


def read_meta(path):
    """A meta_NNNNNN.json's dict, holding a model_config of nanochat's GPTConfig fields; else one
    line."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path} is missing: nanochat saves it beside each model_*.pt") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} does not read as JSON ({type(e).__name__}: {e})") from None
    model_config = meta.get("model_config") if isinstance(meta, dict) else None
    missing = [k for k in GPTCONFIG_FIELDS if not isinstance((model_config or {}).get(k), int)]
    if not isinstance(model_config, dict) or missing:
        raise UsageError(
            f"{path} has no model_config of nanochat's GPTConfig fields "
            f"({', '.join(missing)} missing): not a checkpoint {SAVED_BY}"
        )
    return meta


def read_nanochat(directory, step):
    """nanochat's checkpoint of `step` in `directory` -> (GPTConfig's arguments, {its name: float32
    array} in its layout, lazily, {'vocab': 'nanochat'}: its ids are its tokenizer's). The keys'
    _orig_mod. dropped, bf16 read as float32, resid_lambdas and x0_lambdas 1 and 0 where missing:
    what its build_model does."""
    path = os.path.join(directory, model_file(step))
    meta = read_meta(os.path.join(directory, meta_file(step)))
    saved = torch_load(path)
    if not isinstance(saved, dict) or not all(hasattr(v, "detach") for v in saved.values()):
        held = sorted(map(str, saved))[:5] if isinstance(saved, dict) else type(saved).__name__
        raise UsageError(
            f"{path} is not a state dict {SAVED_BY} (names -> tensors): it holds {held}"
        )
    state = {k.removeprefix(COMPILED_PREFIX): v for k, v in saved.items()}
    args = config_args(meta["model_config"])
    patched = missing_lambdas(state, args["n_layer"])

    def read(name):
        return patched[name] if name in patched else as_array(state[name])

    return args, LazyState([*state, *patched], read), {"vocab": "nanochat"}


def missing_lambdas(state, n_layer):
    """The per-layer lambdas a checkpoint from before them lacks, neutral (resid 1, x0 0), as its
    checkpoint_manager patches them."""
    neutral = {"resid_lambdas": np.ones, "x0_lambdas": np.zeros}
    return {k: make(n_layer, np.float32) for k, make in neutral.items() if k not in state}


def as_array(value):
    """A torch tensor (bf16 too) as float32 numpy; numpy as it is (torch is optional here)."""
    return value.detach().float().cpu().numpy() if hasattr(value, "detach") else value


def as_read(state, n_layer):
    """A nanochat state dict in memory ({its name: tensor or array}) as read_nanochat reads one
    from a file: _orig_mod. dropped, float32 numpy, missing lambdas neutral."""
    state = {k.removeprefix(COMPILED_PREFIX): as_array(v) for k, v in state.items()}
    return {**missing_lambdas(state, n_layer), **state}


def save_nanochat(model, directory, step, run):
    """nanochat's checkpoint of our arch='nanochat' model in a local `directory`: model_NNNNNN.pt
    (its state dict, float32) and meta_NNNNNN.json with base_train's keys in its order, the
    model's config as model_config and the rest from `run` (val_bpb, user_config,
    device_batch_size, total_batch_size, loop_state; None where unknown). No optimizer state and
    no loader position: an export holds the weights."""
    import torch

    check_export(model, "nanochat")
    os.makedirs(directory, exist_ok=True)
    state = {k: torch.from_numpy(v) for k, v in model.nanochat_state().items()}
    torch.save(state, os.path.join(directory, model_file(step)))
    meta = {
        "step": step,
        "val_bpb": run.get("val_bpb"),
        "model_config": model_config_of(model.config),
        "user_config": run.get("user_config") or {},
        "device_batch_size": run.get("device_batch_size"),
        "max_seq_len": model.config.block_size,
        "total_batch_size": run.get("total_batch_size"),
        "dataloader_state_dict": None,
        "loop_state": run.get("loop_state"),
    }
    storage.write_bytes(
        os.path.join(directory, meta_file(step)), json.dumps(meta, indent=2).encode()
    )
