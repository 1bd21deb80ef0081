"""A nanochat data folder as data/nanochat/prepare.py leaves one (shards/*.parquet, the last the
val split; tokenizer/), cut from Shakespeare's paragraphs: the nanochat tests' data."""

import os

import pyarrow as pa
import pyarrow.parquet as pq

from dataio.chat_tokenizer import ChatTokenizer

from . import REPO


def shakespeare_folder(folder, vocab, docs=1500, shards=3, row_group_size=64):
    """The first `docs` paragraphs in `shards` equal shards (the last the val split) of row groups
    of row_group_size documents, and a tokenizer of `vocab` ids trained on the train shards, in
    `folder` -> folder."""
    with open(os.path.join(REPO, "data", "shakespeare_char", "input.txt")) as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()][:docs]
    parts = [paragraphs[k * docs // shards : (k + 1) * docs // shards] for k in range(shards)]
    os.makedirs(folder / "shards")
    for k, part in enumerate(parts):
        table = pa.table({"text": part})
        pq.write_table(
            table, folder / "shards" / f"shard_{k:05d}.parquet", row_group_size=row_group_size
        )
    ChatTokenizer.train((d for part in parts[:-1] for d in part), vocab).save(
        folder / "tokenizer", token_bytes_pt=False
    )
    return folder


def tiny_argv(data, out_dir, *extra):
    """config/nanochat_cpu.py at a tiny depth: 2 layers of 2 heads of 16, 32 tokens, 8 rows a
    step in two micro-batches."""
    return [
        os.path.join(REPO, "config", "nanochat_cpu.py"),
        f"--dataset={data}",
        f"--out_dir={out_dir}",
        "--depth=2",
        "--aspect_ratio=16",
        "--head_dim=16",
        "--block_size=32",
        "--window_pattern=SL",
        "--batch_size=4",
        "--total_batch_size=256",
        "--max_iters=6",
        "--warmup_iters=2",
        "--eval_interval=3",
        "--val_tokens=256",
        "--eval_iters=2",
        "--log_interval=1",
        *extra,
    ]
