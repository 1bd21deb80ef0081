"""
Prepare tiny shakespeare with GPT-2's BPE (dataio/tokenizer.py): train.bin and val.bin, uint16,
90/10 split. Reads the copy bundled in data/shakespeare_char/input.txt (downloads only if neither
copy exists).

    python data/shakespeare/prepare.py   # no arguments; -h prints this
"""

import argparse
import os
import sys

import numpy as np

# as a command, argparse checks the arguments before anything is written: -h prints this docstring,
# anything else is refused (exit 2)
if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(here)))
from dataio.tokenizer import get_encoding  # noqa: E402

input_file_path = os.path.join(here, "input.txt")
if not os.path.exists(input_file_path):
    input_file_path = os.path.join(here, "..", "shakespeare_char", "input.txt")
if not os.path.exists(input_file_path):
    import urllib.request

    input_file_path = os.path.join(here, "input.txt")
    data_url = (
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
    )
    urllib.request.urlretrieve(data_url, input_file_path)

with open(input_file_path, "r", encoding="utf-8") as f:
    data = f.read()
n = len(data)
train_data = data[: int(n * 0.9)]
val_data = data[int(n * 0.9) :]

enc = get_encoding()
train_ids = np.array(enc.encode_ordinary(train_data), dtype=np.uint16)
val_ids = np.array(enc.encode_ordinary(val_data), dtype=np.uint16)
print(f"train has {len(train_ids):,} tokens")  # 301,966
print(f"val has {len(val_ids):,} tokens")  # 36,059
train_ids.tofile(os.path.join(here, "train.bin"))
val_ids.tofile(os.path.join(here, "val.bin"))
