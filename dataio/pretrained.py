"""
Pretrained weights from any format, and the torch .pt formats in and out (on dataio/weights.py's
table): read_pretrained takes a GPT-2 hub name or HF directory (dataio/weights.py), a nanoGPT
ckpt.pt (or its out_dir) or a modded-nanogpt state_step*.pt, told apart by their keys, or a
nanochat checkpoint directory (dataio/nanochat_checkpoint.py).

- nanoGPT's ckpt.pt (torch.save of {'model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss',
  'config'}): torch is needed to read or write it, imported only then.
- modded-nanogpt's state_step*.pt (torch.save of {'step', 'code', 'model', 'optimizers'}, record 5's
  GPT): the arch='speedrun' model, torch again.
"""

import os
import re
from collections.abc import Mapping

import numpy as np

from configurator import UsageError
from dataio.nanochat_checkpoint import nanochat_checkpoint, read_nanochat
from dataio.weights import (
    MASK_BUFFERS,
    TIED_KEY,
    LazyState,
    check_export,
    config_from_hf,
    hf_directory,
    read_hf_config,
    read_hf_weights,
    state_dict,
    torch_load,
    untied,
    weight_map,
)

COMPILED_PREFIX = "_orig_mod."  # torch.compile'd models save their state dict under it
# its model_args
NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")


# ------------------------------------------------------------------------------------------------
# nanoGPT's ckpt.pt

NANOGPT_CKPT = "ckpt.pt"


def nanogpt_checkpoint(init_from):
    """The .pt that `init_from` names (the file: a nanoGPT ckpt.pt or a modded-nanogpt
    state_step*.pt, or a nanoGPT out_dir holding a ckpt.pt), else None."""
    if os.path.isfile(init_from) and init_from.endswith(".pt"):
        return init_from
    path = os.path.join(init_from, NANOGPT_CKPT)
    return path if os.path.isdir(init_from) and os.path.isfile(path) else None


def read_pt(path, n_head=None):
    """A .pt checkpoint, told apart by its keys: nanoGPT's ckpt.pt (read_nanogpt) or
    modded-nanogpt's state_step*.pt (read_modded; n_head: its heads). Anything else is one line
    naming what was expected."""
    ckpt = torch_load(path)
    if isinstance(ckpt, dict) and "model_args" in ckpt:
        return read_nanogpt(path, ckpt)
    return read_modded(path, n_head, ckpt)


def read_nanogpt(path, ckpt=None):
    """nanoGPT's ckpt.pt -> (GPTConfig's arguments: its model_args with the exact GELU, {HF name:
    array} in HF's layout, lazily transposed, its training config dict). ckpt: the file's dict, when
    already loaded."""
    ckpt = torch_load(path) if ckpt is None else ckpt
    try:
        args, model_state = ckpt["model_args"], ckpt["model"]
    except (KeyError, TypeError, IndexError) as e:
        raise UsageError(
            f"{path} is not a nanoGPT checkpoint ({type(e).__name__}: {str(e)[:200]})"
        ) from e
    # nanoGPT's GPT computes F.gelu, the exact erf GELU
    config = {**{k: args[k] for k in NANOGPT_ARGS if k != "dropout"}, "gelu": "exact"}
    model_state = {k.removeprefix(COMPILED_PREFIX): v for k, v in model_state.items()}
    linear = linear_names(config["n_layer"], config["bias"])
    names = [k for k in model_state if not k.endswith(MASK_BUFFERS)]

    def read(name):  # (out, in) nn.Linear weights -> (in, out)
        value = model_state[name].float().numpy()
        return value.T if name in linear else value

    return config, untied(LazyState(names, read), path), ckpt.get("config") or {}


def linear_names(n_layer, bias):
    """The HF names of the weights nanoGPT holds as torch nn.Linear, (out, in): transposed to and
    from it."""
    return {hf for hf, _, is_linear in weight_map(n_layer, bias) if is_linear}


def save_nanogpt(model, path, iter_num=0, best_val_loss=None, config=None):
    """A ckpt.pt that nanoGPT's model.py and sample.py load: its key names, nn.Linear layout,
    lm_head.weight, model_args; `config` (the training settings, with `dataset`: its sample.py finds
    meta.pkl through it). No optimizer state: an export holds the weights."""
    import torch

    check_export(model, "nanogpt")
    c = model.config
    if c.gelu != "exact":
        raise UsageError(
            "nanoGPT's model computes the exact GELU and this model uses GPT-2's tanh one: export "
            "it with --format=hf, or train with --gelu=exact"
        )
    linear = linear_names(c.n_layer, c.bias)
    state = {
        k: torch.from_numpy(np.array(v.T if k in linear else v, order="C"))
        for k, v in state_dict(model).items()
    }
    # tied: nanoGPT's state dict has both names, one tensor
    state[TIED_KEY] = state["transformer.wte.weight"]
    model_args = {k: getattr(c, k) for k in NANOGPT_ARGS}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(
        {
            "model": state,
            "optimizer": None,
            "model_args": model_args,
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": dict(config or {}),
        },
        path,
    )


# ------------------------------------------------------------------------------------------------
# modded-nanogpt's state_step*.pt: record 5's GPT, our arch='speedrun'

RECORD_N_HEAD = 6  # record 5's GPTConfig(n_head=6) (head dim 128): its state dict cannot tell
# record 5's sequence_length; rotary serves any length, block_size only bounds ours
RECORD_BLOCK_SIZE = 1024
# the record's separate (out, in) weights: our fused c_attn's column thirds
RECORD_QKV = ("c_q", "c_k", "c_v")
WTE = "transformer.wte.weight"


def _numpy(value):
    """A torch tensor or an array -> float32 numpy."""
    return (
        value.detach().float().numpy()
        if hasattr(value, "detach")
        else np.asarray(value, np.float32)
    )


def from_modded_state(record_state, where="the state dict"):
    """Record 5's state dict ({its name: (out, in) tensor or array}, with or without torch.compile's
    _orig_mod. prefix) -> {HF name: array} of our arch='speedrun' GPT, lazily: c_q, c_k, c_v
    transposed into c_attn's column thirds [q | k | v], every other nn.Linear weight transposed,
    lm_head.weight checked to be the embedding. Names it has no place for pass through, for
    load_state_dict to name as unexpected."""
    record = {k.removeprefix(COMPILED_PREFIX): v for k, v in record_state.items()}
    if WTE not in record:
        raise UsageError(
            f"{where}: a modded-nanogpt state dict has {WTE}; this one has {sorted(record)[:5]}"
        )
    fused = {
        n.replace(".c_q.", ".c_attn.")
        for n in record
        if n.endswith(".attn.c_q.weight")
        and all(n.replace(".c_q.", f".{w}.") in record for w in RECORD_QKV)
    }
    parts = {n.replace(".c_attn.", f".{w}.") for n in fused for w in RECORD_QKV}

    def read(name):
        if name in fused:  # (C, 3C): [q | k | v]
            return np.concatenate(
                [_numpy(record[name.replace(".c_attn.", f".{w}.")]).T for w in RECORD_QKV], axis=1
            )
        value = _numpy(record[name])
        # (out, in) -> (in, out)
        return value if name in (WTE, TIED_KEY) or value.ndim != 2 else value.T

    return untied(LazyState([n for n in record if n not in parts] + sorted(fused), read), where)


def modded_config(state, n_head=None):
    """GPTConfig's arguments for from_modded_state's output: vocab and width from the embedding,
    depth from the layer names; n_head as given (None: the record's 6), which the state dict cannot
    tell."""
    vocab_size, n_embd = state[WTE].shape
    n_head = RECORD_N_HEAD if n_head is None else n_head
    if n_head < 1 or n_embd % n_head or (n_embd // n_head) % 2:
        raise UsageError(
            f"n_head={n_head} does not split n_embd={n_embd} into heads of an even size: set "
            "n_head to the run's (record 5: 6)"
        )
    n_layer = 1 + max(
        (int(k.split(".")[2]) for k in state if k.startswith("transformer.h.")), default=-1
    )
    return dict(
        block_size=RECORD_BLOCK_SIZE,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        bias=False,
        arch="speedrun",
    )


def read_modded(path, n_head=None, ckpt=None):
    """modded-nanogpt's state_step*.pt -> (GPTConfig's arguments, {HF name: array}, None). The
    heads: n_head, else those the file's `code` (the training script, which it saves) builds its
    GPTConfig with, else the record's 6; an n_head the code contradicts is one line. ckpt: the
    file's dict, when already loaded."""
    ckpt = torch_load(path) if ckpt is None else ckpt
    state = ckpt.get("model") if isinstance(ckpt, dict) else None
    if isinstance(state, Mapping) and any(str(k).endswith(RECORD20_KEY) for k in state):
        return read_record20(path, state, str(ckpt.get("code") or ""), n_head)
    if not isinstance(state, Mapping) or not any(
        str(k).endswith(".attn.c_q.weight") for k in state
    ):
        held = sorted(map(str, ckpt))[:6] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise UsageError(
            f"{path} is neither a nanoGPT ckpt.pt (a dict with model and model_args) nor a "
            "state_step*.pt of modded-nanogpt's record 5 or 20 (a dict whose model has "
            f"transformer.h.*.attn.c_q.weight or blocks.*.attn.qkv_w): it holds {held}"
        )
    coded = re.search(r"GPTConfig\([^)]*\bn_head\s*=\s*(\d+)", str(ckpt.get("code") or ""))
    if coded and n_head not in (None, int(coded[1])):
        raise UsageError(
            f"{path} was trained with n_head={coded[1]} (its code says so), not {n_head}: set "
            f"n_head={coded[1]}"
        )
    state = from_modded_state(state, path)
    return modded_config(state, int(coded[1]) if coded else n_head), state, None


def to_modded_state(model):
    """Our arch='speedrun' GPT -> record 5's state dict {its name: (out, in) float32 numpy},
    lm_head.weight included (the embedding's array itself): what the record's GPT.load_state_dict
    takes."""
    record = {}
    for name, value in state_dict(model).items():
        if name.endswith(".attn.c_attn.weight"):  # (C, 3C) -> c_q, c_k, c_v
            record.update(
                (name.replace(".c_attn.", f".{w}."), third.T)
                for w, third in zip(RECORD_QKV, np.split(value, 3, axis=1))
            )
        else:
            record[name] = value if name == WTE else value.T
    # writable: torch takes no read-only arrays
    record = {k: np.array(v, order="C") for k, v in record.items()}
    record[TIED_KEY] = record[WTE]
    return record


def record5_code(c):
    """The line of record 5's script that builds a GPT of config `c` (read_modded reads n_head
    from it)."""
    return (
        "# nanogpt-jax export.py: record 5's GPT (2024-10-14_ModernArch)\nmodel = "
        f"GPT(GPTConfig(vocab_size={c.vocab_size}, n_layer={c.n_layer}, n_head={c.n_head}, "
        f"n_embd={c.n_embd}))\n"
    )


def save_modded(model, path, step=0):
    """A state_step*.pt as records 5 and 20 write it: {step, code, model, optimizers}, the state
    dict's keys under torch.compile's _orig_mod. prefix; `code` the line of the record's script
    that builds its GPT. The state and the line are the model class's (modded_state); an array that
    stands twice in it is one tensor (record 5's lm_head.weight and embedding). No optimizer state:
    an export holds weights."""
    import torch

    check_export(model, "modded")
    state, code = model.modded_state()
    tensors = {}  # by the array's id: one tensor for one array
    for v in state.values():
        if id(v) not in tensors:
            tensors[id(v)] = torch.from_numpy(v)
    record = {COMPILED_PREFIX + k: tensors[id(v)] for k, v in state.items()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save({"step": step, "code": code, "model": record, "optimizers": []}, path)


# ------------------------------------------------------------------------------------------------
# record 20's GPT (2025-01-16_Sub3Min), our arch='speedrun20': its state dict's names are
# weights.RECORD20_NAMES'

RECORD20_N_HEAD = 6  # the record's GPT(num_heads=6): its state dict cannot tell
RECORD20_SEQ_LEN = 64 * 1024  # the record's sequence: 64K tokens a device
RECORD20_LINEAR = re.compile(r"\.(c_proj|c_fc)\.weight$")  # (out, in): transposed
RECORD20_QKV = ".attn.qkv_w"  # (3, C, C) [q; k; v], each (out, in): c_attn's (C, 3C) kernel
RECORD20_KEY = "blocks.0.attn.qkv_w"  # a state dict holding it is record 20's


def from_record20_state(record_state):
    """Record 20's state dict ({its name: tensor or array}, with or without torch.compile's
    _orig_mod. prefix) -> {its name: array in our layout}, lazily."""
    record = {k.removeprefix(COMPILED_PREFIX): v for k, v in record_state.items()}

    def read(name):
        value = _numpy(record[name])
        if name.endswith(RECORD20_QKV):
            return value.reshape(-1, value.shape[-1]).T  # (3C, C) -> (C, 3C): [q | k | v]
        return value.T if RECORD20_LINEAR.search(name) else value

    return LazyState(list(record), read)


def to_record20_state(model):
    """Our arch='speedrun20' GPT -> record 20's state dict {its name: float32 numpy}, its layouts:
    what its GPT.load_state_dict takes."""
    record = {}
    for name, value in state_dict(model).items():
        if name.endswith(RECORD20_QKV):
            value = value.T.reshape(3, value.shape[0], value.shape[0])
        elif RECORD20_LINEAR.search(name):
            value = value.T
        record[name] = np.array(value, order="C")  # writable: torch takes no read-only arrays
    return record


def record20_code(c):
    """The line of record 20's script that builds a GPT of config `c` (read_record20 reads
    num_heads from it)."""
    return (
        "# nanogpt-jax export.py: record 20's GPT (2025-01-16_Sub3Min)\nmodel = "
        f"GPT(vocab_size={c.vocab_size}, num_layers={c.n_layer}, num_heads={c.n_head}, "
        f"model_dim={c.n_embd})\n"
    )


def read_record20(path, state, code, n_head=None):
    """Record 20's state dict, read from `path` -> (GPTConfig's arguments, {its name: array}, None).
    The heads: n_head, else those its `code` builds its GPT with (num_heads=6 in the record), else
    the record's 6; an n_head the code contradicts is one line."""
    coded = re.search(r"\bnum_heads\s*=\s*(\d+)", code)
    if coded and n_head not in (None, int(coded[1])):
        raise UsageError(
            f"{path} was trained with num_heads={coded[1]} (its code says so), not {n_head}: set "
            f"n_head={coded[1]}"
        )
    state = from_record20_state(state)
    return record20_config(state, int(coded[1]) if coded else n_head), state, None


def record20_config(state, n_head=None):
    """GPTConfig's arguments for from_record20_state's output: vocab and width from the embedding,
    depth from the layer names; n_head as given (None: the record's 6)."""
    vocab_size, n_embd = state["embed.weight"].shape
    n_head = RECORD20_N_HEAD if n_head is None else n_head
    if n_head < 1 or n_embd % n_head or (n_embd // n_head) % 4:
        raise UsageError(
            f"n_head={n_head} does not split n_embd={n_embd} into heads of a multiple of 4: set "
            "n_head to the run's (record 20: 6)"
        )
    n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    return dict(
        block_size=RECORD20_SEQ_LEN,
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        bias=False,
        arch="speedrun20",
    )


# ------------------------------------------------------------------------------------------------


def read_pretrained(name_or_path, n_head=None):
    """(GPTConfig's arguments, {HF name: array}, training config or None) from a GPT-2 hub name, an
    HF directory, a nanoGPT ckpt.pt (a file or a nanoGPT out_dir), a modded-nanogpt state_step*.pt
    (n_head: its heads, see read_modded; other formats know theirs) or a nanochat checkpoint (its
    directory or a model_NNNNNN.pt: its names, read_nanochat): the config carries a nanoGPT run's
    dataset, for its meta.pkl, or a nanochat checkpoint's vocab, 'nanochat'."""
    nanochat = nanochat_checkpoint(name_or_path)
    if nanochat is not None:
        return read_nanochat(*nanochat)
    ckpt = nanogpt_checkpoint(name_or_path)
    if ckpt is not None:
        return read_pt(ckpt, n_head)
    path = hf_directory(name_or_path)
    return config_from_hf(read_hf_config(path)), read_hf_weights(path), None
