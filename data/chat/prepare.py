"""
Prepare nanochat's chat tasks: the hub datasets its finetuning and chat_eval read, downloaded as
its tasks/common.py's load_hub_dataset downloads them (the hub's parquet export: the listing of a
split's shards, then each shard), into this folder's task_data/ in nanochat's cache layout
(task_data/ORG--NAME/SUBSET/SPLIT/00000.parquet ..., its manifest.json written last: a split is
there whole or not at all), and the identity conversations and spelling words its history mixed in.

    python data/chat/prepare.py                 # SmolTalk, MMLU, GSM8K, ARC, HumanEval (~0.5 GB)
    python data/chat/prepare.py --extras        # and identity_conversations.jsonl, words_alpha.txt
    python data/chat/prepare.py --toy           # offline: tiny template rows (the CPU pipeline's)
    python train.py config/chat_sft.py --init_from=DIR --dataset=data/chat
"""

import argparse
import json
import os
import sys
import urllib.request

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(here)))

from configurator import RunStopped, UsageError, exit_on_bad_input  # noqa: E402
from dataio import parquet_shards, toy_tasks  # noqa: E402
from dataio.chat_tasks import IDENTITY_URL  # noqa: E402
from dataio.spelling_tasks import WORDS_URL  # noqa: E402

HUB_API = "https://huggingface.co/api/datasets"
# (dataset, subset, split): what chat_sft trains and validates on, and what chat_eval scores
SPLITS = [
    ("HuggingFaceTB/smol-smoltalk", "default", "train"),
    ("HuggingFaceTB/smol-smoltalk", "default", "test"),
    ("cais/mmlu", "all", "auxiliary_train"),
    ("cais/mmlu", "all", "test"),
    ("openai/gsm8k", "main", "train"),
    ("openai/gsm8k", "main", "test"),
    ("allenai/ai2_arc", "ARC-Easy", "test"),
    ("allenai/ai2_arc", "ARC-Challenge", "test"),
    ("openai/openai_humaneval", "openai_humaneval", "test"),
]
TOY_ROWS = {"smoltalk": 2000, "mmlu": 600, "gsm8k": 600}  # --toy's train rows


def split_folder(root, dataset, subset, split):
    return os.path.join(root, "task_data", dataset.replace("/", "--"), subset, split)


def shard_urls(api, dataset, subset, split, attempts, backoff_s):
    """The hub's listing of a split's parquet export: its shards' URLs, as nanochat reads it."""
    url = f"{api}/{dataset}/parquet/{subset}/{split}"
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(url, timeout=parquet_shards.TIMEOUT_S) as response:
                urls = json.loads(response.read())
            if not (isinstance(urls, list) and urls and all(isinstance(u, str) for u in urls)):
                raise UsageError(f"{url} lists no parquet shards: {str(urls)[:80]}")
            return urls
        except (OSError, ValueError) as e:
            print(f"{dataset} {subset}/{split}: listing attempt {attempt}/{attempts}: {e}")
            if attempt < attempts:
                parquet_shards.time.sleep(backoff_s * 2**attempt)
    return None


def download_split(root, dataset, subset, split, api, attempts, backoff_s):
    """A split's shards into its folder, its manifest last; True once it is there."""
    folder = split_folder(root, dataset, subset, split)
    manifest = os.path.join(folder, "manifest.json")
    if os.path.exists(manifest):
        print(f"{dataset} {subset}/{split}: here already")
        return True
    urls = shard_urls(api, dataset, subset, split, attempts, backoff_s)
    if urls is None:
        return False
    os.makedirs(folder, exist_ok=True)
    names = [f"{i:05d}.parquet" for i in range(len(urls))]
    for url, name in zip(urls, names):
        if not parquet_shards.download_file(url, os.path.join(folder, name), attempts, backoff_s):
            return False
    with open(manifest + ".tmp", "w") as f:
        json.dump(names, f)
    os.replace(manifest + ".tmp", manifest)
    print(f"{dataset} {subset}/{split}: {len(names)} shard(s)")
    return True


def download_text(url, path, attempts, backoff_s):
    """A text file (the identity conversations, the word list): .tmp, then renamed whole."""
    if os.path.exists(path):
        return True
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(url, timeout=parquet_shards.TIMEOUT_S) as response:
                body = response.read()
            with open(path + ".tmp", "wb") as f:
                f.write(body)
            os.replace(path + ".tmp", path)
            print(f"{os.path.basename(path)}: downloaded")
            return True
        except OSError as e:
            print(f"{os.path.basename(path)}: attempt {attempt}/{attempts} failed: {e}")
            if attempt < attempts:
                parquet_shards.time.sleep(backoff_s * 2**attempt)
    return False


def main(argv=None):
    title, usage = __doc__.strip().split("\n\n", 1)
    p = argparse.ArgumentParser(
        description=title, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dir", default=here, help="where task_data/ goes (default: this folder)")
    p.add_argument("--extras", action="store_true", help="the identity conversations, the words")
    p.add_argument("--toy", action="store_true", help="offline: tiny template rows, no download")
    p.add_argument("--api", default=HUB_API, help="the hub's dataset API (a mirror's)")
    p.add_argument("--identity_url", default=IDENTITY_URL)
    p.add_argument("--words_url", default=WORDS_URL)
    p.add_argument("--attempts", type=int, default=parquet_shards.ATTEMPTS)
    args = p.parse_args(argv)
    if args.attempts < 1:
        raise UsageError(f"--attempts={args.attempts}: give at least 1")
    if args.toy:
        toy_tasks.write_task_cache(args.dir, TOY_ROWS)
        print(f"wrote toy SmolTalk, MMLU and GSM8K rows into {args.dir}/task_data")
        return 0
    backoff = parquet_shards.BACKOFF_S
    failed = [
        f"{d} {s}/{sp}"
        for d, s, sp in SPLITS
        if not download_split(args.dir, d, s, sp, args.api, args.attempts, backoff)
    ]
    if args.extras:
        for url in (args.identity_url, args.words_url):
            path = os.path.join(args.dir, os.path.basename(url))
            if not download_text(url, path, args.attempts, backoff):
                failed.append(os.path.basename(url))
    if failed:
        raise RunStopped(
            f"{len(failed)} failed to download ({', '.join(failed[:3])}{'...' * (len(failed) > 3)})"
            ": rerun to fetch them (what is there is kept)"
        )
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
