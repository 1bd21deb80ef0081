"""GPT-2's BPE as a tiktoken.Encoding, built from the shipped assets/gpt2.tiktoken: no network, ever; and the codecs
that turn a model's token ids into text: BPE, or a character-level run's characters."""

import base64
import codecs
import functools
import os
import pickle
import sys
from pathlib import Path

import tiktoken

from configurator import InputNotFound, UsageError

BPE_FILE = Path(__file__).resolve().parent / "assets" / "gpt2.tiktoken"
EOT = 50256  # <|endoftext|>
GPT2_VOCAB = EOT + 1  # the tokens of GPT-2's BPE: a model scoring its text needs a logit for each

# tiktoken's r50k/gpt2 split pattern: equivalent to GPT-2's original regex, faster.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# GPT-2's original regex (encoder.py), for HF tokenizers: TikTokenConverter's default pattern is cl100k's, which
# splits digits in threes
GPT2_HF_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


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


def save_hf_tokenizer(path):
    """GPT-2's tokenizer files for transformers (tokenizer.json and its config) written to `path`, made from the
    shipped BPE file: offline. Returns the PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast  # slow to import; only the HF routes need it
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(vocab_file=str(BPE_FILE), pattern=GPT2_HF_PATTERN,
                                  extra_special_tokens=["<|endoftext|>"]).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  unk_token="<|endoftext|>")
    tok.save_pretrained(path)
    return tok


class BPECodec:
    """GPT-2's BPE: text <-> token ids."""

    def __init__(self):
        self.enc = get_encoding()
        self.n_vocab = self.enc.n_vocab

    def encode(self, s):
        return self.enc.encode(s, allowed_special={"<|endoftext|>"})

    def decode(self, ids):
        return self.enc.decode(ids)

    def stream_decoder(self):
        """token id -> the text it completes (a character split across tokens waits for its last byte);
        None -> what is left over, so that the streamed text is exactly decode() of the tokens."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as tiktoken's decode: errors="replace"
        return lambda i: utf8.decode(b"" if i is None else self.enc.decode_single_token_bytes(i), final=i is None)


class CharCodec:
    """A character-level vocabulary (nanoGPT's shakespeare_char): `itos`, the character of each id. `source` names
    where it came from, for errors."""

    def __init__(self, itos, source):
        self.itos, self.source = list(itos), source
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.n_vocab = len(self.itos)

    @classmethod
    def from_meta_pkl(cls, path):
        try:
            with open(path, "rb") as f:
                itos = pickle.load(f)["itos"]
            return cls([itos[i] for i in range(len(itos))], path)
        except (pickle.UnpicklingError, EOFError, KeyError, TypeError) as e:
            raise UsageError(f"{path} is not a character-level meta.pkl ({type(e).__name__}: {e})") from None

    def encode(self, s):
        unknown = sorted(set(s) - self.stoi.keys())
        if unknown:
            raise UsageError(f"start has characters outside the vocabulary of {self.source}: "
                             f"{''.join(unknown)!r} (the model only knows {''.join(sorted(self.stoi))!r})")
        return [self.stoi[c] for c in s]

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)

    def stream_decoder(self):
        return lambda i: "" if i is None else self.itos[i]


def codec_for(vocab_size, vocab=None, dataset=None, beside=None):
    """What turns a model's token ids into text. `vocab`: what our checkpoints carry ('gpt2', or the list of a
    character-level run's characters). Without it, as nanoGPT: a meta.pkl beside the weights (`beside`: an exported
    directory) or in the training dataset's folder (data/<dataset>/ or the path), else GPT-2's BPE. A vocabulary
    smaller than GPT-2's is never decoded as BPE: when no meta.pkl is found for it, one line says so."""
    if isinstance(vocab, list):
        return CharCodec(vocab, f"the checkpoint ({len(vocab)} characters)")
    if vocab == "gpt2":
        return BPECodec()
    places = [os.path.join(beside, "meta.pkl")] if beside else []
    if dataset:
        places += [os.path.join("data", dataset, "meta.pkl"), os.path.join(dataset, "meta.pkl")]
    found = next((p for p in places if os.path.exists(p)), None)
    if found:
        print(f"Loading meta from {found}...", file=sys.stderr)
        return CharCodec.from_meta_pkl(found)
    if vocab_size < EOT + 1:
        raise InputNotFound(f"the model's {vocab_size} token ids are not GPT-2's BPE, and no meta.pkl holds their "
                            f"characters ({', '.join(places) or 'no dataset named'}): run from the directory it was "
                            "trained in, or put its dataset's meta.pkl beside the weights")
    return BPECodec()
