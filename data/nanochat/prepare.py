"""
nanochat's pretraining data and tokenizer: the first N parquet shards of ClimbMix-400B (and the
last, always, as validation) from the HF hub, as nanochat's `python -m nanochat.dataset -n N`
downloads them, into data/nanochat/shards/; then its BPE tokenizer trained on the train shards'
text as `python -m scripts.tok_train` trains it (vocabulary 32768, documents cut to 10,000
characters, 2B characters), into data/nanochat/tokenizer/ (tokenizer.pkl, token_bytes.pt).

    python data/nanochat/prepare.py                    # 8 train shards (~2B characters) + val
    python data/nanochat/prepare.py --shards=170       # nanochat's speedrun: enough for its d20
    python data/nanochat/prepare.py --tokenizer_only   # train on the shards already here
    python data/nanochat/prepare.py --shards=2 --vocab_size=4096 --max_chars=50000000
    # offline: Shakespeare's paragraphs as shards (config/nanochat_cpu.py's quick run)
    python data/nanochat/prepare.py --text=data/shakespeare_char/input.txt --shards=4 \
        --vocab_size=4096

A rerun keeps the shards that are here (a shard lands whole, renamed from .tmp, or not at all).
"""

import argparse
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(here)))
from configurator import RunStopped, UsageError, exit_on_bad_input  # noqa: E402
from dataio import chat_tokenizer, parquet_shards  # noqa: E402

SHARDS = 8  # nanochat's speedrun downloads these first, for the tokenizer
# tok_train's own check: what it encodes and decodes before it saves
SAMPLE = """Hello world! This is a test.
Numbers: 123, 4567, 89
Contractions: I'm, you're, it's
Special chars: @#$%^&*()
Unicode: 你好世界 🌍"""


class Progress:
    """Texts passed on, with a line every `every` characters, counted in .docs and .chars."""

    def __init__(self, texts, every=100_000_000):
        self.texts, self.every, self.docs, self.chars = texts, every, 0, 0

    def __iter__(self):
        mark = self.every
        for text in self.texts:
            self.docs += 1
            self.chars += len(text)
            if self.chars >= mark:
                print(f"  {self.chars:,} characters, {self.docs:,} documents", flush=True)
                mark += self.every
            yield text


def train_tokenizer(shards_dir, tokenizer_dir, vocab_size, max_chars, doc_cap):
    chat_tokenizer.check_vocab_size(vocab_size)  # before the shards are read
    train = parquet_shards.split_shards(parquet_shards.list_shards(shards_dir), "train")
    print(f"training a {vocab_size:,}-id tokenizer on {len(train)} train shards of {shards_dir}")
    print(f"  max_chars {max_chars:,}, each document cut to {doc_cap:,} characters")
    texts = chat_tokenizer.capped_texts(
        parquet_shards.texts(shards_dir, "train"), doc_cap, max_chars
    )
    start, read = time.time(), Progress(texts)
    bpe = chat_tokenizer.train_bpe(iter(read), vocab_size)
    tokenizer = chat_tokenizer.ChatTokenizer(chat_tokenizer.encoding_of(bpe))
    print(
        f"trained in {time.time() - start:.1f}s on {read.chars:,} characters of {read.docs:,} "
        f"documents: {tokenizer.n_vocab:,} ids"
    )
    if tokenizer.decode(tokenizer.encode(SAMPLE)) != SAMPLE:
        raise RuntimeError(
            "the trained tokenizer does not decode its encoding of tok_train's sample"
        )
    try:
        import torch  # noqa: F401 - nanochat's token_bytes.pt is torch's file
    except ImportError:
        has_torch = False
        print(
            "token_bytes.pt not written: torch is not installed (nanochat's scripts read it; ours"
        )
        print("  count each token's bytes from tokenizer.pkl)")
    else:
        has_torch = True
    tokenizer.save(tokenizer_dir, token_bytes_pt=has_torch)
    print(f"saved {tokenizer_dir}: tokenizer.pkl" + ", token_bytes.pt" * has_torch)


def shards_from_text(path, folder, n_train):
    """`path`'s paragraphs as documents: the first nine tenths in n_train shards, the rest the val
    shard (the last), row groups of 256 documents, as the downloaded ones are laid out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if n_train < 1:
        raise UsageError(f"--shards={n_train}: give at least 1")
    try:
        with open(path, encoding="utf-8") as f:
            docs = [d.strip() for d in f.read().split("\n\n") if d.strip()]
    except OSError as e:
        raise UsageError(f"cannot read --text={path}: {e.strerror or e}") from None
    if len(docs) < 2 * (n_train + 1):
        raise UsageError(f"{path} has {len(docs)} paragraphs: too few for {n_train} + 1 shards")
    cut = len(docs) * 9 // 10
    parts = [docs[i * cut // n_train : (i + 1) * cut // n_train] for i in range(n_train)]
    os.makedirs(folder, exist_ok=True)
    for index, part in enumerate([*parts, docs[cut:]]):
        name = os.path.join(folder, parquet_shards.shard_name(index))
        pq.write_table(pa.table({"text": part}), name + ".tmp", row_group_size=256)
        os.replace(name + ".tmp", name)  # whole or not at all, as a download
    print(f"wrote {n_train} + 1 shards of {len(docs):,} paragraphs of {path} into {folder}")


def main(argv=None):
    title, usage = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shards", type=int, default=SHARDS, help=f"train shards (default {SHARDS})")
    p.add_argument("--dir", default=os.path.join(here, "shards"), help="where the shards go")
    p.add_argument(
        "--tokenizer_dir", default=os.path.join(here, "tokenizer"), help="where it is saved"
    )
    p.add_argument("--workers", type=int, default=4, help="parallel downloads (nanochat's 4)")
    p.add_argument("--vocab_size", type=int, default=chat_tokenizer.VOCAB_SIZE)
    p.add_argument("--max_chars", type=int, default=chat_tokenizer.MAX_CHARS)
    p.add_argument("--doc_cap", type=int, default=chat_tokenizer.DOC_CAP)
    p.add_argument(
        "--tokenizer_only", action="store_true", help="download nothing: train on --dir's shards"
    )
    p.add_argument("--base_url", default=parquet_shards.BASE_URL, help="a mirror of the shards")
    p.add_argument(
        "--text",
        default="",
        help="offline: shards cut from this text file's paragraphs (blank-line separated), the "
        "last tenth the val shard, instead of the download",
    )
    args = p.parse_args(argv)
    for flag in ("workers", "max_chars", "doc_cap"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag}={getattr(args, flag)}: give at least 1")
    if args.text:
        shards_from_text(args.text, args.dir, args.shards)
    elif not args.tokenizer_only:
        indices = parquet_shards.shard_indices(args.shards)
        print(f"downloading {len(indices)} shards into {args.dir} on {args.workers} workers")
        failed = parquet_shards.download_shards(
            indices, args.dir, workers=args.workers, base_url=args.base_url
        )
        if failed:
            raise RunStopped(
                f"{len(failed)} of {len(indices)} shards failed to download "
                f"({', '.join(map(parquet_shards.shard_name, failed[:4]))}"
                f"{'...' * (len(failed) > 4)}): rerun to fetch them (the others are kept)"
            )
    train_tokenizer(args.dir, args.tokenizer_dir, args.vocab_size, args.max_chars, args.doc_cap)
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
