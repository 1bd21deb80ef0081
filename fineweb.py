"""
FineWeb-Edu (sample-10BT) -> GPT-2 tokens -> uint16 .npy shards of 100M tokens, for build-nanogpt's
recipe.

    # HuggingFaceFW/fineweb-edu sample-10BT -> data/edu_fineweb10B/
    python fineweb.py
    # the same, read as a stream: no dataset copy in the HF cache
    python fineweb.py --streaming
    # offline: .jsonl ("text" field), .parquet ("text" column),
    python fineweb.py --local 'corpus/*.jsonl'
                                                    # or .txt (one document per file), in sorted
                                                    file order

Every document becomes <|endoftext|> followed by its tokens (build-nanogpt). Documents run on across
shard boundaries: fill the current shard, spill the remainder into the next. The first shard is val,
the rest train: edufineweb_val_000000.npy, edufineweb_train_000001.npy, ... (zero-padded: each split
sorts in order); the last shard holds what is left.

Each shard is written to a temp file and renamed into place, then progress.json records where it
ends in the input (document index, token offset). A rerun checks the recorded shards, skips the
documents they cover and continues; the bytes written do not depend on --num_proc or on how often
the run was interrupted.
"""

import argparse
import glob
import itertools
import json
import multiprocessing as mp
import os

import numpy as np
from tqdm import tqdm

from configurator import InputNotFound, UsageError, exit_on_bad_input, require_extras
from dataio.tokenizer import EOT, get_encoding

PROGRESS = "progress.json"
# temp files: hidden, no "train"/"val" in the name, so no shard loader picks one up
TMP_PREFIX = ".tmp_"


def shard_name(index):
    split = "val" if index == 0 else "train"
    return f"edufineweb_{split}_{index:06d}.npy"


# ----------------------------------------------------------------------------- text in, in a fixed
# order


def local_files(pattern):
    files = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not files:
        raise InputNotFound(f"--local {pattern!r} matches no files")
    for f in files:
        if not f.endswith((".jsonl", ".parquet", ".txt")):
            raise UsageError(f"--local: {f} is not .jsonl, .parquet or .txt")
    return [os.path.abspath(f) for f in files]


def iter_local(files):
    """Document texts from local files, in sorted file order."""
    for path in files:
        if path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                yield f.read()
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line).get("text")
                    except (json.JSONDecodeError, AttributeError):
                        raise UsageError(f"{path}:{lineno}: not a JSON object") from None
                    if not isinstance(text, str):
                        raise UsageError(f"{path}:{lineno}: no string field 'text'")
                    yield text
        else:
            import pyarrow.parquet as pq  # comes with datasets

            pf = pq.ParquetFile(path)
            if "text" not in pf.schema_arrow.names:
                raise UsageError(
                    f"{path}: no 'text' column (columns: {', '.join(pf.schema_arrow.names)})"
                )
            for batch in pf.iter_batches(columns=["text"], batch_size=1024):
                yield from batch.column(0).to_pylist()


def iter_hf(dataset, name, streaming, skip):
    """Document texts from the HF hub (downloads, or reads the HF cache), from document `skip`
    on."""
    from datasets import load_dataset

    ds = load_dataset(dataset, name=name, split="train", streaming=streaming)
    if skip:
        ds = ds.skip(skip)
    for batch in ds.iter(batch_size=1024):  # batches: per-row dicts are slow over ~10M documents
        yield from batch["text"]


# ----------------------------------------------------------------------------- tokens


def to_uint16(tokens):
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**16):
        raise UsageError(
            f"token id {arr.max() if arr.max() >= 2**16 else arr.min()} does not fit uint16"
        )
    return arr.astype(np.uint16)


def tokenize(text):
    """One document -> uint16 [EOT, *tokens]; EOT delimits documents (build-nanogpt)."""
    return to_uint16([EOT] + get_encoding().encode_ordinary(text))


def tokenize_stream(texts, pool=None, chunksize=16):
    """Token arrays in document order, however many workers: imap (not imap_unordered) keeps the
    order."""
    return (
        pool.imap(tokenize, texts, chunksize=chunksize)
        if pool is not None
        else map(tokenize, texts)
    )


def make_pool(num_proc):
    """None for one process (tokenize in this one); else a pool of spawned workers with the BPE
    loaded. spawn, not fork: safe when the parent holds threads (JAX, tiktoken's pool) and the same
    on every OS."""
    if num_proc <= 1:
        return None
    return mp.get_context("spawn").Pool(num_proc, initializer=get_encoding)


# ----------------------------------------------------------------------------- shards on disk


def atomic_write(path, write):
    """write(f) into a temp file beside path, then rename: a shard or progress file is whole or
    absent."""
    tmp = os.path.join(os.path.dirname(path), TMP_PREFIX + os.path.basename(path))
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_ok(path, n_tokens):
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return False
    return arr.dtype == np.uint16 and arr.shape == (n_tokens,)


def load_progress(out_dir, source, shard_size):
    """The recorded shards that are still on disk and whole (a prefix), and whether the run had
    finished."""
    path = os.path.join(out_dir, PROGRESS)
    if not os.path.exists(path):
        if glob.glob(os.path.join(out_dir, "edufineweb_*.npy")):
            raise UsageError(
                f"{out_dir} has shards but no {PROGRESS}, so they cannot be resumed; "
                "use an empty --out_dir or delete them"
            )
        return [], False
    with open(path) as f:
        state = json.load(f)
    # a first try that wrote no shard (bad input): nothing to resume, any input may start
    if not state["shards"]:
        return [], False
    if state["source"] != source or state["shard_size"] != shard_size:
        raise UsageError(
            f"{out_dir} holds shards of another input or shard size "
            f"({state['source']}, shard_size {state['shard_size']}); "
            "rerun with the same options or use another --out_dir"
        )
    shards = list(
        itertools.takewhile(
            lambda s: shard_ok(os.path.join(out_dir, s["file"]), s["tokens"]), state["shards"]
        )
    )
    return shards, state["done"] and len(shards) == len(state["shards"])


def save_progress(out_dir, source, shard_size, shards, done):
    state = {"source": source, "shard_size": shard_size, "shards": shards, "done": done}
    atomic_write(
        os.path.join(out_dir, PROGRESS), lambda f: f.write(json.dumps(state, indent=1).encode())
    )


# ----------------------------------------------------------------------------- main


def write_shards(texts, out_dir, source, shard_size, shards, pool=None, max_shards=None):
    """Tokenize texts (which start at the document where shards[-1] ends) and write the shards after
    shards. shards: the records of the shards already done, each {"file", "tokens", "end": [doc,
    offset]}, where end is the document index and token offset at which the next shard starts."""
    doc, skip = shards[-1]["end"] if shards else (0, 0)
    index = len(shards)
    buf = np.empty((shard_size,), dtype=np.uint16)
    fill = 0

    def flush(end):
        nonlocal index, fill
        name = shard_name(index)
        atomic_write(os.path.join(out_dir, name), lambda f: np.save(f, buf[:fill]))
        shards.append({"file": name, "tokens": fill, "end": end})
        index, fill = index + 1, 0

    bar = tqdm(
        unit="tok",
        unit_scale=True,
        desc="tokenizing",
        initial=sum(s["tokens"] for s in shards),
        postfix=f"shard {index}",
    )
    try:
        for tokens in tokenize_stream(texts, pool):
            # the document the last shard ended in: its first `skip` tokens are written
            pos, skip = skip, 0
            if pos > len(tokens):
                raise UsageError(
                    f"document {doc} is shorter than {PROGRESS} says: has the input changed?"
                )
            while pos < len(tokens):
                n = min(shard_size - fill, len(tokens) - pos)
                buf[fill : fill + n] = tokens[pos : pos + n]
                fill, pos = fill + n, pos + n
                bar.update(n)
                if fill == shard_size:
                    flush([doc, pos] if pos < len(tokens) else [doc + 1, 0])
                    save_progress(out_dir, source, shard_size, shards, done=False)
                    bar.set_postfix_str(f"shard {index}")
                    if max_shards is not None and index >= max_shards:
                        return False
            doc += 1
    finally:
        bar.close()
    if fill:
        flush([doc, 0])
    if not shards:
        raise UsageError("the input has no documents")
    save_progress(out_dir, source, shard_size, shards, done=True)
    return True


def main(argv=None):
    title, usage = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out_dir", default="data/edu_fineweb10B", help="shards and progress.json go here"
    )
    p.add_argument("--shard_size", type=int, default=10**8, help="tokens per shard (default 100M)")
    p.add_argument(
        "--num_proc",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="tokenizer processes (default: half the CPUs, as build-nanogpt)",
    )
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu", help="HF hub dataset")
    p.add_argument(
        "--name", default="sample-10BT", help="HF dataset config (sample-10BT, sample-100BT, ...)"
    )
    p.add_argument(
        "--streaming", action="store_true", help="stream from the hub instead of downloading first"
    )
    p.add_argument(
        "--local", metavar="GLOB", help="read local files instead of the hub (quote the glob)"
    )
    p.add_argument(
        "--max_shards",
        type=int,
        default=None,
        help="stop once this many shards exist (a rerun without it continues)",
    )
    args = p.parse_args(argv)
    require_extras("data")
    if (
        args.shard_size < 1
        or args.num_proc < 1
        or (args.max_shards is not None and args.max_shards < 1)
    ):
        raise UsageError("--shard_size, --num_proc and --max_shards must be positive")

    if args.local:
        files = local_files(args.local)
        source = {"local": files}
    else:
        source = {
            "dataset": args.dataset,
            "name": args.name,
            "split": "train",
            "streaming": args.streaming,
        }
    os.makedirs(args.out_dir, exist_ok=True)
    for stray in glob.glob(os.path.join(args.out_dir, TMP_PREFIX + "*")):  # an interrupted write
        os.remove(stray)
    shards, done = load_progress(args.out_dir, source, args.shard_size)
    if done:
        print(f"{args.out_dir}: all {len(shards)} shards already written")
        return 0
    if args.max_shards is not None and len(shards) >= args.max_shards:
        print(f"{args.out_dir}: {len(shards)} shards written (--max_shards {args.max_shards})")
        return 0
    # forget shards found missing
    save_progress(args.out_dir, source, args.shard_size, shards, done=False)
    skip = shards[-1]["end"][0] if shards else 0
    if shards:
        print(
            f"resuming after {len(shards)} shards ({sum(s['tokens'] for s in shards):,} tokens), "
            f"at document {skip:,}"
        )
    texts = (
        itertools.islice(iter_local(files), skip, None)
        if args.local
        else iter_hf(args.dataset, args.name, args.streaming, skip)
    )

    pool = make_pool(args.num_proc)
    try:
        finished = write_shards(
            texts, args.out_dir, source, args.shard_size, shards, pool, args.max_shards
        )
    finally:
        if pool is not None:
            pool.terminate()  # also stops workers still tokenizing ahead after --max_shards
            pool.join()
    total = sum(s["tokens"] for s in shards)
    print(
        f"{args.out_dir}: {len(shards)} shards, {total:,} tokens"
        + ("" if finished else " (stopped early)")
    )
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
