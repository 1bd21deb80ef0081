"""
Logit parity: the same GPT-2 weights in transformers' GPT2LMHeadModel (PyTorch) and in our JAX
model.

    # gpt2-shaped random weights, offline
    python -m parity.check_logits --random-init
    # bf16 judged against the fp32 reference
    python -m parity.check_logits --random-init --dtype bfloat16
    # any HF GPT-2 directory (save_pretrained)
    python -m parity.check_logits --model DIR
    # OpenAI's weights (online or HF cache)
    python -m parity.check_logits --model gpt2

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import argparse
import os
import tempfile

import numpy as np

from configurator import UsageError, exit_on_bad_input, require_extras
from parity.common import (
    HF_SIZES,
    max_abs,
    pin_numerics,
    print_table,
    save_random_hf_model,
    verdict,
)

# jax, and our modules on it, are imported in the functions that use them: bad arguments fail before
# jax loads

# Measured on gpt2-shaped random weights, T=1024, B=2, 2-core CPU (docs/parity.md); bars set just
# above.
FP32_MAX_REL_TOL = 3e-6  # max |logit diff| / max |logit|; measured 1.42e-6
FP32_LOSS_TOL = 1e-6  # |loss diff|; measured 4e-8
# bf16: our error against the fp32 reference may be at most this factor times PyTorch autocast's
# (measured: 1.09x max rel, 1.09x mean abs, 1.17x KL)
BF16_FACTOR = 1.5


def make_tokens(text, seq_len, batch, vocab_size, seed):
    """Row 0 starts with the encoded text; everything else is uniform random token ids."""
    from dataio.tokenizer import get_encoding

    tokens = np.random.default_rng(seed).integers(0, min(vocab_size, 50257), (batch, seq_len))
    prompt = get_encoding().encode_ordinary(text)[:seq_len] if text else []
    if prompt and max(prompt) >= vocab_size:
        raise UsageError(f"--text encodes to ids >= the model's vocab_size {vocab_size}")
    tokens[0, : len(prompt)] = prompt
    return tokens.astype(np.int64)


def torch_forward(hf_model, tokens, autocast_bf16=False):
    """(logits, hidden states after each block with ln_f's output last), float32 numpy."""
    import torch

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        out = hf_model(torch.from_numpy(tokens), output_hidden_states=True)
    # HF's hidden_states: embeddings, blocks 0..L-2, then ln_f(block L-1)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states[1:]]


def jax_forward(model, tokens):
    """The same outputs from our model; hidden states in HF's order (the last block's after
    ln_f)."""
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def forward(model, idx):
        states, x = model.hidden_states(idx)
        return model.logits(x), states[:-1] + [x]

    logits, states = forward(model, jnp.asarray(tokens, jnp.int32))
    return np.asarray(logits), [np.asarray(s, np.float32) for s in states]


def log_softmax64(logits):
    z = logits.astype(np.float64)
    z -= z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def metrics(ref, test, tokens):
    """Each figure of the report for `test` logits against `ref` logits (B, T, V)."""
    targets = tokens[:, 1:]
    kl, loss_ref, loss_test = [], [], []
    for r, t, y in zip(ref, test, targets):  # one row at a time: float64 (T, V) is large
        lr, lt = log_softmax64(r), log_softmax64(t)
        kl.append(np.mean(np.sum(np.exp(lr) * (lr - lt), -1)))
        loss_ref.append(-np.take_along_axis(lr[:-1], y[:, None], -1).mean())
        loss_test.append(-np.take_along_axis(lt[:-1], y[:, None], -1).mean())
    return {
        "max_abs": max_abs(ref, test),
        "max_rel": max_abs(ref, test) / float(np.max(np.abs(ref))),
        "mean_abs": float(np.mean(np.abs(ref.astype(np.float64) - test))),
        "top1": float(np.mean(ref.argmax(-1) == test.argmax(-1))),
        "kl": float(np.mean(kl)),
        "loss_diff": abs(float(np.mean(loss_ref)) - float(np.mean(loss_test))),
    }


def check(
    model_path, dtype="float32", text="Hello, I'm a language model,", seq_len=None, batch=2, seed=0
):
    """Run both frameworks on `model_path` (HF name or directory); print the report; return (ok,
    figures)."""
    import jax

    from dataio.weights import load_hf_model
    from model import GPT

    pin_numerics()
    hf_model = load_hf_model(model_path)
    model = GPT.from_pretrained(model_path, dtype=dtype)
    c = model.config
    seq_len = seq_len or c.block_size
    if not 1 < seq_len <= c.block_size:
        raise UsageError(
            f"--seq-len must be in [2, {c.block_size}] (the model's block_size), got {seq_len}"
        )
    if batch < 1:
        raise UsageError(f"--batch must be >= 1, got {batch}")
    tokens = make_tokens(text, seq_len, batch, c.vocab_size, seed)
    print(
        f"model {model_path}: n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} "
        f"vocab={c.vocab_size}, {model.num_params() / 1e6:.2f}M params; batch {batch} x {seq_len} "
        f"tokens; dtype {dtype}; jax on {jax.devices()[0].platform}"
    )

    ref_logits, ref_states = torch_forward(hf_model, tokens)
    logits, states = jax_forward(model, tokens)
    layer_diffs = [max_abs(a, b) for a, b in zip(ref_states, states)]
    worst = int(np.argmax(layer_diffs))
    ours = metrics(ref_logits, logits, tokens)
    header = ["", "max abs", "max rel", "mean abs", "top-1 agree", "KL(ref||x)", "|loss diff|"]
    keys = ["max_abs", "max_rel", "mean_abs", "top1", "kl", "loss_diff"]
    layer_note = f"largest hidden-state diff {layer_diffs[worst]:.3g} at layer {worst}" + (
        " (ln_f output)" if worst == len(layer_diffs) - 1 else ""
    )

    if dtype == "float32":
        print_table([["jax fp32 vs torch fp32"] + [ours[k] for k in keys]], header)
        print(layer_note)
        ok = ours["max_rel"] <= FP32_MAX_REL_TOL and ours["loss_diff"] <= FP32_LOSS_TOL
        return verdict(
            ok, f"fp32 parity (max rel <= {FP32_MAX_REL_TOL:g}, |loss diff| <= {FP32_LOSS_TOL:g})"
        ), ours
    autocast_logits, _ = torch_forward(hf_model, tokens, autocast_bf16=True)
    theirs = metrics(ref_logits, autocast_logits, tokens)
    print_table(
        [
            ["jax bf16 vs torch fp32"] + [ours[k] for k in keys],
            ["torch autocast-bf16 vs torch fp32"] + [theirs[k] for k in keys],
        ],
        header,
    )
    print(layer_note)
    ok = all(ours[k] <= BF16_FACTOR * theirs[k] for k in ("max_rel", "mean_abs", "kl"))
    return verdict(
        ok, f"bf16 parity (our max rel, mean abs and KL <= {BF16_FACTOR}x autocast's)"
    ), {"jax": ours, "torch_autocast": theirs}


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default="gpt2", help="gpt2 | gpt2-medium | gpt2-large | gpt2-xl | HF directory"
    )
    p.add_argument(
        "--random-init",
        action="store_true",
        help="random weights in the named size's architecture (every tensor random); no download",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--text", default="Hello, I'm a language model,", help="prompt at the start of row 0"
    )
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: block_size)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    require_extras("parity")
    from compute import sharding  # here: jax is imported only once the arguments are good

    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is

    if not args.random_init:
        ok, _ = check(args.model, args.dtype, args.text, args.seq_len, args.batch, args.seed)
        return 0 if ok else 1
    if args.model not in HF_SIZES:
        raise UsageError(
            f"--random-init takes a size name ({', '.join(HF_SIZES)}), got {args.model!r}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_hf_model(
            os.path.join(tmp, args.model), seed=args.seed, **HF_SIZES[args.model]
        )
        ok, _ = check(path, args.dtype, args.text, args.seq_len, args.batch, args.seed)
    return 0 if ok else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
