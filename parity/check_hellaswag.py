"""
HellaSwag parity: the same examples scored by transformers' GPT2LMHeadModel (PyTorch,
build-nanogpt's loop over examples: the reference) and by hellaswag.evaluate (our batched JAX
scorer), the same weights, float32.

    # offline
    python -m parity.check_hellaswag --init_from=DIR --path tests/fixtures/hellaswag_small.jsonl
    # val, downloaded once to data/hellaswag/
    python -m parity.check_hellaswag --init_from=gpt2 --limit 500
    # our own checkpoint
    python -m parity.check_hellaswag --init_from=resume --out_dir=out --path FILE.jsonl

The reference shares no code with what it checks: it loads the weights by its own path
(parity/torch_side.py), and reads the jsonl, tokenizes, renders, scores and counts by its own code
below, as build-nanogpt's hellaswag.py. Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad
input.
"""

import base64
import json
import os
import time
from typing import NamedTuple

import jax
import numpy as np

import hellaswag
from compute import sharding
from configurator import UsageError, exit_on_bad_input, require_extras
from parity import torch_side
from parity.common import pin_numerics, print_table, verdict

# each ending's summed and mean loss, relative to the reference's; predictions must be identical
LOSS_RTOL = 1e-5
BPE_FILE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "gpt2.tiktoken"
)
PAD = 0  # build-nanogpt's right padding; the mask keeps it out of every loss


# ------------------------------------------------------------------------------------------------
# the reference: build-nanogpt's hellaswag.py on transformers' GPT-2


def reference_encoding():
    """GPT-2's BPE with tiktoken's own GPT-2 settings (its r50k split pattern and <|endoftext|>) on
    the shipped ranks: tiktoken.get_encoding("gpt2") without the download, and none of
    dataio/tokenizer.py's code."""
    import tiktoken
    from tiktoken_ext import openai_public

    with open(BPE_FILE, "rb") as f:
        ranks = {
            base64.b64decode(token): int(rank)
            for token, rank in (line.split() for line in f if line.strip())
        }
    return tiktoken.Encoding(
        "gpt2",
        pat_str=openai_public.r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )


def iterate_examples(path, limit=None):
    """(1-based line, example dict) of each non-blank line of a HellaSwag jsonl, the first
    `limit`."""
    with open(path, encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    return [(n, json.loads(line)) for n, line in lines[:limit]]


def render_example(example, enc, max_len):
    """build-nanogpt's render_example: (tokens (4, L), mask (4, L), label); each row the context
    then one ending (a space prefixed), right-padded to the longest row; mask 1 on the ending's
    tokens. A row longer than max_len (the model's context) loses context tokens from the left: the
    ending is always scored whole."""
    ctx = enc.encode_ordinary(example["ctx"])
    endings = [enc.encode_ordinary(" " + end) for end in example["endings"]]
    ctx = ctx[max(0, len(ctx) + max(map(len, endings)) - max_len) :]
    L = len(ctx) + max(map(len, endings))
    tokens = np.full((4, L), PAD, np.int64)
    mask = np.zeros((4, L), np.int64)
    for i, end in enumerate(endings):
        tokens[i, : len(ctx) + len(end)] = ctx + end
        mask[i, len(ctx) : len(ctx) + len(end)] = 1
    return tokens, mask, int(example["label"])


# one example's figures, under hellaswag.ExampleResult's names (compare reads both)
class RefResult(NamedTuple):
    line: int
    label: int
    sum_losses: list
    mean_losses: list
    pred: int
    pred_norm: int


class RefScore(NamedTuple):  # under hellaswag.Score's names
    acc: float
    acc_norm: float
    count: int
    results: list


def evaluate_torch(hf_model, path, limit=None, progress=False):
    """Score the jsonl at `path` (its first `limit` examples) with a transformers GPT2LMHeadModel,
    one example (4 rows) at a time, as build-nanogpt's hellaswag.py: summed and mean loss over each
    ending's tokens, the lowest of each the prediction, the hits counted. Returns a RefScore."""
    import torch
    from torch.nn import functional as F
    from tqdm import tqdm

    if hf_model.config.vocab_size < 50257:
        raise UsageError(
            f"the model's vocab_size {hf_model.config.vocab_size} does not cover GPT-2's 50257 "
            "tokens"
        )
    enc = reference_encoding()
    results, num_correct, num_correct_norm = [], 0, 0
    for line, example in tqdm(
        iterate_examples(path, limit), unit="ex", desc="hellaswag (torch)", disable=not progress
    ):
        tokens, mask, label = render_example(example, enc, hf_model.config.n_positions)
        tokens, mask = torch.from_numpy(tokens), torch.from_numpy(mask)  # (4, L) each
        with torch.no_grad():
            logits = hf_model(tokens).logits  # (4, L, vocab)
        # the logits at t predict token t + 1; the shifted mask picks the ending's tokens as targets
        losses = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
        )
        shift_mask = mask[:, 1:]
        sum_loss = (losses.view(4, -1) * shift_mask).sum(dim=1)  # (4,)
        avg_loss = sum_loss / shift_mask.sum(dim=1)
        # ties: the first, as build-nanogpt's
        pred, pred_norm = int(sum_loss.argmin()), int(avg_loss.argmin())
        num_correct += pred == label
        num_correct_norm += pred_norm == label
        results.append(
            RefResult(line, label, sum_loss.tolist(), avg_loss.tolist(), pred, pred_norm)
        )
    if not results:
        raise UsageError("no examples to score")
    return RefScore(
        num_correct / len(results), num_correct_norm / len(results), len(results), results
    )


def compare(ref, ours):
    """Per-ending figures of `ours` (a hellaswag.Score) against `ref`, for the summed losses (acc)
    and the mean losses (acc_norm): {"sum" | "mean": {"max_abs", "max_rel", "same_preds", "acc_ref",
    "acc"}}."""
    if ref.count != ours.count or [r.line for r in ref.results] != [r.line for r in ours.results]:
        raise ValueError("the two scores are not of the same examples")
    figures = {}
    for kind, pred, acc in (("sum", "pred", "acc"), ("mean", "pred_norm", "acc_norm")):
        a = np.array([getattr(r, f"{kind}_losses") for r in ref.results], np.float64)  # (N, 4)
        b = np.array([getattr(r, f"{kind}_losses") for r in ours.results], np.float64)
        diff = np.abs(b - a)
        same = sum(getattr(x, pred) == getattr(y, pred) for x, y in zip(ref.results, ours.results))
        figures[kind] = {
            "max_abs": float(diff.max()),
            "max_rel": float(np.max(diff / np.maximum(np.abs(a), 1e-30))),
            "same_preds": same,
            "acc_ref": getattr(ref, acc),
            "acc": getattr(ours, acc),
        }
    return figures


def agree(figures, count):
    """Parity: every ending's losses within LOSS_RTOL, every prediction the same."""
    return all(f["max_rel"] <= LOSS_RTOL and f["same_preds"] == count for f in figures.values())


def load_models(init_from, out_dir="out"):
    """(our GPT, transformers' GPT2LMHeadModel) of `init_from`, each loaded by its own code: ours by
    hellaswag.load_model (what is checked), the reference by parity/torch_side.py."""
    return hellaswag.load_model(init_from, out_dir), torch_side.load(init_from, out_dir)


def main(argv=None):
    args = hellaswag.cli_parser(__doc__).parse_args(argv)
    require_extras("parity")
    hellaswag.check_bpe(args.init_from, args.out_dir, hellaswag.NOT_BPE)  # before any download
    path, raw = hellaswag.cli_examples(args)
    sharding.use_compilation_cache()
    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is
    pin_numerics()

    model, hf_model = load_models(args.init_from, args.out_dir)
    block_size = model.config.block_size
    examples = hellaswag.render_all(raw, block_size, path)
    print(
        f"model {args.init_from}: {model.num_params() / 1e6:.2f}M params, block_size {block_size}; "
        f"{len(examples)} examples from {path}; torch float32 on cpu, jax float32 on "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    )
    t0 = time.time()
    ref = evaluate_torch(hf_model, path, args.limit, progress=True)
    t1 = time.time()
    ours = hellaswag.evaluate(model, examples, progress=True)
    print(f"scored in {t1 - t0:.1f}s (torch), {time.time() - t1:.1f}s (jax, with compilation)")

    figures = compare(ref, ours)
    n = len(examples)
    print_table(
        [
            [
                f"{name} ({kind} losses)",
                f["max_abs"],
                f["max_rel"],
                f"{'yes' if f['same_preds'] == n else 'NO'} ({f['same_preds']}/{n})",
                f"{f['acc_ref']:.4f}",
                f"{f['acc']:.4f}",
            ]
            for (kind, f), name in zip(figures.items(), ("acc", "acc_norm"))
        ],
        ["", "max abs diff", "max rel diff", "same predictions", "torch", "jax"],
    )
    ok = agree(figures, n)
    return (
        0
        if verdict(
            ok, f"HellaSwag parity (losses within {LOSS_RTOL:g} relative, identical predictions)"
        )
        else 1
    )


if __name__ == "__main__":
    exit_on_bad_input(main)
