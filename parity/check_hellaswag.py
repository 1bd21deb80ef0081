"""
HellaSwag parity: the same examples scored by transformers' GPT2LMHeadModel (PyTorch, build-nanogpt's loop over
examples: the reference) and by hellaswag.evaluate (our batched JAX scorer), the same weights, float32.

    python -m parity.check_hellaswag --init_from=DIR --path tests/fixtures/hellaswag_small.jsonl   # offline
    python -m parity.check_hellaswag --init_from=gpt2 --limit 500     # val, downloaded once to data/hellaswag/
    python -m parity.check_hellaswag --init_from=resume --out_dir=out --path FILE.jsonl   # our own checkpoint

Exit code: 0 parity holds, 1 a tolerance is exceeded, 2 bad input.
"""

import tempfile
import time

import jax
import numpy as np

import hellaswag
import sharding
from configurator import UsageError, exit_on_bad_input, require_extras
from parity.common import pin_numerics, print_table, verdict
from pretrained import nanogpt_checkpoint
from weights import load_hf_model

LOSS_RTOL = 1e-5  # each ending's summed and mean loss, relative to the reference's; predictions must be identical


def render_rows(r: hellaswag.Rendered):
    """build-nanogpt's (4, L) tokens and mask for one example: each row right-padded with hellaswag.PAD to the
    longest of the 4; mask 1 on the ending's tokens."""
    rows = [r.ctx + e for e in r.endings]
    L = max(len(row) for row in rows)
    tokens = np.full((4, L), hellaswag.PAD, np.int64)
    mask = np.zeros((4, L), np.int64)
    for i, (row, e) in enumerate(zip(rows, r.endings)):
        tokens[i, : len(row)] = row
        mask[i, len(r.ctx): len(row)] = 1
    return tokens, mask


def evaluate_torch(hf_model, examples, progress=False):
    """Score rendered examples with a transformers GPT2LMHeadModel, one example (4 rows) at a time, the
    losses computed as build-nanogpt computes them. Returns hellaswag.Score, as hellaswag.evaluate."""
    import torch
    from torch.nn import functional as F
    from tqdm import tqdm

    if not examples:
        raise UsageError("no examples to score")
    hellaswag.check_vocab(hf_model.config.vocab_size)
    results = []
    for r in tqdm(examples, unit="ex", desc="hellaswag (torch)", disable=not progress):
        tokens, mask = (torch.from_numpy(a) for a in render_rows(r))  # (4, L) each
        with torch.no_grad():
            logits = hf_model(tokens).logits  # (4, L, vocab)
        # the logits at t predict token t + 1; the shifted mask picks the ending's tokens as targets
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        shift_mask = mask[:, 1:]
        sum_loss = (losses.view(4, -1) * shift_mask).sum(dim=1)  # (4,)
        mean_loss = sum_loss / shift_mask.sum(dim=1)
        results.append(hellaswag.make_result(r, sum_loss.tolist(), mean_loss.tolist()))
    return hellaswag.summarize(results)


def compare(ref, ours):
    """Per-ending figures of `ours` (a hellaswag.Score) against `ref`, for the summed losses (acc) and the mean
    losses (acc_norm): {"sum" | "mean": {"max_abs", "max_rel", "same_preds", "acc_ref", "acc"}}."""
    if ref.count != ours.count or [r.line for r in ref.results] != [r.line for r in ours.results]:
        raise ValueError("the two scores are not of the same examples")
    figures = {}
    for kind, pred, acc in (("sum", "pred", "acc"), ("mean", "pred_norm", "acc_norm")):
        a = np.array([getattr(r, f"{kind}_losses") for r in ref.results], np.float64)  # (N, 4)
        b = np.array([getattr(r, f"{kind}_losses") for r in ours.results], np.float64)
        diff = np.abs(b - a)
        same = sum(getattr(x, pred) == getattr(y, pred) for x, y in zip(ref.results, ours.results))
        figures[kind] = {"max_abs": float(diff.max()), "max_rel": float(np.max(diff / np.maximum(np.abs(a), 1e-30))),
                         "same_preds": same, "acc_ref": getattr(ref, acc), "acc": getattr(ours, acc)}
    return figures


def agree(figures, count):
    """Parity: every ending's losses within LOSS_RTOL, every prediction the same."""
    return all(f["max_rel"] <= LOSS_RTOL and f["same_preds"] == count for f in figures.values())


def load_models(init_from, out_dir="out"):
    """(our GPT, transformers' GPT2LMHeadModel) with the same float32 weights. A hub name or an HF directory loads
    in each framework; our checkpoint (resume) or a nanoGPT ckpt.pt reaches torch through an HF export of ours to
    a temporary directory."""
    model = hellaswag.load_model(init_from, out_dir)
    if init_from != "resume" and not nanogpt_checkpoint(init_from):
        return model, load_hf_model(init_from)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return model, load_hf_model(tmp)


def main(argv=None):
    args = hellaswag.cli_parser(__doc__).parse_args(argv)
    require_extras("parity")
    path, raw = hellaswag.cli_examples(args)
    sharding.use_compilation_cache()
    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is
    pin_numerics()

    model, hf_model = load_models(args.init_from, args.out_dir)
    block_size = model.config.block_size
    examples = hellaswag.render_all(raw, block_size, path)
    print(f"model {args.init_from}: {model.num_params() / 1e6:.2f}M params, block_size {block_size}; "
          f"{len(examples)} examples from {path}; torch float32 on cpu, jax float32 on {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s)")
    t0 = time.time()
    ref = evaluate_torch(hf_model, examples, progress=True)
    t1 = time.time()
    ours = hellaswag.evaluate(model, examples, progress=True)
    print(f"scored in {t1 - t0:.1f}s (torch), {time.time() - t1:.1f}s (jax, with compilation)")

    figures = compare(ref, ours)
    n = len(examples)
    print_table([[f"{name} ({kind} losses)", f["max_abs"], f["max_rel"],
                  f"{'yes' if f['same_preds'] == n else 'NO'} ({f['same_preds']}/{n})",
                  f"{f['acc_ref']:.4f}", f"{f['acc']:.4f}"]
                 for (kind, f), name in zip(figures.items(), ("acc", "acc_norm"))],
                ["", "max abs diff", "max rel diff", "same predictions", "torch", "jax"])
    ok = agree(figures, n)
    return 0 if verdict(ok, f"HellaSwag parity (losses within {LOSS_RTOL:g} relative, identical predictions)") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
