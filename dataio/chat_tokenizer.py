"""nanochat's BPE tokenizer (nanochat/tokenizer.py, scripts/tok_train.py): trained by rustbpe on
the pretraining shards' text, GPT-4's split pattern with numbers in pairs, nine special tokens after
the merges; encoded and decoded by tiktoken. Its directory, as nanochat writes it: tokenizer.pkl (a
pickled tiktoken.Encoding) and token_bytes.pt (torch.save of an int32 tensor: the bytes of each
token id, 0 for a special token, that bits per byte divides by). Both are read without running
anything they name, and without torch."""

import functools
import io
import pickle
import zipfile

import numpy as np
import tiktoken

from configurator import InputNotFound, UsageError
from dataio import storage
from dataio.unpickling import RefusedGlobal, short

# nanochat's order is its ids: the first comes right after the merges
SPECIAL_TOKENS = (
    "<|bos|>",  # begins every document: the delimiter of pretraining
    "<|user_start|>",  # the rest render conversations in finetuning
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",  # the assistant calls its python tool
    "<|python_end|>",
    "<|output_start|>",  # the tool's output, back to the assistant
    "<|output_end|>",
)
# GPT-4's pattern but \p{N}{1,2} for \p{N}{1,3}: nanochat found pairs best at a 32K vocabulary
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)
VOCAB_SIZE = 32768  # tok_train's defaults: 2**15 ids, specials included
DOC_CAP = 10_000  # characters kept of each document
MAX_CHARS = 2_000_000_000  # characters trained on in all
ENCODING_NAME = "rustbpe"  # what nanochat names its tiktoken.Encoding

RETRAIN = (
    "train it again: python data/nanochat/prepare.py --tokenizer_only (or nanochat's tok_train)"
)
ENCODING_STATE = {"name": str, "pat_str": str, "mergeable_ranks": dict, "special_tokens": dict}


def capped_texts(texts, doc_cap=DOC_CAP, max_chars=MAX_CHARS):
    """tok_train's text_iterator: each document cut to doc_cap characters, stopping after the
    document that takes the total past max_chars (that one is still trained on)."""
    total = 0
    for text in texts:
        text = text[:doc_cap]
        total += len(text)
        yield text
        if total > max_chars:
            return


def check_vocab_size(vocab_size):
    """The ids left for the bytes and merges, at least the 256 bytes, or one line."""
    n_merged = vocab_size - len(SPECIAL_TOKENS)
    if n_merged < 256:
        raise UsageError(
            f"vocab_size={vocab_size} leaves {n_merged} ids for the bytes and merges: give at "
            f"least {256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    return n_merged


def train_bpe(texts, vocab_size=VOCAB_SIZE):
    """rustbpe's merges for `vocab_size` ids less the special tokens, which come after them."""
    import rustbpe  # the nanochat extras: only training needs it

    n_merged = check_vocab_size(vocab_size)
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(texts, n_merged, pattern=SPLIT_PATTERN)
    return bpe


def encoding_of(bpe):
    """The tiktoken.Encoding of a trained rustbpe.Tokenizer, as nanochat builds it: its pattern and
    ranks, then the special tokens in SPECIAL_TOKENS' order."""
    ranks = {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}
    return tiktoken.Encoding(
        name=ENCODING_NAME,
        pat_str=bpe.get_pattern(),
        mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(SPECIAL_TOKENS)},
    )


class ChatTokenizer:
    """nanochat's RustBPETokenizer: text <-> token ids through a tiktoken.Encoding; special tokens
    only as ids (text that spells one is ordinary text)."""

    def __init__(self, enc):
        self.enc = enc
        self.n_vocab = enc.n_vocab
        self.bos_token_id = self.encode_special("<|bos|>")

    @classmethod
    def train(cls, texts, vocab_size=VOCAB_SIZE, doc_cap=DOC_CAP, max_chars=MAX_CHARS):
        """Trained as tok_train trains it, on the texts of an iterator."""
        return cls(encoding_of(train_bpe(capped_texts(texts, doc_cap, max_chars), vocab_size)))

    @classmethod
    def from_directory(cls, directory):
        """nanochat's tokenizer directory (a folder or a URL): its tokenizer.pkl, checked against
        its token_bytes.pt where there is one."""
        tokenizer = cls(read_encoding(storage.join(directory, "tokenizer.pkl")))
        path = storage.join(directory, "token_bytes.pt")
        if storage.exists(path):
            saved = read_token_bytes(path)
            if not np.array_equal(saved, tokenizer.token_bytes):
                raise UsageError(
                    f"{path} does not count the bytes of {directory}'s tokenizer.pkl "
                    f"({len(saved)} ids against {tokenizer.n_vocab}): {RETRAIN}"
                )
        return tokenizer

    def get_bos_token_id(self):  # nanochat's name (run/core_eval.py asks it)
        return self.bos_token_id

    def encode_special(self, name):
        return self.enc.encode_single_token(name)

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """Ids of a text, or of each text of a list (on num_threads threads); `prepend`/`append`: a
        special token (its name or id) before or after each."""
        ends = [
            t if t is None or isinstance(t, int) else self.encode_special(t)
            for t in (prepend, append)
        ]

        def framed(ids):
            return [ends[0]] * (ends[0] is not None) + ids + [ends[1]] * (ends[1] is not None)

        if isinstance(text, str):
            return framed(self.enc.encode_ordinary(text))
        if isinstance(text, list):
            return [
                framed(ids) for ids in self.enc.encode_ordinary_batch(text, num_threads=num_threads)
            ]
        raise TypeError(f"encode takes a str or a list of str, not a {type(text).__name__}")

    def decode(self, ids):
        return self.enc.decode(ids)

    @functools.cached_property
    def token_bytes(self):
        """int32 bytes of each id, 0 for a special token: tok_train's token_bytes.pt (the raw bytes,
        not their decoded text, which would miscount a token that is part of a character)."""
        special = {self.enc.encode_single_token(s) for s in self.enc.special_tokens_set}
        return np.array(
            [
                0 if i in special else len(self.enc.decode_single_token_bytes(i))
                for i in range(self.n_vocab)
            ],
            dtype=np.int32,
        )

    def save(self, directory, token_bytes_pt=True):
        """nanochat's directory: tokenizer.pkl, and token_bytes.pt (needs torch: nanochat's file is
        torch's; ours need it not, token_bytes comes from the encoding) unless token_bytes_pt is
        False. Each file is written whole or not at all."""
        storage.makedirs(directory)
        storage.write_bytes(storage.join(directory, "tokenizer.pkl"), pickle.dumps(self.enc))
        if token_bytes_pt:
            import torch  # the parity extras

            buffer = io.BytesIO()
            torch.save(torch.from_numpy(self.token_bytes), buffer)
            storage.write_bytes(storage.join(directory, "token_bytes.pt"), buffer.getvalue())


class _EncodingState:
    """What the one class a tokenizer.pkl may name becomes while it is read: the state pickle gives
    it (BUILD), kept to check, never tiktoken's __setstate__ (a string state there is a registry
    name, fetched from the network)."""

    def __init__(self, *args):  # REDUCE calls the class; NEWOBJ, what pickle.dump writes, does not
        raise RefusedGlobal("it calls tiktoken.core.Encoding, where pickle.dump writes its state")

    def __setstate__(self, state):
        self.state = state


class EncodingOnly(pickle.Unpickler):
    """An unpickler that admits what pickle.dump(tiktoken.Encoding) writes, nothing else: the
    class tiktoken.core.Encoding, made empty (NEWOBJ), then given a dict of str, bytes and
    ints (BUILD)."""

    def find_class(self, module, name):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingState
        raise RefusedGlobal(f"it names the callable {module}.{name}, which is never run")


def read_encoding(path):
    """The tiktoken.Encoding of a tokenizer.pkl (a path or a URL), as nanochat pickles it, read
    without running anything it names and checked: anything else is one line naming the file."""

    def bad(why):
        return UsageError(f"{path} is not nanochat's tokenizer.pkl: {why}; {RETRAIN}")

    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise InputNotFound(f"no tokenizer at {path}: {RETRAIN}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        held = EncodingOnly(io.BytesIO(data)).load()
    except RefusedGlobal as e:
        raise bad(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: what it raises varies with its bytes
        why = (str(e).splitlines() or [""])[0][:200]
        raise bad(f"it does not read as a pickle ({type(e).__name__}: {why})") from None
    state = getattr(held, "state", None)
    if not isinstance(held, _EncodingState) or not isinstance(state, dict):
        raise bad(f"it holds {short(state if isinstance(held, _EncodingState) else held)}")
    if set(state) != set(ENCODING_STATE):
        raise bad(
            f"its Encoding's state has the keys {sorted(state)}, not {sorted(ENCODING_STATE)}"
        )
    for key, kind in ENCODING_STATE.items():
        if type(state[key]) is not kind:
            raise bad(f"its {key} is {short(state[key])}, not a {kind.__name__}")
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    if not all(type(k) is bytes and type(v) is int for k, v in ranks.items()):
        raise bad("its mergeable_ranks is not a dict of bytes -> int")
    if not all(type(k) is str and type(v) is int for k, v in specials.items()):
        raise bad("its special_tokens is not a dict of str -> int")
    if "<|bos|>" not in specials:
        raise bad(f"it has no <|bos|> among its special tokens {sorted(specials)[:9]}")
    try:
        return tiktoken.Encoding(**state)
    except Exception as e:  # noqa: BLE001 - tiktoken's checks (a bad pattern, ids that clash)
        raise bad(f"tiktoken refuses it ({type(e).__name__}: {str(e)[:200]})") from None


class _IntStorage:
    """torch.IntStorage as token_bytes.pt names it: the dtype of the storage it points at."""


class TensorOnly(pickle.Unpickler):
    """An unpickler for the data.pkl of torch.save(an int32 tensor): it rebuilds the tensor as a
    numpy array from the archive's raw storage (persistent ids), and admits no other global."""

    def __init__(self, file, storages):
        super().__init__(file)
        self.storages = storages  # key -> the bytes of data/<key>

    def find_class(self, module, name):
        admitted = {
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch", "IntStorage"): _IntStorage,
            ("collections", "OrderedDict"): dict,  # the tensor's backward hooks: none
        }
        if (module, name) not in admitted:
            raise RefusedGlobal(f"it names {module}.{name}, not an int32 tensor's parts")
        return admitted[module, name]

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"a persistent id {short(pid)} that is no storage")
        _, dtype, key, _location, numel = pid
        if dtype is not _IntStorage or key not in self.storages:
            raise pickle.UnpicklingError(f"a storage {short(key)} that is not int32 data here")
        return np.frombuffer(self.storages[key], dtype="<i4", count=numel)


def _rebuild_tensor(storage, offset, size, stride, requires_grad, hooks, *metadata):
    if not isinstance(storage, np.ndarray) or len(size) != 1 or tuple(stride) != (1,):
        raise pickle.UnpicklingError(f"a tensor of shape {short(size)}, not a 1-D int32 vector")
    return storage[offset : offset + size[0]].copy()


def read_token_bytes(path):
    """The int32 numpy vector of a token_bytes.pt (a path or URL) that torch.save wrote, read from
    its zip without torch and without running anything its pickle names."""

    def bad(why):
        return UsageError(f"{path} is not nanochat's token_bytes.pt: {why}; {RETRAIN}")

    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise InputNotFound(f"no token_bytes at {path}: {RETRAIN}") from None
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise bad("it is a zip without torch.save's one <name>/data.pkl")
        root = pkl[0][: -len("data.pkl")]
        if f"{root}byteorder" in names and archive.read(f"{root}byteorder") != b"little":
            raise bad("its storage is big-endian")
        storages = {
            n[len(root) + 5 :]: archive.read(n) for n in names if n.startswith(f"{root}data/")
        }
        vector = TensorOnly(io.BytesIO(archive.read(pkl[0])), storages).load()
    except UsageError:
        raise
    except RefusedGlobal as e:
        raise bad(str(e)) from None
    except Exception as e:  # noqa: BLE001 - not a zip, a truncated one, a foreign pickle
        why = (str(e).splitlines() or [""])[0][:200]
        raise bad(f"it does not read as torch.save's zip ({type(e).__name__}: {why})") from None
    if not isinstance(vector, np.ndarray):
        raise bad(f"it holds {short(vector)}, not a tensor")
    return vector
