"""python -m pytest tests/test_chat_tokenizer.py -q

nanochat's BPE tokenizer (dataio/chat_tokenizer.py), trained by rustbpe on a corpus the test writes:
tiktoken encodes every text exactly as rustbpe's own Tokenizer encodes it, one at a time and in
batches; the nine special tokens get nanochat's ids after the merges and are never made from text;
texts round-trip; token_bytes counts each token's bytes. nanochat's tokenizer directory: a
tokenizer.pkl that pickle.dump(tiktoken.Encoding) wrote reads back equal, a token_bytes.pt that
torch.save wrote reads without torch; a pickle that would run code is refused in one line and runs
nothing. With NANOCHAT_CHECKOUT=/path/to/nanochat, nanochat's own RustBPETokenizer, trained on the
same texts, gives the same ids, token bytes and files."""

import io
import os
import pickle
import random
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import tiktoken
from helpers import REPO

from configurator import InputNotFound, UsageError
from dataio import chat_tokenizer
from dataio.chat_tokenizer import (
    SPECIAL_TOKENS,
    ChatTokenizer,
    capped_texts,
    encoding_of,
    read_encoding,
    read_token_bytes,
    train_bpe,
)

VOCAB = 500  # 256 bytes, 235 merges, 9 special tokens
WORDS = "the of and to in is was for on that with as by it at from his an are were be this".split()
ODD = ["naïve", "café", "你好世界", "🙂🌍", "Ωμέγα", "ünïcödé", "日本語", "x²", "\t", "  "]


def corpus(seed, n):
    """Documents of words, numbers, contractions, punctuation, code and non-ASCII text, different
    for each seed (held-out text: another seed)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(5, 60)):
            kind = rng.random()
            if kind < 0.6:
                parts.append(rng.choice(WORDS) + rng.choice(["", "", "'s", "'re", "'LL", ","]))
            elif kind < 0.75:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 7))))
            elif kind < 0.9:
                parts.append(rng.choice(ODD))
            else:
                parts.append(
                    rng.choice(["\n", "\n\n", "def f(x):\n    return x + 1\n", "!?", "..."])
                )
        docs.append(" ".join(parts))
    return docs


TRAIN = corpus(0, 300)
HELD_OUT = corpus(1, 40) + ["", " ", "<|bos|> is text here", "a\r\nb", "1234567890", "\x00\xff"]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(iter(TRAIN), VOCAB)


@pytest.fixture(scope="module")
def tok(bpe):
    return ChatTokenizer(encoding_of(bpe))


def test_tiktoken_encodes_as_rustbpe_does(bpe, tok):
    # the corpus is rich enough to use every merge the vocabulary asks for
    assert tok.n_vocab == VOCAB and bpe.vocab_size == VOCAB - len(SPECIAL_TOKENS)
    for text in TRAIN[:50] + HELD_OUT:
        assert tok.encode(text) == bpe.encode(text), text
    assert tok.encode(HELD_OUT) == [bpe.encode(t) for t in HELD_OUT]  # on tiktoken's threads
    assert tok.encode(HELD_OUT, num_threads=1) == bpe.batch_encode(HELD_OUT)


def test_special_tokens_follow_the_merges_in_nanochats_order(tok):
    assert [tok.encode_special(s) for s in SPECIAL_TOKENS] == list(range(VOCAB - 9, VOCAB))
    assert tok.bos_token_id == VOCAB - 9
    assert len(tok.encode("<|bos|>")) > 1  # text that spells one is ordinary text
    user_end = tok.encode_special("<|user_end|>")
    ids = tok.encode("hello", prepend="<|bos|>", append="<|user_end|>")
    assert ids == [tok.bos_token_id, *tok.encode("hello"), user_end]
    assert tok.encode(["a", "b"], prepend=tok.bos_token_id) == [
        [tok.bos_token_id, *tok.encode(t)] for t in ("a", "b")
    ]
    with pytest.raises(TypeError, match="str or a list"):
        tok.encode(b"bytes")


def test_the_split_pattern_is_gpt4s_with_numbers_in_pairs(tok):
    import regex  # tiktoken's own dependency

    chunks = regex.findall(tok.enc._pat_str, "Year 20245: I'M here,\n\n  ok!!\n")
    # digits two at a time (GPT-4: three), contractions in any case, punctuation takes its newlines
    assert chunks == [
        "Year",
        " ",
        "20",
        "24",
        "5",
        ":",
        " I",
        "'M",
        " here",
        ",\n\n",
        " ",
        " ok",
        "!!\n",
    ]


def test_texts_round_trip(tok):
    for text in HELD_OUT + TRAIN[:20]:
        assert tok.decode(tok.encode(text)) == text


def test_token_bytes_counts_each_tokens_bytes(bpe, tok):
    by_rank = {rank: bytes(token) for token, rank in bpe.get_mergeable_ranks()}
    expected = [len(by_rank[i]) for i in range(len(by_rank))] + [0] * len(SPECIAL_TOKENS)
    assert tok.token_bytes.dtype == np.int32 and tok.token_bytes.tolist() == expected
    for text in HELD_OUT:  # bits per byte's denominator: the bytes of the text
        assert tok.token_bytes[tok.encode(text, prepend="<|bos|>")].sum() == len(text.encode())


def test_documents_are_capped_as_tok_train_caps_them():
    docs = ["a" * 5, "b" * 2, "c" * 9, "d" * 4, "e"]
    # each cut to 4; the total passes 9 at the third (4 + 2 + 4), which is still trained on
    assert list(capped_texts(iter(docs), doc_cap=4, max_chars=9)) == ["aaaa", "bb", "cccc"]
    assert list(capped_texts(iter(docs), doc_cap=100, max_chars=10**9)) == docs
    trained = ChatTokenizer.train(iter(TRAIN), 300, doc_cap=50, max_chars=2000)
    direct = ChatTokenizer(encoding_of(train_bpe(capped_texts(iter(TRAIN), 50, 2000), 300)))
    assert trained.enc._mergeable_ranks == direct.enc._mergeable_ranks


def test_a_vocabulary_without_room_for_the_bytes_is_one_line():
    with pytest.raises(UsageError, match=r"vocab_size=264 leaves 255 ids.*at least 265"):
        train_bpe(iter(TRAIN), 264)


def state(enc):
    return (enc.name, enc._pat_str, enc._mergeable_ranks, enc._special_tokens)


@pytest.mark.parametrize("protocol", [3, 4, 5])  # 2 writes bytes as calls of _codecs.encode
def test_nanochats_pickle_reads_back_equal(tok, tmp_path, protocol):
    path = tmp_path / "tokenizer.pkl"
    with open(path, "wb") as f:  # nanochat's save(): a plain pickle.dump
        pickle.dump(tok.enc, f, protocol=protocol)
    assert state(read_encoding(str(path))) == state(tok.enc)


def test_directory_round_trip_and_token_bytes_pt_read_without_torch(tok, tmp_path):
    import torch

    tok.save(str(tmp_path))
    loaded = ChatTokenizer.from_directory(str(tmp_path))
    assert state(loaded.enc) == state(tok.enc)
    assert loaded.encode(HELD_OUT) == tok.encode(HELD_OUT)
    saved = torch.load(tmp_path / "token_bytes.pt", weights_only=True)
    assert saved.dtype == torch.int32 and saved.tolist() == tok.token_bytes.tolist()
    # no torch at all: sys.modules["torch"] = None makes its import fail
    script = (
        "import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1])\n"
        "from dataio.chat_tokenizer import ChatTokenizer, read_token_bytes\n"
        "t = ChatTokenizer.from_directory(sys.argv[2])\n"
        "saved = read_token_bytes(sys.argv[2] + '/token_bytes.pt')\n"
        "print(saved.tolist() == t.token_bytes.tolist())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, REPO, str(tmp_path)], capture_output=True, text=True
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_a_directory_on_cloud_storage(tok, gcs_dir):
    tok.save(gcs_dir)
    assert state(ChatTokenizer.from_directory(gcs_dir).enc) == state(tok.enc)
    with pytest.raises(InputNotFound, match=f"^no tokenizer at {gcs_dir}/none/tokenizer.pkl"):
        ChatTokenizer.from_directory(f"{gcs_dir}/none")


class RunsCommand:
    """Unpickled, it would run a command (the classic attack)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class CallsEncoding:
    """Unpickled, it would call tiktoken's Encoding with arguments (REDUCE), not NEWOBJ/BUILD."""

    def __reduce__(self):
        return tiktoken.Encoding, ("x", "a", {b"a": 0}, {"<|bos|>": 1})


def refused(tmp_path, payload):
    path = tmp_path / "tokenizer.pkl"
    path.write_bytes(payload)
    with pytest.raises(UsageError) as e:
        ChatTokenizer.from_directory(str(tmp_path))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path} is not nanochat's tokenizer.pkl: ")
    assert line.endswith("prepare.py --tokenizer_only (or nanochat's tok_train)")
    return line


def test_a_pickle_that_would_run_code_is_refused_in_one_line(tok, tmp_path):
    marker = tmp_path / "ran"
    line = refused(tmp_path, pickle.dumps(RunsCommand(f"touch {marker}")))
    assert f"{os.system.__module__}.system" in line and not marker.exists()
    inner = pickle.dumps(RunsCommand(f"touch {marker}"))  # inside the Encoding's state
    assert "system" in refused(tmp_path, pickle.dumps(tok.enc)[:-2] + inner[2:])
    assert not marker.exists()
    assert "collections.OrderedDict" in refused(
        tmp_path, pickle.dumps(__import__("collections").OrderedDict())
    )
    assert "calls tiktoken.core.Encoding" in refused(tmp_path, pickle.dumps(CallsEncoding()))


def test_other_broken_files_are_one_line(tok, tmp_path):
    # pickle.dump's opcodes for an Encoding, with tiktoken's other state: a registry name, which its
    # __setstate__ would fetch from the network
    registry_name = b"\x80\x04\x8c\rtiktoken.core\x8c\x08Encoding\x93)\x81\x8c\x04gpt2b."
    assert "holds 'gpt2'" in refused(tmp_path, registry_name)
    assert "holds a dict" in refused(tmp_path, pickle.dumps({"name": "x"}))
    assert "does not read as a pickle" in refused(tmp_path, pickle.dumps(tok.enc)[:500])
    assert "does not read as a pickle" in refused(tmp_path, b"")
    with pytest.raises(InputNotFound, match=r"^no tokenizer at .*missing/tokenizer.pkl: train"):
        ChatTokenizer.from_directory(str(tmp_path / "missing"))


def torch_zip(tmp_path, value):
    import torch

    path = tmp_path / "token_bytes.pt"
    torch.save(value, path)
    return str(path)


def test_token_bytes_pt_refuses_what_is_not_an_int32_vector(tok, tmp_path):
    import torch

    bad = [
        (torch.zeros(3, dtype=torch.float32), "torch.FloatStorage"),
        (torch.zeros(2, 2, dtype=torch.int32), "not a 1-D int32 vector"),
        ({"a": 1}, "holds a dict"),
        (RunsCommand("true"), f"{os.system.__module__}.system"),
    ]
    for value, why in bad:
        with pytest.raises(UsageError, match="is not nanochat's token_bytes.pt: .*" + why):
            read_token_bytes(torch_zip(tmp_path, value))
    (tmp_path / "token_bytes.pt").write_bytes(b"not a zip")
    with pytest.raises(UsageError, match="does not read as torch.save's zip"):
        read_token_bytes(str(tmp_path / "token_bytes.pt"))
    # a token_bytes.pt of another tokenizer beside tokenizer.pkl
    tok.save(str(tmp_path))
    torch_zip(tmp_path, torch.ones(VOCAB + 1, dtype=torch.int32))
    with pytest.raises(UsageError, match=f"does not count the bytes .*{VOCAB + 1} ids against"):
        ChatTokenizer.from_directory(str(tmp_path))
    assert zipfile.is_zipfile(tmp_path / "token_bytes.pt")


def nanochat_checkout():
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own tokenizer needs its checkout")
    sys.path.insert(0, checkout)
    from nanochat import tokenizer

    return tokenizer


def test_nanochats_own_tokenizer_agrees(tok, tmp_path):
    import torch

    theirs_module = nanochat_checkout()
    assert tuple(theirs_module.SPECIAL_TOKENS) == SPECIAL_TOKENS
    assert theirs_module.SPLIT_PATTERN == chat_tokenizer.SPLIT_PATTERN
    theirs = theirs_module.RustBPETokenizer.train_from_iterator(iter(TRAIN), VOCAB)
    assert state(theirs.enc) == state(tok.enc)
    for text in HELD_OUT:
        assert theirs.encode(text, prepend="<|bos|>") == tok.encode(text, prepend="<|bos|>")
    assert theirs.encode(HELD_OUT, prepend="<|bos|>", append="<|assistant_end|>") == tok.encode(
        HELD_OUT, prepend="<|bos|>", append="<|assistant_end|>"
    )
    assert [theirs.encode_special(s) for s in SPECIAL_TOKENS] == [
        tok.encode_special(s) for s in SPECIAL_TOKENS
    ]
    # tok_train's token_bytes loop, through nanochat's tokenizer
    special = {theirs.encode_special(s) for s in theirs.get_special_tokens()}
    their_bytes = [
        0 if i in special else len(theirs.decode_single_token_bytes(i))
        for i in range(theirs.get_vocab_size())
    ]
    assert their_bytes == tok.token_bytes.tolist()
    # our directory read by nanochat, nanochat's read by us
    tok.save(str(tmp_path / "ours"))
    loaded = theirs_module.RustBPETokenizer.from_directory(str(tmp_path / "ours"))
    assert loaded.encode(HELD_OUT, prepend="<|bos|>") == tok.encode(HELD_OUT, prepend="<|bos|>")
    theirs.save(str(tmp_path / "theirs"))
    buffer = io.BytesIO()
    torch.save(torch.tensor(their_bytes, dtype=torch.int32), buffer)
    (tmp_path / "theirs" / "token_bytes.pt").write_bytes(buffer.getvalue())
    ours = ChatTokenizer.from_directory(str(tmp_path / "theirs"))
    assert ours.encode(HELD_OUT) == theirs.encode(HELD_OUT)
