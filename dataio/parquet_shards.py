"""nanochat's pretraining shards (nanochat/dataset.py): parquet files of documents in a `text`
column, shard_00000.parquet onwards, downloaded by index from the HF hub; in a folder sorted by
name, the last is the validation split and the rest train. Read a row group at a time, as nanochat's
dataset.py and dataloader.py read them, with the position (shard, row group) a run resumes after.
The folder may be a URL (gs://...): storage reads it."""

import http.client
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from configurator import InputNotFound, UsageError
from dataio import storage

# nanochat's dataset: ClimbMix-400B, shuffled and cut into 6543 shards of ~100MB
BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
MAX_SHARD = 6542  # the last shard's index: nanochat always takes it, as validation
ATTEMPTS = 5  # nanochat's: a shard is tried five times...
BACKOFF_S = 1.0  # ...waiting 2, 4, 8, 16 s (BACKOFF_S * 2**attempt) between
TIMEOUT_S = 30  # for the connection and each read
CHUNK = 1 << 20  # written a MB at a time
PARQUET_MAGIC = b"PAR1"  # a parquet file begins and ends with it


def shard_name(index):
    return f"shard_{index:05d}.parquet"


def list_shards(folder):
    """The shards of a folder (or URL prefix), sorted: the last is the val split. None there is one
    line naming the command that downloads them."""
    if not storage.isdir(folder):
        raise InputNotFound(
            f"no shards folder {folder}: download some with python data/nanochat/prepare.py"
        )
    paths = [p for p in storage.glob(storage.join(folder, "*.parquet"))]
    if not paths:
        raise InputNotFound(
            f"{folder} holds no *.parquet shards: download some with "
            "python data/nanochat/prepare.py --shards=N"
        )
    return paths


def split_shards(paths, split):
    """The shards of a split: 'val' the last, 'train' the others (at least one)."""
    if split not in ("train", "val"):
        raise UsageError(f"split={split!r}: it is 'train' or 'val'")
    if split == "val":
        return paths[-1:]
    if len(paths) < 2:
        raise InputNotFound(
            f"only one shard ({paths[0]}), and the last is the val split: nothing to train on; "
            "download more with python data/nanochat/prepare.py --shards=N"
        )
    return paths[:-1]


def open_parquet(path):
    """A pyarrow ParquetFile of a path or URL (fsspec's file: row groups read by range)."""
    import pyarrow.parquet as pq  # the nanochat extras

    if not storage.is_url(path):
        return pq.ParquetFile(path)
    fs, p = storage.filesystem(path)
    with storage.errors(path):
        return pq.ParquetFile(fs.open(p, "rb"))


def read_texts(parquet, group, path):
    """The `text` column of a row group as a list of str; a shard pyarrow cannot read, or one
    without that column, is one line."""
    import pyarrow as pa

    try:
        return parquet.read_row_group(group, columns=["text"]).column("text").to_pylist()
    except (pa.ArrowException, KeyError) as e:
        why = (str(e).splitlines() or [""])[0][:200]
        raise UsageError(
            f"{path} row group {group} has no readable text column ({why}): download it again "
            "(delete it, then python data/nanochat/prepare.py)"
        ) from None


def row_groups(folder, split, after=None, rank=0, world_size=1):
    """(texts of a row group, (shard, row group)) over a split's shards in one pass, rank `rank` of
    `world_size` taking every world_size-th row group of each shard (nanochat's start/step).
    `after`: a position yielded before; the pass resumes at this rank's next row group, as
    nanochat's dataloader resumes (its row group is not read again)."""
    import pyarrow as pa

    shards = split_shards(list_shards(folder), split)
    first_shard, resume_group = after if after is not None else (0, None)
    for shard in range(first_shard, len(shards)):
        path = shards[shard]
        try:
            parquet = open_parquet(path)
        except pa.ArrowException as e:  # not parquet: a cut-short or foreign file
            raise UsageError(
                f"{path} is not a parquet shard ({str(e)[:200]}): delete it and download it again "
                "with python data/nanochat/prepare.py"
            ) from None
        group = rank
        if resume_group is not None:  # the resumed shard: the slot after the one it read
            group = (resume_group // world_size + 1) * world_size + rank
            resume_group = None
        while group < parquet.num_row_groups:
            yield read_texts(parquet, group, path), (shard, group)
            group += world_size


def texts(folder, split, **where):
    """The documents of a split, one at a time (tok_train's reading)."""
    for batch, _ in row_groups(folder, split, **where):
        yield from batch


def download_shard(index, folder, base_url=BASE_URL, attempts=ATTEMPTS, backoff_s=BACKOFF_S):
    """Shard `index` into `folder`: True once it is there (kept if it already is), False after
    `attempts` failures (download_file)."""
    name = shard_name(index)
    return download_file(f"{base_url}/{name}", os.path.join(folder, name), attempts, backoff_s)


def download_file(url, path, attempts=ATTEMPTS, backoff_s=BACKOFF_S):
    """A parquet file at `url` into `path`: True once it is there (kept if it already is), False
    after `attempts` failures. Written to <path>.tmp and renamed into place once whole and ending
    as parquet does, so that neither a failure nor a crash leaves a partial file (nanochat's
    listing also skips .tmp)."""
    name = os.path.basename(path)
    if os.path.exists(path):
        print(f"{name}: here already")
        return True
    partial = path + ".tmp"
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
                with open(partial, "wb") as f:
                    while chunk := response.read(CHUNK):  # a short body raises IncompleteRead
                        f.write(chunk)
            with open(partial, "rb") as f:
                f.seek(max(0, os.path.getsize(partial) - 4))
                if f.read() != PARQUET_MAGIC:
                    raise OSError("the body does not end as a parquet file does (cut short?)")
            os.replace(partial, path)
            print(f"{name}: downloaded")
            return True
        # URLError, HTTPError, timeouts; IncompleteRead (a body cut short) is an HTTPException
        except (OSError, http.client.HTTPException) as e:
            print(f"{name}: attempt {attempt}/{attempts} failed: {e}")
            if os.path.exists(partial):
                os.remove(partial)
            if attempt < attempts:
                time.sleep(backoff_s * 2**attempt)
    print(f"{name}: failed {attempts} times")
    return False


def download_shards(indices, folder, workers=4, **how):
    """download_shard of each index on a pool of `workers` threads (the work is waiting on the
    network); the indices that failed."""
    os.makedirs(folder, exist_ok=True)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = list(pool.map(lambda i: download_shard(i, folder, **how), indices))
    return [i for i, ok in zip(indices, done) if not ok]


def shard_indices(n_train):
    """nanochat's choice: the first n_train shards and always the last (validation)."""
    if n_train < 1:
        raise UsageError(f"--shards={n_train}: give at least 1 train shard")
    return [*range(min(n_train, MAX_SHARD)), MAX_SHARD]
