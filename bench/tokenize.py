"""
Tokenization throughput: fineweb.py's pipeline with 1, 2, ... processes against one process calling
tiktoken's encode_ordinary_batch (its own thread pool), on the same documents, in the same run.

    # data/shakespeare_char/input.txt, repeated to 4 MB
    python -m bench.tokenize
    python -m bench.tokenize --mb 16 --procs 1 2 4 8

Documents: the text's paragraphs (split at blank lines) grouped into documents of at least
--doc_chars characters (3000: about 1000 GPT-2 tokens here, FineWeb-Edu's mean). The cases run
round-robin; each figure is the best of --repeats. "tokenize_stream" rows time fineweb's tokenizer
alone (pool started and warm beforehand); "fineweb.py" rows time the whole script on a jsonl of the
documents: pool start, reading, shard writing.
"""

import argparse
import contextlib
import functools
import io
import itertools
import json
import os
import tempfile
import time

import tiktoken

import fineweb
from configurator import UsageError, exit_on_bad_input
from dataio.tokenizer import get_encoding
from parity.common import print_table


def make_docs(path, mb, doc_chars):
    with open(path, encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    if not paragraphs:
        raise UsageError(f"{path} has no text")
    docs, cur, size, i = [], [], 0, 0
    while size < mb * 2**20:
        cur.append(paragraphs[i % len(paragraphs)])
        i += 1
        if sum(map(len, cur)) >= doc_chars:
            docs.append("\n\n".join(cur))
            size += len(docs[-1])
            cur = []
    return docs


def main(argv=None):
    title, usage = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", default="data/shakespeare_char/input.txt")
    p.add_argument("--mb", type=float, default=4.0, help="megabytes of text (the input repeated)")
    p.add_argument("--doc_chars", type=int, default=3000, help="minimum characters per document")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="fineweb --num_proc values")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.mb <= 0 or args.doc_chars < 1 or args.repeats < 1 or min(args.procs) < 1:
        raise UsageError("--mb, --doc_chars, --repeats and --procs must be positive")

    docs = make_docs(args.input, args.mb, args.doc_chars)
    enc = get_encoding()
    # +1: fineweb's EOT per document
    n_tokens = sum(len(t) + 1 for t in enc.encode_ordinary_batch(docs))
    print(
        f"{len(docs):,} documents, {sum(map(len, docs)) / 2**20:.1f} MB, {n_tokens:,} tokens "
        f"({n_tokens / len(docs):.0f} per document); {os.cpu_count()} CPUs; tiktoken "
        f"{tiktoken.__version__}; best of {args.repeats}"
    )

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        jsonl = os.path.join(tmp, "docs.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        runs = itertools.count()

        def script(n):
            out = os.path.join(tmp, f"out_{next(runs)}")
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                fineweb.main(
                    [
                        "--local",
                        jsonl,
                        "--out_dir",
                        out,
                        "--num_proc",
                        str(n),
                        "--shard_size",
                        str(10**6),
                    ]
                )
            with open(os.path.join(out, fineweb.PROGRESS)) as f:
                return sum(s["tokens"] for s in json.load(f)["shards"])

        def stream(pool):
            return lambda: sum(map(len, fineweb.tokenize_stream(docs, pool)))

        cases = [
            (
                "tiktoken encode_ordinary_batch (baseline)",
                "1 (8 threads)",
                lambda: sum(len(t) + 1 for t in enc.encode_ordinary_batch(docs)),
            )
        ]
        for n in args.procs:
            pool = fineweb.make_pool(n)
            if pool is not None:
                stack.callback(pool.join)
                stack.callback(pool.terminate)
                # workers started, BPE loaded: not timed
                pool.map(fineweb.tokenize, ["warm up"] * n)
            cases.append(("fineweb tokenize_stream", str(n), stream(pool)))
        cases += [
            ("fineweb.py end to end (jsonl -> shards)", str(n), functools.partial(script, n))
            for n in args.procs
        ]

        # round-robin, best of repeats: a burst of load from other processes hits every case alike
        best = [float("inf")] * len(cases)
        for _ in range(args.repeats):
            for i, (method, procs, fn) in enumerate(cases):
                t0 = time.perf_counter()
                tokens = fn()
                best[i] = min(best[i], time.perf_counter() - t0)
                if tokens != n_tokens:
                    raise RuntimeError(
                        f"{method} with {procs} processes made {tokens:,} tokens, not {n_tokens:,}"
                    )

    rows = [
        [method, procs, f"{t:.2f}", f"{n_tokens / t / 1e6:.2f}", f"{best[0] / t:.2f}x"]
        for (method, procs, _), t in zip(cases, best)
    ]
    print_table(rows, ["method", "processes", "seconds", "Mtok/s", "vs baseline"])
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
