"""
Prepare the Shakespeare dataset for character-level language modeling: map characters to ints, write
train.bin and val.bin (uint16) and meta.pkl (vocab_size, itos, stoi), as nanoGPT does. input.txt
ships with the repo (tiny shakespeare, from karpathy/char-rnn); it is downloaded only if missing.

    python data/shakespeare_char/prepare.py   # no arguments; -h prints this
"""

import argparse
import os
import pickle

import numpy as np

# as a command, argparse checks the arguments before anything is written: -h prints this docstring,
# anything else is refused (exit 2); the tests also run this file with runpy
if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()

here = os.path.dirname(os.path.abspath(__file__))
input_file_path = os.path.join(here, "input.txt")
if not os.path.exists(input_file_path):
    import urllib.request

    data_url = (
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
    )
    urllib.request.urlretrieve(data_url, input_file_path)

with open(input_file_path, "r", encoding="utf-8") as f:
    data = f.read()
print(f"length of dataset in characters: {len(data):,}")

# get all the unique characters that occur in this text
chars = sorted(list(set(data)))
vocab_size = len(chars)
print("all the unique characters:", "".join(chars))
print(f"vocab size: {vocab_size:,}")

# create a mapping from characters to integers
stoi = {ch: i for i, ch in enumerate(chars)}
itos = {i: ch for i, ch in enumerate(chars)}

# create the train and test splits
n = len(data)
train_data = data[: int(n * 0.9)]
val_data = data[int(n * 0.9) :]

# encode both to integers, export to bin files
train_ids = np.array([stoi[c] for c in train_data], dtype=np.uint16)
val_ids = np.array([stoi[c] for c in val_data], dtype=np.uint16)
print(f"train has {len(train_ids):,} tokens")
print(f"val has {len(val_ids):,} tokens")
train_ids.tofile(os.path.join(here, "train.bin"))
val_ids.tofile(os.path.join(here, "val.bin"))

# save the meta information as well, to help us encode/decode later
with open(os.path.join(here, "meta.pkl"), "wb") as f:
    pickle.dump({"vocab_size": vocab_size, "itos": itos, "stoi": stoi}, f)
