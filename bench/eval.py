"""
lm-eval loglikelihood speed, requests/s: our model (eval_lm.JaxLM) vs lm-eval's own hf model
(transformers' GPT2LMHeadModel), same random weights, same requests, same batch size, same run,
fp32, pairs alternated.

    # 500 requests of mixed lengths, a small GPT-2, 3 pairs
    python -m bench.eval
    python -m bench.eval --size gpt2 --requests 200 --pairs 1

The requests are a multiple-choice task's: 125 Shakespeare contexts of 8 to 700 tokens, 4
continuations each of 1 to 24 tokens. Ours is timed twice a pair: compiling (jax's caches cleared
first) and compiled (the same requests again). Also said: the number of compilations. Both must
agree: loglikelihoods within check_eval's 1e-4. Exit code: 0 done and agreeing, 1 they disagree, 2
bad input.
"""

import argparse
import os
import tempfile
import time

import numpy as np

from configurator import UsageError, exit_on_bad_input
from parity.common import HF_SIZES, pin_numerics, print_table, save_random_hf_model, verdict

SIZES = {"small": dict(n_layer=4, n_head=4, n_embd=256), **HF_SIZES}


def requests(n_docs, seed=0):
    """lm-eval Instances of a multiple-choice task over Shakespeare: contexts of 8..700 tokens
    (uniform in log), 4 continuations of 1..24 tokens each."""
    from lm_eval.api.instance import Instance

    from dataio.tokenizer import get_encoding

    enc = get_encoding()
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "data",
        "shakespeare_char",
        "input.txt",
    )
    with open(path) as f:
        tokens = enc.encode_ordinary(f.read())
    rng = np.random.default_rng(seed)
    out = []
    for doc in range(n_docs):
        n = int(np.exp(rng.uniform(np.log(8), np.log(700))))
        start = int(rng.integers(0, len(tokens) - n - 100))
        context = enc.decode(tokens[start : start + n])
        for choice in range(4):
            s = int(rng.integers(0, len(tokens) - 30))
            continuation = enc.decode(tokens[s : s + int(rng.integers(1, 25))])
            out.append(
                Instance(
                    "loglikelihood",
                    {},
                    (context, continuation),
                    idx=choice,
                    metadata=("bench", doc, 1),
                )
            )
    return out


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size", default="small", choices=list(SIZES))
    p.add_argument(
        "--requests", type=int, default=500, help="loglikelihood requests (4 per document)"
    )
    p.add_argument("--batch_size", type=int, default=8, help="requests per batch, both models")
    p.add_argument("--pairs", type=int, default=3, help="ours-then-hf rounds")
    args = p.parse_args(argv)
    if args.requests < 4 or args.batch_size < 1 or args.pairs < 1:
        raise UsageError("--requests must be >= 4, --batch_size and --pairs >= 1")

    import jax

    from archs.models import load_pretrained
    from compute import sharding
    from parity.check_eval import LOGLIKELIHOOD_TOL, hf_lm
    from run.eval_lm import JaxLM

    sharding.start_backend()  # libtpu's banner kept off the terminal where no TPU is
    pin_numerics()
    reqs = requests(args.requests // 4)
    lengths = [len(c) + len(x) for c, x in (r.args for r in reqs)]
    print(
        f"{len(reqs)} requests, {min(lengths)} to {max(lengths)} characters; {args.size} random "
        f"weights, fp32, batch {args.batch_size}, {jax.devices()[0].platform}"
    )
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_hf_model(os.path.join(tmp, "model"), **SIZES[args.size])
        model, _ = load_pretrained(path)
        hf = hf_lm(path, args.batch_size, "float32", tmp)
        for pair in range(args.pairs):
            jax.clear_caches()
            lm = JaxLM(model, sharding.make_mesh(), args.batch_size, progress=False)
            mine, cold = timed(lm.loglikelihood, reqs, True)
            _, warm = timed(lm.loglikelihood, reqs, True)
            ref, t_hf = timed(hf.loglikelihood, reqs, True)
            diff = max(abs(a[0] - b[0]) for a, b in zip(mine, ref))
            flips = sum(a[1] != b[1] for a, b in zip(mine, ref))
            ok &= diff <= LOGLIKELIHOOD_TOL and flips == 0
            rows.append(
                [
                    str(pair + 1),
                    f"{len(reqs) / cold:.1f}",
                    f"{len(reqs) / warm:.1f}",
                    f"{len(reqs) / t_hf:.1f}",
                    str(len(lm.shapes)),
                    f"{diff:.1e}",
                ]
            )
    print_table(
        rows,
        [
            "pair",
            "ours req/s (compiling)",
            "ours req/s (compiled)",
            "hf req/s",
            "compilations",
            "max |diff|",
        ],
    )
    return 0 if verdict(ok, f"loglikelihoods within {LOGLIKELIHOOD_TOL}, same is_greedy") else 1


if __name__ == "__main__":
    exit_on_bad_input(main)
