"""
The speedrun's data: FineWeb10B's GPT-2 tokens as llm.c `.bin` shards of 100M tokens, from the HF
hub dataset kjj0/fineweb10B-gpt2, as modded-nanogpt's data/cached_fineweb10B.py downloads them
(about an hour saved over tokenizing): fineweb_val_000000.bin and the first N train shards, here in
data/fineweb10B/.

    python data/fineweb10B/prepare.py                  # val + all 103 train shards (about 20 GB)
    # val + 27 train shards: record 5's 5100 steps of 524,288
    python data/fineweb10B/prepare.py --num_chunks=27
                                                       # tokens (190 batches a shard: the tail is
                                                       dropped)
    # offline: link (or copy) the same shards from DIR
    python data/fineweb10B/prepare.py --local DIR

Then `python train.py config/speedrun_gpt2.py` reads them (--dataset=fineweb10B). A rerun skips the
shards that are here and complete (their header and size checked) and fetches the others again.
"""

import argparse
import os
import shutil
import sys

from huggingface_hub import hf_hub_download
from tqdm import tqdm

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(here)))
from configurator import InputNotFound, UsageError, exit_on_bad_input  # noqa: E402
from dataio.dataloader import LLMC_HEADER, llmc_fault  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"  # the record's: a dataset repo on the HF hub
NUM_CHUNKS = 103  # the record's default: the whole of FineWeb10B, 100M tokens a chunk


def shard_names(num_chunks):
    """The record's files: the val shard, then train shards 1..num_chunks."""
    return ["fineweb_val_000000.bin"] + [
        f"fineweb_train_{i:06d}.bin" for i in range(1, num_chunks + 1)
    ]


def fault(path):
    """What is wrong with the shard at path (llm.c's header and the size it declares); None if it is
    complete."""
    with open(path, "rb") as f:
        return llmc_fault(f.read(LLMC_HEADER), os.fstat(f.fileno()).st_size)


def download(name, out_dir):
    try:
        hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=out_dir)
    # offline, the hub unreachable or refusing: huggingface_hub's errors are OSErrors
    except OSError as e:
        raise InputNotFound(
            f"could not download {name} from the HF hub dataset {REPO_ID} ({type(e).__name__}); "
            "offline? link the shards from a local directory with --local DIR"
        ) from e


def link_or_copy(name, local, out_dir):
    """The shard from the directory `local`: a hard link where it can be one, else a copy; either
    lands under a temporary name (no loader's pattern) and is renamed into place, so an interrupted
    copy leaves no shard."""
    src = os.path.join(local, name)
    if not os.path.isfile(src):
        raise InputNotFound(f"--local {local} holds no {name}")
    what = fault(src)
    if what:
        raise UsageError(f"{src} {what}: --local needs complete shards")
    tmp = os.path.join(out_dir, f".{name}.part")
    if os.path.exists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, tmp)
    os.replace(tmp, os.path.join(out_dir, name))


def main(argv=None):
    title, usage = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--num_chunks",
        type=int,
        default=NUM_CHUNKS,
        help=f"train shards of 100M tokens, after the val shard (default {NUM_CHUNKS}: all)",
    )
    p.add_argument(
        "--local",
        metavar="DIR",
        help="link or copy the shards from DIR instead of the hub (offline)",
    )
    p.add_argument("--out_dir", default=here, help="where the shards go (default: this folder)")
    args = p.parse_args(argv)
    if args.num_chunks < 1:
        raise UsageError(f"--num_chunks={args.num_chunks}: give at least 1 train shard")
    if args.local and not os.path.isdir(args.local):
        raise InputNotFound(f"--local {args.local} is not a directory")
    os.makedirs(args.out_dir, exist_ok=True)

    names = shard_names(args.num_chunks)
    fetched = 0
    with tqdm(names, desc="shards", unit="shard") as bar:  # closed before an error's line
        for name in bar:
            path = os.path.join(args.out_dir, name)
            if os.path.exists(path):
                if not fault(path):
                    continue  # here and complete: a rerun skips it
                os.remove(path)  # a broken or partial shard: fetched again
            bar.set_postfix_str(name)
            if args.local:
                link_or_copy(name, args.local, args.out_dir)  # checked before it is linked
            else:
                download(name, args.out_dir)
                what = fault(path)
                if what:
                    raise UsageError(f"{path} {what} as downloaded: rerun to fetch it again")
            fetched += 1
    tokens = sum((os.path.getsize(os.path.join(args.out_dir, n)) - LLMC_HEADER) // 2 for n in names)
    print(
        f"{args.out_dir}: the val shard and {args.num_chunks} train shards ({fetched} fetched "
        f"now), {tokens:,} tokens"
    )
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
