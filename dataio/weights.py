"""
GPT-2 weights in and out of other formats, for GPT.from_pretrained / save_pretrained and export.py.
File formats only: readers return GPTConfig's arguments and tensors, writers take a model; model.py
builds the GPT.

- HF GPT-2 directories (config.json + model.safetensors, or a sharded index), read and written with
  safetensors' numpy API: no torch. By hub name they come through huggingface_hub (its cache,
  HF_HOME, HF_HUB_OFFLINE). Only a directory holding nothing but pytorch_model.bin needs torch.
- nanoGPT's ckpt.pt and modded-nanogpt's state_step*.pt: dataio/pretrained.py, on this file's table.

Readers return a lazy {HF name: array} mapping: a tensor is read from disk when load_state_dict
places it. An arch='speedrun' model's names are GPT-2's for the params it has (its fused c_attn
too), in HF's (in, out) layout.
"""

import json
import os
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from compute import sharding
from configurator import InputNotFound, UsageError

# The one weight map: (HF name, our path, nn.Linear weight?). HF's Conv1D stores weights as (in,
# out), the layout of nnx.Linear kernels: copied as they are. nanoGPT's state dict has the same
# names, but its torch nn.Linear weights are (out, in): the rows marked True are transposed to and
# from it. HF's and nanoGPT's lm_head.weight is the same tensor as wte.weight: one row here. "{i}"
# is the layer index.
WEIGHT_MAP = [
    ("transformer.wte.weight", "wte.embedding", False),
    ("transformer.wpe.weight", "wpe.embedding", False),
    ("transformer.h.{i}.ln_1.weight", "h.{i}.ln_1.scale", False),
    ("transformer.h.{i}.ln_1.bias", "h.{i}.ln_1.bias", False),
    ("transformer.h.{i}.attn.c_attn.weight", "h.{i}.attn.c_attn.kernel", True),
    ("transformer.h.{i}.attn.c_attn.bias", "h.{i}.attn.c_attn.bias", False),
    ("transformer.h.{i}.attn.c_proj.weight", "h.{i}.attn.c_proj.kernel", True),
    ("transformer.h.{i}.attn.c_proj.bias", "h.{i}.attn.c_proj.bias", False),
    ("transformer.h.{i}.ln_2.weight", "h.{i}.ln_2.scale", False),
    ("transformer.h.{i}.ln_2.bias", "h.{i}.ln_2.bias", False),
    ("transformer.h.{i}.mlp.c_fc.weight", "h.{i}.mlp.c_fc.kernel", True),
    ("transformer.h.{i}.mlp.c_fc.bias", "h.{i}.mlp.c_fc.bias", False),
    ("transformer.h.{i}.mlp.c_proj.weight", "h.{i}.mlp.c_proj.kernel", True),
    ("transformer.h.{i}.mlp.c_proj.bias", "h.{i}.mlp.c_proj.bias", False),
    ("transformer.ln_f.weight", "ln_f.scale", False),
    ("transformer.ln_f.bias", "ln_f.bias", False),
]
TIED_KEY = "lm_head.weight"  # == transformer.wte.weight, in HF's and nanoGPT's state dicts
HF_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# causal-mask buffers, not weights: HF's, and nanoGPT's attn.bias when torch has no flash attention
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
# HF activation_function -> GPTConfig.gelu. GPT-2's "gelu_new" is the tanh approximation; "gelu" is
# exact (erf)
HF_GELU = {"gelu_new": "tanh", "gelu": "exact"}
# the params of arch='speedrun' (record 5): no position embedding, no LayerNorms, no biases
SPEEDRUN_PARAMS = (
    "wte.embedding",
    "attn.c_attn.kernel",
    "attn.c_proj.kernel",
    "mlp.c_fc.kernel",
    "mlp.c_proj.kernel",
)


# arch='speedrun20' (record 20): its state dict's names for each of our params, (our path, its
# name, nn.Linear weight?). Its layers differ (layer 7 has no attention), so the rows come from the
# model's own params (rows_matching). Its qkv_w (3, C, C) is c_attn's (C, 3C) kernel:
# dataio/pretrained.py reshapes it.
RECORD20_NAMES = [
    (r"wte\.embedding", "embed.weight", False),
    (r"ve\.(\d+)\.embedding", r"value_embeds.embed.\1.weight", False),
    (r"h\.(\d+)\.attn\.c_attn\.kernel", r"blocks.\1.attn.qkv_w", True),
    (r"h\.(\d+)\.attn\.lambdas", r"blocks.\1.attn.lambdas", False),
    (r"h\.(\d+)\.attn\.c_proj\.kernel", r"blocks.\1.attn.c_proj.weight", True),
    (r"h\.(\d+)\.mlp\.c_fc\.kernel", r"blocks.\1.mlp.c_fc.weight", True),
    (r"h\.(\d+)\.mlp\.c_proj\.kernel", r"blocks.\1.mlp.c_proj.weight", True),
    (r"h\.(\d+)\.lambdas", r"blocks.\1.lambdas", False),
    (r"skip_weights", "skip_weights", False),
    (r"lm_head", "lm_head.weight", False),
]


def rows_matching(model, table):
    """weight_rows of a model whose names `table` gives by pattern ([(our path's regex, its name,
    nn.Linear weight?)]: record 20's RECORD20_NAMES), one row per param."""
    rows = []
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        ours = ".".join(map(str, path))
        for pattern, name, linear in table:
            if m := re.fullmatch(pattern, ours):
                rows.append((m.expand(name), ours, linear))
                break
        else:
            raise AssertionError(f"{ours} has no row in the table of {type(model).__name__}")
    return rows


def weight_map(n_layer, bias=True, kept=None):
    """[(HF name, our path, nn.Linear weight?)] for a model with n_layer blocks; `kept`: only the
    paths ending in one of these (record 5's SPEEDRUN_PARAMS)."""
    rows = []
    for hf, ours, linear in WEIGHT_MAP:
        if (not bias and hf.endswith(".bias")) or (kept and not ours.endswith(kept)):
            continue
        for i in range(n_layer) if "{i}" in hf else [None]:
            rows.append((hf.format(i=i), ours.format(i=i), linear))
    return rows


def _variable(model, path):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _slot(model, ours):
    """(our variable, layer index or None) for a path of the map: with scan_layers, h.{i}.x is row i
    of h.x."""
    if model.config.scan_layers and ours.startswith("h."):
        i, rest = ours[2:].split(".", 1)
        return _variable(model, "h." + rest), int(i)
    return _variable(model, ours), None


def state_dict(model, zero_biases=False):
    """Our params as {HF name: float32 numpy array}, HF's layout. zero_biases: a bias=False model
    with the biases HF's GPT-2 always has, as zeros (the same function)."""

    def read(ours):
        var, layer = _slot(model, ours)
        return np.asarray(var[...] if layer is None else var[layer], np.float32)

    state = {hf: read(ours) for hf, ours, _ in model.weight_rows()}
    if zero_biases and not model.config.bias:
        for hf, _, _ in weight_map(model.config.n_layer):
            if hf not in state:  # a bias is as long as its weight's last axis (HF's layout: out)
                state[hf] = np.zeros(state[hf.replace(".bias", ".weight")].shape[-1], np.float32)
    return state


def load_state_dict(model, state, mesh=None):
    """Copy {HF name: array} (HF's layout) into the model in place; key sets and shapes must match
    exactly. The one function that puts arrays into a model: each value is read from `state` here,
    once. With a mesh, each is split by its spec as it is placed (each device receives only its
    shard)."""
    c = model.config
    rows = model.weight_rows()
    expected = {hf for hf, _, _ in rows}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise UsageError(
            f"the weights do not match the {c.arch} model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    layers = {}  # scan_layers: {stacked path: its rows in layer order}, each set once all are read
    for hf, ours, _ in rows:
        var, layer = _slot(model, ours)
        value = np.asarray(state[hf], dtype=np.float32)
        shape = tuple(var.shape) if layer is None else tuple(var.shape[1:])
        if value.shape != shape:
            raise UsageError(f"shape mismatch for {hf}: checkpoint {value.shape}, model {shape}")
        if layer is None:
            _place(var, value, ours, mesh)
        else:
            layers.setdefault("h." + ours.split(".", 2)[2], []).append(value)
    for path, values in layers.items():
        _place(_variable(model, path), np.stack(values), path, mesh)


def _place(var, value, ours, mesh):
    value = value.astype(var.dtype, copy=False)  # float32, or record 20's bf16 tables (embed_dtype)
    if mesh is None:
        var.set_value(jnp.asarray(value))
    else:  # each device receives only its shard
        var.set_value(
            jax.device_put(
                value, jax.sharding.NamedSharding(mesh, sharding.spec_for(ours, value.shape, mesh))
            )
        )


class LazyState(Mapping):
    """{name: array} whose values are read when asked for: read(name) -> numpy array."""

    def __init__(self, names, read):
        self._names, self._read = list(names), read

    def __getitem__(self, name):
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


def _hf_name(name):
    """HF's names, with the 'transformer.' prefix: GPT2LMHeadModel writes it, GPT2Model (OpenAI's
    gpt2 on the hub) does not."""
    return name if name.startswith("transformer.") or name == TIED_KEY else "transformer." + name


def untied(state, where):
    """state without lm_head.weight, which must be wte.weight."""
    if TIED_KEY not in state:
        return state
    if not np.array_equal(np.asarray(state[TIED_KEY]), np.asarray(state["transformer.wte.weight"])):
        raise UsageError(f"{where}: lm_head.weight differs from wte.weight; GPT-2 ties them")
    return LazyState([k for k in state if k != TIED_KEY], state.__getitem__)


# ------------------------------------------------------------------------------------------------
# HF GPT-2 directories

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def hf_directory(name_or_path):
    """A local HF GPT-2 directory: the path itself, or the hub model's snapshot in the HF cache
    (downloaded once; offline with HF_HUB_OFFLINE=1)."""
    if os.path.isdir(name_or_path):
        if not os.path.exists(os.path.join(name_or_path, "config.json")) or not any(
            os.path.exists(os.path.join(name_or_path, f)) for f in HF_WEIGHT_FILES
        ):
            raise InputNotFound(
                f"{name_or_path} is not an HF GPT-2 directory: it needs config.json and "
                "model.safetensors (as written by save_pretrained)"
            )
        return name_or_path
    if name_or_path not in HF_NAMES:
        raise UsageError(
            f"unknown model {name_or_path!r}: use one of {', '.join(HF_NAMES)}, an HF directory, "
            "a nanoGPT ckpt.pt or a modded-nanogpt state_step*.pt"
        )
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(name_or_path, allow_patterns=["config.json", "model.safetensors*"])
    except OSError as e:  # no network, not in the cache, hub errors
        raise InputNotFound(
            f"could not load {name_or_path!r} from the HF hub or the local HF cache (offline?); "
            "pass a local directory written by save_pretrained instead"
        ) from e
    return path


def read_hf_config(path):
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if hf.get("model_type") != "gpt2":
        raise UsageError(f"{path} holds a {hf.get('model_type')!r} model, not gpt2")
    return hf


def read_hf_weights(path):
    """{HF name: array}, lazily, from model.safetensors, a sharded index, or (with torch)
    pytorch_model.bin; without the causal-mask buffers and lm_head.weight (checked to be
    wte.weight)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        files = {None: os.path.join(path, "model.safetensors")}
    elif os.path.exists(index):
        with open(index) as f:
            shard_of = json.load(f)["weight_map"]  # {name: shard file}
        files = {shard: os.path.join(path, shard) for shard in set(shard_of.values())}
    else:
        state = torch_load(os.path.join(path, "pytorch_model.bin"))
        state = {
            _hf_name(k): v.float().numpy() for k, v in state.items() if not k.endswith(MASK_BUFFERS)
        }
        return untied(state, path)
    from safetensors import safe_open

    handles = {shard: safe_open(file, framework="numpy") for shard, file in files.items()}
    where = {
        _hf_name(name): (h, name)
        for h in handles.values()
        for name in h.keys()
        if not name.endswith(MASK_BUFFERS)
    }

    def read(name):
        handle, stored = where[name]
        return handle.get_tensor(stored)

    return untied(LazyState(where, read), path)


def torch_load(path):
    """The object torch.save wrote to `path` (no code runs: weights_only); a file torch cannot read
    is one line."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a file that is not a checkpoint
        raise UsageError(
            f"{path} is not a torch checkpoint ({type(e).__name__}: {str(e)[:200]})"
        ) from e


def config_from_hf(hf: dict):
    """GPTConfig's arguments from an HF GPT-2 config.json (a dict: keys left out have GPT2Config's
    defaults); refuses the variants our model does not compute."""
    n_embd = hf.get("n_embd", 768)
    activation = hf.get("activation_function", "gelu_new")
    unsupported = {
        "activation_function": (activation if activation in HF_GELU else "gelu_new", activation),
        "layer_norm_epsilon": (1e-5, hf.get("layer_norm_epsilon", 1e-5)),
        "n_inner": (None, hf.get("n_inner") if hf.get("n_inner") != 4 * n_embd else None),
        "scale_attn_weights": (True, hf.get("scale_attn_weights", True)),
        "scale_attn_by_inverse_layer_idx": (
            False,
            hf.get("scale_attn_by_inverse_layer_idx", False),
        ),
        "tie_word_embeddings": (True, hf.get("tie_word_embeddings", True)),
    }
    bad = {k: got for k, (want, got) in unsupported.items() if got != want}
    if bad:
        raise UsageError(f"not a GPT-2 architecture this model computes: {bad}")
    return dict(
        block_size=hf.get("n_positions", 1024),
        vocab_size=hf.get("vocab_size", 50257),
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        n_embd=n_embd,
        bias=True,
        gelu=HF_GELU[activation],
    )


def hf_config_for(config):
    """config.json for transformers' GPT2LMHeadModel computing what `config` computes."""
    eot = 50256 if config.vocab_size > 50256 else None  # <|endoftext|>, where the vocabulary has it
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_positions": config.block_size,
        "vocab_size": config.vocab_size,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "activation_function": {v: k for k, v in HF_GELU.items()}[config.gelu],
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "dtype": "float32",
    }


def check_export(model, fmt):
    """A one-line UsageError if export format `fmt` cannot hold the model (its class's
    `exports`)."""
    if fmt not in model.exports:
        raise UsageError(
            f"--format={fmt} cannot hold this model, arch={model.config.arch!r} ({model.title}): "
            f"export it with {' or '.join(f'--format={f}' for f in model.exports)}"
        )


def save_hf(model, out_dir):
    """An HF GPT-2 directory (config.json + model.safetensors) that GPT2LMHeadModel.from_pretrained
    loads; a bias=False model gets zero biases (HF's GPT-2 always has them: the same function)."""
    from safetensors.numpy import save_file

    check_export(model, "hf")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_for(model.config), f, indent=2)
    path = os.path.join(out_dir, "model.safetensors")
    # lm_head.weight is left out, as transformers' save_pretrained leaves out a tied weight
    save_file(state_dict(model, zero_biases=True), path, metadata={"format": "pt"})
    # safetensors writes a temporary file (mode 0600, as mkstemp makes it) and renames it over
    # `path`: the mode every other file gets instead, the umask's
    os.chmod(path, 0o666 & ~umask())


def umask():
    """This process's umask, read (os.umask only sets it: setting it back at once leaves a moment
    where a file another thread creates gets the wrong mode)."""
    try:
        with open("/proc/self/status") as f:  # Linux 4.7+
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration):
        mask = os.umask(0o077)  # briefly the strictest mode, never a looser one
        os.umask(mask)
        return mask


def load_hf_model(name_or_path):
    """transformers.GPT2LMHeadModel (float32, eval) from a hub name or an HF directory: the torch
    reference of parity/ (parity/check_hellaswag.py among them)."""
    from transformers import GPT2LMHeadModel

    path = hf_directory(name_or_path)
    read_hf_config(path)  # a directory of another model type fails with one line
    return GPT2LMHeadModel.from_pretrained(
        path, dtype="float32", attn_implementation="eager"
    ).eval()
