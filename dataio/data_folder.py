"""
A dataset's folder: where it is (data/<name> here, a path, the project's data/, or a URL) and what
vocabulary its tokens speak (a char-level meta.pkl's characters, nanochat's tokenizer/, else GPT-2's
BPE), read before anything is written so that a missing folder is one line.
"""

import os

from configurator import InputNotFound
from dataio import storage
from dataio.chat_tokenizer import ChatTokenizer
from dataio.tokenizer import read_vocab, vocab_file

TOKENIZER_FILE = ("tokenizer", "tokenizer.pkl")  # a nanochat data folder's tokenizer


def data_meta(data_dir, tokenizer=""):
    """(vocab_size, vocab) of the data's characters (nanoGPT's char-level datasets write a meta.pkl;
    a meta.json is read first), read by tokenizer.read_vocab, which runs nothing: vocab_size and the
    characters, which each checkpoint saves as what decodes its tokens; nanochat's tokenizer's size
    and 'nanochat' for `tokenizer` (its directory) or a folder with a tokenizer/; (0, 'gpt2') where
    there is none of them: GPT-2's BPE. data_dir may be a URL."""
    path = vocab_file(data_dir)
    if path and not tokenizer:
        return read_vocab(path)
    if tokenizer or storage.exists(storage.join(data_dir, *TOKENIZER_FILE)):
        found = ChatTokenizer.from_directory(tokenizer or storage.join(data_dir, TOKENIZER_FILE[0]))
        return found.n_vocab, "nanochat"
    return 0, "gpt2"


def data_dir_for(dataset):
    """A dataset's folder: a URL as it is (its bucket reachable); else data/<dataset> here, else the
    path `dataset`, else data/<dataset> of the project (a run started from another directory). None
    of them: one line naming where it looked and the datasets the project prepares."""
    # as it is: credentials, the bucket and access checked, each a line naming it
    if storage.is_url(dataset):
        storage.check_reachable(dataset, "dataset")
        return dataset
    # this file is in dataio/, one below the project
    project_data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
    candidates = (os.path.join("data", dataset), dataset, os.path.join(project_data, dataset))
    for candidate in candidates:
        if os.path.isdir(candidate):
            return candidate
    looked = ", ".join(dict.fromkeys(os.path.abspath(c) for c in candidates))
    prepared = sorted(
        n
        for n in os.listdir(project_data)
        if os.path.isfile(os.path.join(project_data, n, "prepare.py"))
    )
    raise InputNotFound(
        f"no dataset {dataset!r}: no such folder ({looked}): give --dataset a folder of train.bin "
        f"and val.bin (or token shards), or one the project prepares ({', '.join(prepared)}: "
        "python data/NAME/prepare.py; edu_fineweb10B: python fineweb.py)"
    )
