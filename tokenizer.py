"""GPT-2's BPE as a tiktoken.Encoding, built from the shipped assets/gpt2.tiktoken: no network, ever."""

import base64
import functools
from pathlib import Path

import tiktoken

BPE_FILE = Path(__file__).resolve().parent / "assets" / "gpt2.tiktoken"
EOT = 50256  # <|endoftext|>

# tiktoken's r50k/gpt2 split pattern: equivalent to GPT-2's original regex, faster.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    ranks = {}
    for line in BPE_FILE.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=EOT + 1,
    )
