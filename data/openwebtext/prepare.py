"""
OpenWebText, nanoGPT's default dataset (run/settings.py: dataset="openwebtext"), made as nanoGPT's
data/openwebtext/prepare.py makes it: the HF hub's openwebtext split 99.95/0.05 (seed 2357), each
document GPT-2 BPE (dataio/tokenizer.py, offline) with <|endoftext|> appended, each split one uint16
file: train.bin and val.bin, here in data/openwebtext/.

    # the HF hub's openwebtext: 8,013,769 documents, ~54 GB in the HF cache
    python data/openwebtext/prepare.py
    python data/openwebtext/prepare.py --num_proc=16   # tokenizer processes
    # offline, any text: .jsonl ("text" field), .parquet ("text" column) or .txt (one document a
    # file), as fineweb.py reads them; a folder means its .txt files
    python data/openwebtext/prepare.py --local 'owt/*.jsonl'

Then `python train.py` trains nanoGPT's GPT-2 124M on it. nanoGPT's readme: train.bin ~17 GB (about
9B tokens, 9,035,582,198), val.bin ~8.5 MB (about 4M tokens, 4,434,897). Each file is written under
a temporary name and both are renamed once both are complete: a run that fails leaves the files of
the run before, never a part of one. datasets >= 4 runs no loading scripts, which the hub's
openwebtext was (nanoGPT issue #633): that failure is one line, and --dataset names another copy.
"""

import argparse
import math
import os
import sys

import numpy as np
from tqdm import tqdm

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(here)))
from configurator import (  # noqa: E402
    InputNotFound,
    UsageError,
    exit_on_bad_input,
    require_extras,
)
from dataio.tokenizer import EOT, get_encoding  # noqa: E402
from fineweb import TMP_PREFIX, iter_local, local_files  # noqa: E402

TEST_SIZE = 0.0005  # nanoGPT's val share: 4,007 of 8,013,769 documents
SEED = 2357  # nanoGPT's split seed
WRITE_BATCHES = 1024  # nanoGPT's: each split written in this many batches of documents


def load_hub(name, num_proc):
    """The hub dataset's train split (nanoGPT's: openwebtext has only that one)."""
    import datasets

    try:
        return datasets.load_dataset(name, split="train", num_proc=num_proc)
    # offline, the hub unreachable, no such dataset: datasets raises ConnectionError or
    # FileNotFoundError, both OSErrors
    except OSError as e:
        raise InputNotFound(
            f"could not load {name!r} from the HF hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); offline? give --local files"
        ) from e
    except RuntimeError as e:
        if "scripts are no longer supported" not in str(e):
            raise
        raise UsageError(
            f"the HF hub's {name!r} is a loading script, which datasets {datasets.__version__} "
            "no longer runs (nanoGPT issue #633): give --dataset a copy in parquet or json, or "
            "--local files"
        ) from e


def load_local(pattern):
    """Local documents (fineweb.py's reader: .jsonl, .parquet, .txt) in sorted file order, as a
    dataset with the hub's one column, "text"."""
    from datasets import Dataset

    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "*.txt")
    return Dataset.from_dict({"text": list(iter_local(local_files(pattern)))})


def split(dataset):
    """nanoGPT's split. datasets rounds the val share up, so a sample of a few documents still has
    one val document; the train split needs one too."""
    if len(dataset) < 2:
        raise UsageError(f"{len(dataset)} document(s): the split needs 2 or more (1 goes to val)")
    parts = dataset.train_test_split(test_size=TEST_SIZE, seed=SEED, shuffle=True)
    return {"train": parts["train"], "val": parts["test"]}


def tokenize(batch):
    """Each document's GPT-2 BPE and its end: encode_ordinary reads a "<|endoftext|>" in the text
    as text; the real one (50256) is appended, as nanoGPT appends it."""
    enc = get_encoding()
    ids = [enc.encode_ordinary(text) + [EOT] for text in batch["text"]]
    return {"ids": ids, "len": [len(x) for x in ids]}


def write_bin(dset, path, desc):
    """dset's tokens in order into `path`, uint16 through a memory map, a batch of documents at a
    time; returns their count."""
    import pyarrow.compute as pc  # comes with datasets

    n = int(dset.select_columns(["len"]).with_format("numpy")[:]["len"].sum())
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(n,))
    batch_size = math.ceil(len(dset) / WRITE_BATCHES)
    batches = dset.select_columns(["ids"]).with_format("arrow").iter(batch_size=batch_size)
    idx = 0
    for batch in tqdm(batches, total=math.ceil(len(dset) / batch_size), desc=desc):
        ids = pc.list_flatten(batch["ids"]).to_numpy()  # (tokens in the batch,) uint16
        arr[idx : idx + len(ids)] = ids
        idx += len(ids)
    assert idx == n, f"wrote {idx} of {n} tokens"
    arr.flush()  # msync: on disk before the rename
    del arr
    return n


def main(argv=None):
    title, usage = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dataset", default="openwebtext", help="HF hub dataset (nanoGPT's)")
    p.add_argument(
        "--local",
        metavar="GLOB",
        help="read local files instead of the hub: .jsonl, .parquet, .txt, or a folder of .txt "
        "(quote the glob)",
    )
    p.add_argument(
        "--out_dir", default=here, help="where train.bin and val.bin go (default: this folder)"
    )
    p.add_argument(
        "--num_proc",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="tokenizer (and download) processes (default: half the CPUs)",
    )
    args = p.parse_args(argv)
    require_extras("data")
    if args.num_proc < 1:
        raise UsageError(f"--num_proc={args.num_proc}: give at least 1")
    from datasets import Features, List, Value

    dataset = load_local(args.local) if args.local else load_hub(args.dataset, args.num_proc)
    splits = split(dataset)
    # ids as uint16 (GPT-2's largest is 50256): a quarter of the HF cache that int64 would take
    features = Features({"ids": List(Value("uint16")), "len": Value("int64")})
    tokenized = {}
    for name, dset in splits.items():
        procs = min(args.num_proc, len(dset))
        tokenized[name] = dset.map(
            tokenize,
            batched=True,
            remove_columns=["text"],
            features=features,
            num_proc=procs if procs > 1 else None,  # datasets 5 starts a pool even for 1
            desc=f"tokenizing {name}",
        )

    os.makedirs(args.out_dir, exist_ok=True)
    paths = {name: os.path.join(args.out_dir, f"{name}.bin") for name in tokenized}
    # temp names no loader reads (fineweb.py's), ignored by git as *.bin
    tmps = {name: os.path.join(args.out_dir, TMP_PREFIX + f"{name}.bin") for name in tokenized}
    tokens = {}
    try:
        for name, dset in tokenized.items():
            tokens[name] = write_bin(dset, tmps[name], f"writing {paths[name]}")
        # renamed together: no new train.bin beside an old val.bin
        for name in tokenized:
            os.replace(tmps[name], paths[name])
    finally:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.remove(tmp)
    for name in tokenized:
        print(f"{name} has {tokens[name]:,} tokens, documents: {len(tokenized[name]):,}")
    print(f"{args.out_dir}: {', '.join(os.path.basename(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
