"""GPT-2's BPE as a tiktoken.Encoding, built from the shipped assets/gpt2.tiktoken: no network,
ever; the codecs that turn a model's token ids into text: BPE, or a character-level run's
characters; and the one reader of those characters (nanoGPT's meta.pkl, our meta.json), which runs
nothing that a file names."""

import base64
import codecs
import functools
import io
import json
import os
import pickle
import sys
from pathlib import Path

import tiktoken

from configurator import InputNotFound, UsageError
from dataio import storage
from dataio.chat_tokenizer import ChatTokenizer
from dataio.unpickling import NoGlobals, RefusedGlobal, short

BPE_FILE = Path(__file__).resolve().parent.parent / "assets" / "gpt2.tiktoken"
EOT = 50256  # <|endoftext|>
GPT2_VOCAB = EOT + 1  # the tokens of GPT-2's BPE: a model scoring its text needs a logit for each

# tiktoken's r50k/gpt2 split pattern: equivalent to GPT-2's original regex, faster.
GPT2_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
# GPT-2's original regex (encoder.py), for HF tokenizers: TikTokenConverter's default pattern is
# cl100k's, which splits digits in threes
GPT2_HF_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# A directory's characters: our JSON twin first (reading it needs no pickle), else nanoGPT's
# meta.pkl
VOCAB_FILES = ("meta.json", "meta.pkl")
WRITTEN_BY = {
    "meta.json": 'export.py writes {"vocab_size": n, "itos": [n characters]}',
    "meta.pkl": "nanoGPT's prepare.py writes a dict of vocab_size, itos (id -> character) and stoi",
}


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
    """GPT-2's tokenizer files for transformers (tokenizer.json and its config) written to `path`,
    made from the shipped BPE file: offline. Returns the PreTrainedTokenizerFast."""
    from transformers import PreTrainedTokenizerFast  # slow to import; only the HF routes need it
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(
        vocab_file=str(BPE_FILE), pattern=GPT2_HF_PATTERN, extra_special_tokens=["<|endoftext|>"]
    ).converted()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=converted,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
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
        """token id -> the text it completes (a character split across tokens waits for its last
        byte); None -> what is left over, so that the streamed text is exactly decode() of the
        tokens."""
        # as tiktoken's decode: errors="replace"
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda i: utf8.decode(
            b"" if i is None else self.enc.decode_single_token_bytes(i), final=i is None
        )


def vocab_file(directory):
    """The file of `directory` (a folder or a URL) that holds a vocabulary of characters
    (VOCAB_FILES), or None."""
    return next(
        (p for p in (storage.join(directory, f) for f in VOCAB_FILES) if storage.exists(p)), None
    )


def read_vocab(path):
    """(vocab_size, characters) of a character-level vocabulary: our meta.json or nanoGPT's meta.pkl
    (as its data/shakespeare_char/prepare.py writes it), read without running anything it names and
    checked, so that anything else is one line (UsageError) naming the file, before a model is built
    or a file written. `path` may be a URL."""
    is_json = path.endswith(".json")

    def bad(why):
        return UsageError(
            f"{path} is not a plain character vocabulary: {why}; "
            f"{WRITTEN_BY['meta.json' if is_json else 'meta.pkl']}"
        )

    try:
        data = storage.read_bytes(path)  # a local file or a URL's
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        meta = json.loads(data) if is_json else NoGlobals(io.BytesIO(data)).load()
    except RefusedGlobal as e:
        raise bad(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: what it raises varies with its bytes
        why = (str(e).splitlines() or [""])[0][:200]
        raise bad(
            f"it does not read as {'JSON' if is_json else 'a pickle'} ({type(e).__name__}: {why})"
        ) from None
    if not isinstance(meta, dict):
        raise bad(f"it holds a {type(meta).__name__}, not a dict")
    n, itos = meta.get("vocab_size"), meta.get("itos")
    if type(n) is not int or n < 1:
        raise bad(
            "it has no vocab_size" if n is None else f"vocab_size is {short(n)}, not a positive int"
        )
    # JSON keys are strings
    want = (list, "a list of characters") if is_json else (dict, "a dict id -> character")
    if not isinstance(itos, want[0]):
        raise bad(
            "it has no itos" if itos is None else f"itos is a {type(itos).__name__}, not {want[1]}"
        )
    if len(itos) != n:  # before the ids are counted: vocab_size may be any number
        raise bad(f"itos holds {len(itos)} characters, vocab_size says {n}")
    if not is_json and (any(type(i) is not int for i in itos) or set(itos) != set(range(n))):
        raise bad(f"itos does not map exactly the ids 0..{n - 1} of vocab_size {n}")
    chars = itos if is_json else [itos[i] for i in range(n)]
    for i, c in enumerate(chars):
        if type(c) is not str or len(c) != 1:
            raise bad(f"itos[{i}] is {short(c)}, not one character")
    if len(set(chars)) != n:
        raise bad("itos gives a character to more than one id")
    if not is_json and "stoi" in meta and meta["stoi"] != {c: i for i, c in enumerate(chars)}:
        raise bad("its stoi is not itos reversed")
    return n, chars


def save_vocab(directory, chars):
    """A character vocabulary written beside exported weights: meta.json for our readers (no pickle
    to read) and nanoGPT's meta.pkl for its sample.py."""
    with open(os.path.join(directory, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"vocab_size": len(chars), "itos": list(chars)}, f, ensure_ascii=False)
    with open(os.path.join(directory, "meta.pkl"), "wb") as f:
        pickle.dump(
            {
                "vocab_size": len(chars),
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )


class CharCodec:
    """A character-level vocabulary (nanoGPT's shakespeare_char): `itos`, the character of each id.
    `source` names where it came from, for errors."""

    def __init__(self, itos, source):
        self.itos, self.source = list(itos), source
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.n_vocab = len(self.itos)

    @classmethod
    def from_file(cls, path):
        return cls(read_vocab(path)[1], path)

    def encode(self, s):
        unknown = sorted(set(s) - self.stoi.keys())
        if unknown:
            raise UsageError(
                f"start has characters outside the vocabulary of {self.source}: "
                f"{''.join(unknown)!r} (the model only knows {''.join(sorted(self.stoi))!r})"
            )
        return [self.stoi[c] for c in s]

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)

    def stream_decoder(self):
        return lambda i: "" if i is None else self.itos[i]


class ChatCodec(ChatTokenizer):
    """nanochat's tokenizer as a codec: a prompt begins with <|bos|>, as nanochat's samples do (its
    documents begin so in training), and may hold its special tokens."""

    def encode(self, s):
        ids = self.enc.encode(s, allowed_special="all")
        return ids if ids[:1] == [self.bos_token_id] else [self.bos_token_id, *ids]

    def stream_decoder(self):
        """As BPECodec's: each id's bytes decoded as they complete a character."""
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda i: utf8.decode(
            b"" if i is None else self.enc.decode_single_token_bytes(i), final=i is None
        )


def chat_codec(dirs):
    """The ChatCodec of the first of `dirs` that holds a tokenizer/ (nanochat's directory)."""
    for d in dirs:
        if storage.exists(storage.join(d, "tokenizer", "tokenizer.pkl")):
            return ChatCodec.from_directory(storage.join(d, "tokenizer"))
    raise InputNotFound(
        "the model was trained in nanochat's tokenizer, and no tokenizer/tokenizer.pkl is in "
        f"{', '.join(dirs) or 'no dataset named'}: run from the directory it was trained in, or "
        "put its tokenizer/ beside the weights"
    )


def nanochat_base_dirs(beside):
    """The folders above a nanochat checkpoint directory `beside` that may hold its tokenizer/, up
    to two levels (its base dir: ~/.cache/nanochat/base_checkpoints/d20/ and
    ~/.cache/nanochat/tokenizer/)."""
    if not beside or storage.is_url(beside):
        return []
    parent = os.path.dirname(os.path.abspath(beside))
    return [parent, os.path.dirname(parent)]


def codec_for(vocab_size, vocab=None, dataset=None, beside=None):
    """What turns a model's token ids into text. `vocab`: what our checkpoints carry ('gpt2', the
    list of a character-level run's characters, or 'nanochat': the tokenizer/ beside the weights,
    in its dataset's folder or up to two folders above the weights, chat_codec). Without it, as
    nanoGPT: a meta.pkl (or our meta.json, first) beside the weights (`beside`: an exported
    directory) or in the training dataset's folder (data/<dataset>/ or the path), else GPT-2's
    BPE. A vocabulary smaller than GPT-2's is never decoded as BPE: when no meta.pkl is found for
    it, one line says so."""
    if isinstance(vocab, list):
        return CharCodec(vocab, f"the checkpoint ({len(vocab)} characters)")
    if vocab == "gpt2":
        return BPECodec()
    dirs = [beside] if beside else []
    if dataset:
        dirs += [dataset] if storage.is_url(dataset) else [os.path.join("data", dataset), dataset]
    if vocab == "nanochat":
        return chat_codec(dirs + nanochat_base_dirs(beside))
    found = next(filter(None, map(vocab_file, dirs)), None)
    if found:
        # read first: a file it refuses is the one line on stderr
        codec = CharCodec.from_file(found)
        print(f"Loading meta from {found}...", file=sys.stderr)
        return codec
    if vocab_size < EOT + 1:
        places = ", ".join(os.path.join(d, "meta.pkl") for d in dirs) or "no dataset named"
        raise InputNotFound(
            f"the model's {vocab_size} token ids are not GPT-2's BPE, and no meta.pkl holds their "
            f"characters ({places}): run from the directory it was trained in, or put its "
            "dataset's meta.pkl beside the weights"
        )
    return BPECodec()
