"""
The torch side's own way to the weights: transformers' GPT2LMHeadModel from any source a parity
check takes, by a path that shares no code with ours (run/checkpoint.py, dataio/pretrained.py,
dataio/weights.py), so that a bug in our loaders shows as a mismatch instead of being on both sides.

- a hub name or an HF directory: transformers' own from_pretrained;
- a nanoGPT ckpt.pt (the file, or the out_dir holding it): torch.load, then nanoGPT's names -> HF's
  written here;
- our checkpoint (init_from=resume): orbax's own restore into numpy, then our param paths -> HF's
  written here.
"""

import os
import re

import numpy as np

from configurator import UsageError

NANOGPT_CKPT = "ckpt.pt"  # what nanoGPT's train.py writes into its out_dir
COMPILED_PREFIX = "_orig_mod."  # a torch.compile'd model's state-dict keys carry it
# nanoGPT holds these as torch nn.Linear, (out, in); HF's GPT-2 holds them as Conv1D, (in, out)
NANOGPT_LINEAR = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
# our nnx leaf names -> HF's parameter names; embeddings, LayerNorm scales and kernels are all HF's
# `weight`, and our kernels are already (in, out) as HF's Conv1D
LEAF_NAMES = {"embedding": "weight", "scale": "weight", "kernel": "weight", "bias": "bias"}
# model_args a checkpoint of ours may hold that the torch model is built from; the others must be
# model.RUNTIME_FIELDS, which change how our model runs but not what it computes (a field in
# neither is refused: the reference might not compute it)
ARCH_FIELDS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias", "gelu", "arch")
# GPT-2's tanh approximation, nanoGPT's erf GELU
HF_ACTIVATION = {"tanh": "gelu_new", "exact": "gelu"}


def load(init_from, out_dir="out"):
    """transformers' GPT2LMHeadModel (float32, eval) of `init_from` as the scripts take it: 'resume'
    (out_dir's latest checkpoint), a nanoGPT ckpt.pt or its out_dir, a hub name or an HF
    directory."""
    if init_from == "resume":
        return from_orbax(out_dir)
    ckpt = nanogpt_file(init_from)
    return from_hf(init_from) if ckpt is None else from_nanogpt(ckpt)


def nanogpt_file(init_from):
    """The .pt file `init_from` names (the file itself, or a nanoGPT out_dir's ckpt.pt), else
    None."""
    ckpt = init_from if init_from.endswith(".pt") else os.path.join(init_from, NANOGPT_CKPT)
    return ckpt if os.path.isfile(ckpt) else None


def from_hf(name_or_path):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(
        name_or_path, dtype="float32", attn_implementation="eager"
    ).eval()


def build(state, *, vocab_size, block_size, n_layer, n_head, n_embd, bias, gelu, where):
    """A GPT2LMHeadModel of these sizes holding `state` ({HF name: array}, HF's layout); bias=False
    fills HF's biases with zeros (the same function); every other name must match exactly."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    eot = 50256 if vocab_size > 50256 else None  # tiny test vocabularies have no <|endoftext|>
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=block_size,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        activation_function=HF_ACTIVATION[gelu],
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=eot,
        eos_token_id=eot,
    )
    model = GPT2LMHeadModel(config).eval()
    wanted = model.state_dict()
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in state.items()}
    if "lm_head.weight" in state and not torch.equal(
        state.pop("lm_head.weight"), state["transformer.wte.weight"]
    ):
        raise UsageError(f"{where}: lm_head.weight differs from wte.weight; GPT-2 ties them")
    if not bias:
        state.update(
            {
                k: torch.zeros_like(v)
                for k, v in wanted.items()
                if k.endswith(".bias") and k not in state
            }
        )
    missing = sorted(set(wanted) - set(state) - {"lm_head.weight"})
    unexpected = sorted(set(state) - set(wanted))
    shapes = [k for k in state if k in wanted and state[k].shape != wanted[k].shape]
    if missing or unexpected or shapes:
        raise UsageError(
            f"{where}: not GPT-2's weights: missing {missing[:4]}, unexpected {unexpected[:4]}, "
            f"shapes differ {[(k, tuple(state[k].shape)) for k in shapes[:4]]}"
        )
    model.load_state_dict(state, strict=False)  # lm_head.weight: the tied wte.weight
    return model


# ------------------------------------------------------------------------------------------------
# nanoGPT's ckpt.pt


def from_nanogpt(path):
    """nanoGPT's ckpt.pt as its sample.py reads it (model_args, the state dict without
    torch.compile's prefix), its nn.Linear weights transposed into HF's Conv1D layout, the
    causal-mask buffers left out."""
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(ckpt, dict) and "model_args" in ckpt and "model" in ckpt):
        raise UsageError(
            f"{path}: the torch reference reads nanoGPT's ckpt.pt (model, model_args) and HF GPT-2 "
            "directories; this file is neither"
        )
    args = ckpt["model_args"]
    state = {}
    for name, value in ckpt["model"].items():
        name = name.removeprefix(COMPILED_PREFIX)
        # the mask, when torch had no flash attention
        if re.fullmatch(r"transformer\.h\.\d+\.attn\.bias", name):
            continue
        value = value.float().numpy()
        state[name] = value.T if name.endswith(NANOGPT_LINEAR) else value
    return build(
        state,
        vocab_size=args["vocab_size"],
        block_size=args["block_size"],
        n_layer=args["n_layer"],
        n_head=args["n_head"],
        n_embd=args["n_embd"],
        bias=args["bias"],
        gelu="exact",
        where=path,
    )


# ------------------------------------------------------------------------------------------------
# our orbax checkpoint: out_dir/ckpt/<step>/{params, opt_state, meta}


def read_orbax(out_dir, step=None):
    """(params as a nested dict of numpy arrays, meta dict) of the latest (or `step`) checkpoint in
    out_dir/ckpt, through orbax's own CheckpointManager and PyTree handler."""
    import jax
    import orbax.checkpoint as ocp

    # a bucket's URL (gs://) as it is: orbax reads it itself
    path = (
        f"{out_dir.rstrip('/')}/ckpt"
        if "://" in out_dir
        else os.path.join(os.path.abspath(out_dir), "ckpt")
    )
    if "://" not in path and not os.path.isdir(path):
        raise UsageError(f"no checkpoint in {path}")
    handlers = {
        "params": ocp.PyTreeCheckpointHandler(),
        "opt_state": ocp.PyTreeCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }
    with ocp.CheckpointManager(
        path,
        item_names=tuple(handlers),
        item_handlers=handlers,
        options=ocp.CheckpointManagerOptions(create=False),
    ) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise UsageError(f"no checkpoint in {path}")
        tree = mngr.item_metadata(step)["params"]
        as_numpy = jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), getattr(tree, "tree", tree)
        )
        got = mngr.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.PyTreeRestore(restore_args=as_numpy), meta=ocp.args.JsonRestore()
            ),
        )
    return got["params"], got["meta"]


def hf_state_from_ours(params):
    """Our params (orbax's nested dict: h/{i}/attn/c_attn/kernel/value, or with the blocks stacked
    on a leading layer axis: h/attn/c_attn/kernel/value) -> {HF name: array}."""
    state = {}

    def visit(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                visit(v, path + [str(k)])
            return
        if path[-1] == "value":  # nnx's Variable keeps its array under `value`
            path = path[:-1]
        *where, leaf = path
        if leaf not in LEAF_NAMES:
            raise UsageError(f"the checkpoint holds {'/'.join(path)}, which GPT-2 has no place for")
        if where[0] == "h" and not where[1].isdigit():  # stacked blocks: row i is layer i
            for i, row in enumerate(np.asarray(node)):
                state[".".join(["transformer", "h", str(i), *where[1:], LEAF_NAMES[leaf]])] = row
        else:
            state[".".join(["transformer", *where, LEAF_NAMES[leaf]])] = np.asarray(node)

    visit(params, [])
    return state


def from_orbax(out_dir, step=None):
    from model import RUNTIME_FIELDS, GPTConfig  # JAX is loaded by now (read_orbax)

    params, meta = read_orbax(out_dir, step)
    args = meta["model_args"]
    # another architecture's fields (nanochat's n_kv_head) pass at their defaults
    unknown = sorted(
        k
        for k in set(args) - set(ARCH_FIELDS) - set(RUNTIME_FIELDS)
        if args[k] != getattr(GPTConfig, k, not args[k])
    )
    if unknown:
        raise UsageError(f"{out_dir}: model_args {unknown} are unknown to the torch reference")
    if args.get("arch", "gpt2") != "gpt2":
        raise UsageError(
            f"{out_dir}: an arch={args['arch']!r} model, which HF's GPT-2 cannot compute"
        )
    sizes = {k: args[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    return build(
        hf_state_from_ours(params),
        **sizes,
        bias=args.get("bias", True),
        gelu=args.get("gelu", "tanh"),
        where=f"{out_dir} (step {meta.get('iter_num')})",
    )
