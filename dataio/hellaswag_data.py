"""
HellaSwag's data: the official jsonl (downloaded once, atomically, or a local copy), each example
checked line by line, and rendered to tokens as build-nanogpt does (Rendered: the context, then the
4 endings). hellaswag.py scores what it renders; train.py loads it once (load_examples).
"""

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass

from tqdm import tqdm

from configurator import InputNotFound, UsageError
from dataio.tokenizer import get_encoding

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
CACHE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hellaswag"
)


def download(split="val", cache_dir=CACHE_DIR):
    """The official jsonl for `split`, downloaded once to cache_dir (atomically); returns its
    path."""
    path = os.path.join(cache_dir, f"hellaswag_{split}.jsonl")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    url = URL.format(split=split)
    tmp = path + ".part"
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as f:
            total = int(resp.headers.get("content-length") or 0) or None
            with tqdm(
                total=total, unit="B", unit_scale=True, desc=f"downloading {os.path.basename(path)}"
            ) as bar:
                while chunk := resp.read(1 << 20):
                    bar.update(f.write(chunk))
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = getattr(e, "reason", e)
        raise InputNotFound(
            f"could not download {url} ({reason}); "
            "offline? pass a local copy with --path FILE.jsonl"
        ) from e
    os.replace(tmp, path)
    return path


def read_examples(path, limit=None):
    """The examples of a HellaSwag jsonl as dicts, each checked (4 string endings, integer label
    0..3, given as int or str) and given its 1-based '_line'. Errors name the file and line."""
    if not os.path.isfile(path):
        raise InputNotFound(f"no such HellaSwag file: {path}")
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{where}: not valid JSON ({e.msg}: column {e.colno})") from None
            examples.append(check_example(ex, where) | {"_line": lineno})
    if not examples:
        raise UsageError(f"{path}: no examples")
    return examples


def check_example(ex, where="example"):
    """A copy of `ex` with its label as an int; ValueError (naming `where`) for anything not
    HellaSwag."""
    if not isinstance(ex, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(ex).__name__}")
    if not isinstance(ex.get("ctx"), str):
        raise UsageError(f"{where}: 'ctx' must be a string")
    endings = ex.get("endings")
    if not isinstance(endings, list) or not all(isinstance(e, str) for e in endings):
        raise UsageError(f"{where}: 'endings' must be a list of 4 strings")
    if len(endings) != 4:
        raise UsageError(f"{where}: expected 4 endings, got {len(endings)}")
    label = ex.get("label")
    if label is None or label == "":
        raise UsageError(f"{where}: no label (HellaSwag's test split is unlabeled)")
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < 4:
        raise UsageError(f"{where}: label must be 0, 1, 2 or 3 (int or str), got {ex['label']!r}")
    return {**ex, "label": label}


@dataclass
class Rendered:
    """One example as tokens: row i of the eval is ctx + endings[i], and only endings[i] is
    scored."""

    ctx: list  # context tokens (left-truncated when the example is longer than the model's context)
    endings: list  # 4 lists of ending tokens, each encoded with a leading space
    label: int
    line: int = 0  # 1-based line in the jsonl, 0 if not from a file
    ind: int | None = None  # the dataset's own id
    truncated: int = 0  # context tokens dropped from the left to fit max_len


def render_example(ex, max_len=None, where="example"):
    """build-nanogpt's rendering: the context's tokens, then each ending with a space prefixed
    (GPT-2's BPE attaches the space to the following word). With max_len (the model's block_size), a
    row that would be longer loses context tokens from the left; the endings are always scored
    whole."""
    ex = check_example(ex, where)
    enc = get_encoding()
    # no special tokens in HellaSwag; build-nanogpt's encode() gives the same
    ctx = enc.encode_ordinary(ex["ctx"])
    endings = [enc.encode_ordinary(" " + e) for e in ex["endings"]]
    if not ctx:
        raise UsageError(
            f"{where}: empty context: the first ending token would have nothing to be predicted "
            "from"
        )
    longest = max(len(e) for e in endings)
    truncated = 0
    if max_len is not None and len(ctx) + longest > max_len:
        if longest >= max_len:
            raise UsageError(
                f"{where}: an ending of {longest} tokens leaves no room for context in the "
                f"model's {max_len}-token window"
            )
        truncated = len(ctx) + longest - max_len
        ctx = ctx[truncated:]
    return Rendered(ctx, endings, ex["label"], ex.get("_line", 0), ex.get("ind"), truncated)


def load_examples(path, max_len=None, limit=None):
    """read_examples + render_example: what train.py loads once and hands to evaluate() at every
    eval."""
    return [
        render_example(ex, max_len, f"{path}:{ex['_line']}") for ex in read_examples(path, limit)
    ]
