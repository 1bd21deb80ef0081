"""
HellaSwag scoring speed, examples/s: our JAX scorer vs the torch reference (transformers'
GPT2LMHeadModel, build-nanogpt's loop), same weights (gpt2-124M-shaped, random), same examples, same
run, fp32.

    # 32 synthetic examples with HellaSwag-like lengths
    python -m bench.hellaswag
    # the real val set, once downloaded
    python -m bench.hellaswag --path data/hellaswag/hellaswag_val.jsonl --limit 64
    python -m bench.hellaswag --size gpt2-medium --limit 32

JAX is timed twice: the first pass includes compiling each batch shape, the second is the steady
state (what train.py's repeated evals see). Both backends must also agree: identical predictions,
losses within 1e-5. Exit code: 0 done and agreeing, 1 the backends disagree, 2 bad input.
"""

import argparse
import os
import tempfile
import time

import jax
import numpy as np

import hellaswag
from compute import sharding
from configurator import UsageError, exit_on_bad_input
from dataio import hellaswag_data
from parity.check_hellaswag import LOSS_RTOL, agree, compare, evaluate_torch, load_models
from parity.common import HF_SIZES, pin_numerics, print_table, save_random_hf_model, verdict


def synthetic_examples(n, seed=0):
    """Random-token examples whose lengths follow HellaSwag val roughly (ActivityNet: short
    contexts; WikiHow: longer ones and longer endings): context 15-110 tokens, endings 6-45 tokens.
    Content is irrelevant to a random-weight model; the lengths decide the cost."""
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        wikihow = rng.random() < 0.5
        n_ctx = int(rng.integers(50, 111) if wikihow else rng.integers(15, 50))
        n_end = rng.integers(15, 46, 4) if wikihow else rng.integers(6, 25, 4)
        examples.append(
            hellaswag_data.Rendered(
                rng.integers(0, 50257, n_ctx).tolist(),
                [rng.integers(0, 50257, k).tolist() for k in n_end],
                int(rng.integers(4)),
                line=i + 1,
            )
        )
    return examples


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="gpt2", choices=list(HF_SIZES))
    p.add_argument("--path", default=None, help="a HellaSwag jsonl (default: synthetic examples)")
    p.add_argument("--limit", type=int, default=32, help="examples to score")
    p.add_argument("--batch_size", type=int, default=8, help="jax: examples per device per batch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is
    if args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")

    import torch

    pin_numerics()
    with tempfile.TemporaryDirectory() as tmp:  # both frameworks load the same HF directory
        model, hf_model = load_models(
            save_random_hf_model(os.path.join(tmp, args.size), args.seed, **HF_SIZES[args.size])
        )
    if args.path:
        examples = hellaswag_data.load_examples(args.path, model.config.block_size, args.limit)
    else:
        examples = synthetic_examples(args.limit, args.seed)
    n_tok = sum(4 * len(r.ctx) + sum(len(e) for e in r.endings) for r in examples)
    print(
        f"{args.size}-shaped random weights ({model.num_params() / 1e6:.1f}M params); "
        f"{len(examples)} examples, {n_tok / len(examples):.0f} tokens each on average, from "
        f"{args.path or 'synthetic lengths'}; jax on {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), torch on cpu with {torch.get_num_threads()} "
        "threads"
    )

    first, t_first = timed(hellaswag.evaluate, model, examples, batch_size=args.batch_size)
    ours, t_jax = timed(hellaswag.evaluate, model, examples, batch_size=args.batch_size)
    evaluate_torch(hf_model, examples[:2])  # warm-up: first-call allocations
    ref, t_torch = timed(evaluate_torch, hf_model, examples)
    n = len(examples)
    print_table(
        [
            ["jax, first pass (with compilation)", n / t_first, t_first],
            ["jax, steady state", n / t_jax, t_jax],
            ["torch (reference)", n / t_torch, t_torch],
        ],
        ["backend", "examples/s", "seconds"],
    )
    print(f"jax / torch, steady state: {t_torch / t_jax:.2f}x")

    figures = compare(ref, ours)
    rel = max(f["max_rel"] for f in figures.values())
    print(
        f"acc {ours.acc:.4f} / {ref.acc:.4f}, acc_norm {ours.acc_norm:.4f} / {ref.acc_norm:.4f} "
        f"(jax / torch); max relative loss diff {rel:.2g}"
    )
    ok = verdict(
        agree(figures, n) and first.results == ours.results,
        f"agreement (identical predictions, losses within {LOSS_RTOL:g} relative)",
    )
    return 0 if ok else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
