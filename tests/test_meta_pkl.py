"""python -m pytest tests/test_meta_pkl.py -q

Reading a dataset or a model runs nothing it names: a meta.pkl whose pickle calls os.system,
builtins.exec or subprocess is refused in one line (exit 2) by train.py, sample.py, eval.py and
hellaswag.py, wherever they find it, and its command never runs; nanoGPT's own prepare.py output
still trains and samples; export.py writes a JSON twin that our readers take first. The codecs made
from them (dataio/tokenizer.py): where codec_for looks, in which order, and what each codec encodes,
decodes and streams."""

import builtins
import json
import os
import pickle
import runpy
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from helpers import (
    HELLASWAG_FIXTURE,
    REPO,
    Call,
    one_line_error,
    python_in_c_locale,
    run,
    train_cli,
)

import eval as lm_eval_py
import export
import hellaswag
import sample
from configurator import InputNotFound, UsageError, exit_on_bad_input
from dataio.dataloader import data_meta
from dataio.tokenizer import (
    BPECodec,
    CharCodec,
    codec_for,
    read_vocab,
    save_hf_tokenizer,
    save_vocab,
)
from parity import nanogpt_reference as nanogpt
from parity.common import save_random_hf_model
from run import checkpoint

# the `dataset` fixture's 64 characters: its programs are compiled already
CHARS = [chr(48 + i) for i in range(64)]


# what each pickle runs: it creates `marker`
PAYLOADS = {
    "os.system": lambda marker: Call(os.system, f"touch {marker}"),
    "builtins.exec": lambda marker: Call(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
    "subprocess.call": lambda marker: Call(subprocess.call, ["touch", str(marker)]),
}
NANOGPT = {
    "vocab_size": 64,
    "itos": dict(enumerate(CHARS)),
    "stoi": {c: i for i, c in enumerate(CHARS)},
}
# valid pickles of builtins only, not nanoGPT's vocabulary: (meta, what the error says)
WRONG_SHAPES = {
    "itos a list": ({**NANOGPT, "itos": CHARS}, "itos is a list, not a dict id -> character"),
    "itos multi-char": (
        {**NANOGPT, "itos": {**NANOGPT["itos"], 3: "ab"}},
        "itos[3] is 'ab', not one character",
    ),
    "no vocab_size": ({"itos": NANOGPT["itos"]}, "it has no vocab_size"),
    "itos empty": (
        {"vocab_size": 64, "itos": {}, "stoi": {}},
        "itos holds 0 characters, vocab_size says 64",
    ),
    "not a dict": ([CHARS], "it holds a list, not a dict"),
    "no itos": ({"vocab_size": 64}, "it has no itos"),
    "itos ids": (
        {"vocab_size": 2, "itos": {1: "a", 2: "b"}},
        "itos does not map exactly the ids 0..1 of vocab_size 2",
    ),
    "itos repeats": (
        {"vocab_size": 2, "itos": {0: "a", 1: "a"}},
        "itos gives a character to more than one id",
    ),
    "stoi not itos reversed": (
        {**NANOGPT, "stoi": {**NANOGPT["stoi"], "0": 1}},
        "its stoi is not itos reversed",
    ),
    # a value in the line: its type where it is no str or number, its repr cut at 40 characters
    "vocab_size a list": (
        {**NANOGPT, "vocab_size": [64]},
        "vocab_size is a list, not a positive int",
    ),
    "itos 40-char repr": (
        {**NANOGPT, "itos": {**NANOGPT["itos"], 3: "x" * 38}},
        f"itos[3] is '{'x' * 38}', not one character",
    ),
    "itos 41-char repr": (
        {**NANOGPT, "itos": {**NANOGPT["itos"], 3: "x" * 39}},
        f"itos[3] is '{'x' * 39}..., not one character",
    ),
}


def write_meta(directory, kind, marker):
    """meta.pkl of `kind` in `directory`: nanoGPT's with a payload among its values, or a wrong
    shape. -> (its path, what the error says)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "meta.pkl")
    if kind in PAYLOADS:
        call = PAYLOADS[kind](marker)
        meta = {**NANOGPT, "note": call}  # an otherwise good vocabulary
        why = f"it names the callable {call.fn.__module__}.{call.fn.__name__}, which is never run"
    else:
        meta, why = WRONG_SHAPES[kind]
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    return path, f"{path} is not a plain character vocabulary: {why}; nanoGPT's prepare.py writes"


def refused(capsys, main, *argv):
    """What `python script.py ARGV` does with main(ARGV): one line on stderr, exit 2."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        exit_on_bad_input(lambda: main(list(argv)))
    return one_line_error(
        SimpleNamespace(returncode=e.value.code, stderr=capsys.readouterr().err), 2
    )


@pytest.mark.parametrize("kind", [*PAYLOADS, *WRONG_SHAPES])
def test_the_reader_refuses_all_but_a_vocabulary_in_one_line_and_runs_nothing(kind, tmp_path):
    marker = tmp_path / "PWNED"
    path, message = write_meta(tmp_path / "data", kind, marker)
    # the reader, and what calls it: a dataset's folder (train.py), beside an export, a nanoGPT
    # run's dataset
    folder = str(tmp_path / "data")
    for read in (
        lambda: read_vocab(path),
        lambda: data_meta(folder),
        lambda: codec_for(64, beside=folder),
        lambda: codec_for(64, dataset=folder),
    ):
        with pytest.raises(UsageError) as e:
            read()
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert not marker.exists()
    if kind in PAYLOADS:  # the payload is live: a plain pickle.load runs it
        with open(path, "rb") as f:
            pickle.load(f)
        assert marker.exists()


def test_a_vocabulary_file_that_does_not_read_is_one_line_and_one_character_is_a_vocabulary(
    tmp_path,
):
    json_path, pkl_path, missing = (
        str(tmp_path / name) for name in ("meta.json", "meta.pkl", "none.pkl")
    )
    (tmp_path / "meta.json").write_text("{not json")
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(NANOGPT)[:-1])  # cut short
    for path, line in (
        (
            json_path,
            f"{json_path} is not a plain character vocabulary: it does not read as JSON "
            "(JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
            "column 2 (char 1)); export.py writes",
        ),
        (
            pkl_path,
            f"{pkl_path} is not a plain character vocabulary: it does not read as a pickle "
            "(UnpicklingError: pickle data was truncated); nanoGPT's prepare.py writes",
        ),
        (missing, f"cannot read {missing}: No such file or directory"),
    ):
        with pytest.raises(UsageError) as e:
            read_vocab(path)
        assert str(e.value).startswith(line), str(e.value)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 1, "itos": ["a"]}))
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 1, "itos": {0: "a"}}))
    assert read_vocab(json_path) == read_vocab(pkl_path) == (1, ["a"])


def test_train_py_refuses_a_dataset_whose_meta_pkl_runs_code(dataset, tmp_path):
    """The issue's command: python train.py config/train_shakespeare_char.py --dataset=DIR."""
    data, out, marker = tmp_path / "data", tmp_path / "out", tmp_path / "PWNED"
    shutil.copytree(dataset, data)
    _, message = write_meta(data, "os.system", marker)
    err = one_line_error(
        train_cli(["config/train_shakespeare_char.py", f"--dataset={data}", f"--out_dir={out}"]), 2
    )
    assert err.startswith(f"error: {message}"), err
    assert not marker.exists() and not out.exists()


def test_sample_refuses_a_meta_pkl_beside_an_hf_export_that_runs_code(tmp_path, capsys):
    hf, marker = tmp_path / "hf", tmp_path / "PWNED"
    save_random_hf_model(hf, seed=0, n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=64)
    _, message = write_meta(hf, "builtins.exec", marker)
    assert refused(capsys, sample.main, f"--init_from={hf}").startswith(f"error: {message}")
    assert not marker.exists()


def test_sample_eval_and_hellaswag_refuse_a_nanogpt_runs_meta_pkl_that_runs_code(tmp_path, capsys):
    """A nanoGPT ckpt.pt: its dataset's meta.pkl decodes it (sample.py), or says it is
    character-level (eval.py, hellaswag.py): each reads it first."""
    data, marker = tmp_path / "data", tmp_path / "PWNED"
    config = nanogpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    nanogpt.save_ckpt(nanogpt.GPT(config), tmp_path / "ckpt.pt", config={"dataset": str(data)})
    ckpt = f"--init_from={tmp_path / 'ckpt.pt'}"
    _, message = write_meta(data, "subprocess.call", marker)
    for main, argv in (
        (sample.main, [ckpt]),
        (hellaswag.main, [ckpt, "--path", HELLASWAG_FIXTURE]),
        (lm_eval_py.main, [ckpt, "--tasks=hellaswag_local", f"--include_path={REPO}/eval_tasks"]),
    ):
        assert refused(capsys, main, *argv).startswith(f"error: {message}"), main
    _, message = write_meta(data, "itos multi-char", marker)
    assert refused(capsys, hellaswag.main, ckpt, "--path", HELLASWAG_FIXTURE).startswith(
        f"error: {message}"
    )
    assert not marker.exists()


@pytest.mark.slow
def test_nanogpts_prepare_output_trains_and_samples_and_the_export_reads_without_pickle(
    tmp_path, capsys
):
    # nanoGPT's data/shakespeare_char/prepare.py, run on a text of the 64 characters: train.bin,
    # val.bin, meta.pkl
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(os.path.join(REPO, "data", "shakespeare_char", "prepare.py"), data)
    (data / "input.txt").write_text(
        "".join(CHARS[i * 7 % 64] for i in range(20000)), encoding="utf-8"
    )
    runpy.run_path(str(data / "prepare.py"))
    assert read_vocab(str(data / "meta.pkl")) == (64, CHARS)
    # exact: nanoGPT's, for its export
    run(str(data), tmp_path / "out", "--max_iters=2", "--gelu=exact")
    capsys.readouterr()
    argv = ["--start=0123", "--num_samples=1", "--max_new_tokens=4", "--seed=1"]
    assert sample.main([f"--out_dir={tmp_path / 'out'}", *argv]) == 0
    text = capsys.readouterr().out
    assert text.startswith("0123")

    # the export: meta.json (ours, read first) beside nanoGPT's meta.pkl, the same characters
    hf = tmp_path / "hf"
    assert export.main([f"--out_dir={tmp_path / 'out'}", f"--to={hf}"]) == 0
    assert json.loads((hf / "meta.json").read_text(encoding="utf-8")) == {
        "vocab_size": 64,
        "itos": CHARS,
    }
    assert read_vocab(str(hf / "meta.pkl")) == (64, CHARS)
    capsys.readouterr()
    assert sample.main([f"--init_from={hf}", *argv]) == 0
    out = capsys.readouterr()
    assert out.out == text and f"Loading meta from {hf / 'meta.json'}" in out.err
    # a nanoGPT ckpt.pt named by its file: the vocabulary beside it, before its dataset's
    nano = tmp_path / "nano"
    assert export.main([f"--out_dir={tmp_path / 'out'}", "--format=nanogpt", f"--to={nano}"]) == 0
    capsys.readouterr()
    assert sample.main([f"--init_from={nano / 'ckpt.pt'}", *argv]) == 0
    out = capsys.readouterr()
    assert out.out == text and f"Loading meta from {nano / 'meta.json'}" in out.err
    # sample's --dtype
    model, codec, step = checkpoint.load_with_codec(str(nano / "ckpt.pt"), "out", "bfloat16")
    assert (model.config.dtype, model.config.dropout, codec.n_vocab, step) == (
        "bfloat16",
        0.0,
        64,
        None,
    )
    assert checkpoint.load_model(str(nano / "ckpt.pt"), dropout=0.1)[0].config.dropout == 0.1

    # beside the twin, meta.pkl is never opened: a payload there neither runs nor stops the sample
    marker = tmp_path / "PWNED"
    write_meta(hf, "os.system", marker)
    assert sample.main([f"--init_from={hf}", *argv]) == 0
    assert capsys.readouterr().out == text and not marker.exists()
    (hf / "meta.json").write_text(json.dumps({"vocab_size": 64, "itos": "".join(CHARS)}))
    err = refused(capsys, sample.main, f"--init_from={hf}", *argv)
    assert err == (
        f"error: {hf / 'meta.json'} is not a plain character vocabulary: itos is a str, not a list "
        "of "
        'characters; export.py writes {"vocab_size": n, "itos": [n characters]}'
    )


# --- the codecs: where codec_for looks, and what each codec does
# ---------------------------------------------------


def test_codec_for_looks_in_the_checkpoint_beside_the_weights_then_data_name_then_the_path(
    tmp_path, monkeypatch
):
    """The checkpoint's own vocab first ('gpt2', or its characters), then a meta file beside the
    weights, then data/<dataset>, then the path <dataset>; a URL dataset as it is. A character
    outside the vocabulary is one line naming where the vocabulary came from."""
    monkeypatch.chdir(tmp_path)

    def vocab_in(folder, chars):
        os.makedirs(folder)
        with open(os.path.join(folder, "meta.pkl"), "wb") as f:
            pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars))}, f)
        return folder

    vocab_in(os.path.join("data", "chars"), "ab")
    # ./chars: the path "chars" too
    path, beside = vocab_in(str(tmp_path / "chars"), "xyz"), vocab_in("hf", "0")
    assert isinstance(codec_for(3, vocab="gpt2", beside=beside, dataset="chars"), BPECodec)
    assert codec_for(3, beside=beside, dataset="chars").itos == ["0"]
    assert codec_for(3, dataset="chars").itos == ["a", "b"]
    assert codec_for(3, dataset=path).itos == ["x", "y", "z"]
    with pytest.raises(UsageError) as e:
        codec_for(3, beside=beside).encode("01")
    assert (
        str(e.value)
        == f"start has characters outside the vocabulary of {beside}/meta.pkl: '1' (the model only "
        "knows '0')"
    )
    with pytest.raises(UsageError) as e:
        codec_for(50257, vocab=["b", "a"]).encode("ab?!c")
    assert str(e.value) == (
        "start has characters outside the vocabulary of the checkpoint (2 characters): '!?c' "
        "(the model only knows 'ab')"
    )
    # none found: GPT-2's BPE for its vocabulary or more, else one line naming where it looked (a
    # URL as it is)
    assert isinstance(codec_for(50257), BPECodec)
    for where, places in (
        (
            {"dataset": "memory://nanogpt-tests/no-vocab"},
            "memory://nanogpt-tests/no-vocab/meta.pkl",
        ),
        ({"beside": "data", "dataset": "no"}, "data/meta.pkl, data/no/meta.pkl, no/meta.pkl"),
        ({}, "no dataset named"),
    ):
        with pytest.raises(InputNotFound) as e:
            codec_for(50256, **where)
        assert str(e.value) == (
            f"the model's 50256 token ids are not GPT-2's BPE, and no meta.pkl holds their "
            f"characters ({places}): run from the directory it was trained in, or put its "
            "dataset's meta.pkl beside the weights"
        )


def test_the_codecs_round_trip_and_stream_exactly_what_decode_gives():
    """GPT-2's BPE takes <|endoftext|> as its id; streamed token by token, a character split across
    tokens waits for its last byte, and the end flushes what is left as decode() does (U+FFFD), so
    the stream is decode()'s text."""
    bpe = BPECodec()
    assert bpe.n_vocab == 50257
    text = "naïve 日本語 🎉<|endoftext|>"
    ids = bpe.encode(text)
    assert ids[-1] == 50256 and bpe.decode(ids) == text
    cut = bpe.encode("🎉")[:-1]  # a character cut short
    assert len(cut) > 1 and bpe.decode(cut) == "\ufffd"
    for ids in (ids, cut):
        stream = bpe.stream_decoder()
        pieces = [stream(i) for i in ids]
        assert "".join(pieces) + stream(None) == bpe.decode(ids)
        assert "\ufffd" not in "".join(pieces)  # nothing decoded before its last byte
    chars = CharCodec("ab\n", "test")
    stream = chars.stream_decoder()
    assert chars.decode(chars.encode("ba\nb")) == "ba\nb"
    assert [stream(i) for i in chars.encode("ba\n")] + [stream(None)] == ["b", "a", "\n", ""]


def test_the_hf_tokenizer_has_gpt2s_special_tokens(tmp_path):
    """As GPT-2's on the hub: <|endoftext|> is bos, eos and unk (lm-eval pads with unk), and no
    token is added."""
    tok = save_hf_tokenizer(tmp_path)
    assert len(tok) == 50257 and tok.bos_token_id == tok.eos_token_id == tok.unk_token_id == 50256
    assert tok.encode("a<|endoftext|>") == [64, 50256]


def test_save_vocab_writes_nanogpts_meta_pkl_and_a_utf8_json_twin_in_any_locale(tmp_path):
    """nanoGPT's sample.py reads meta.pkl's stoi and itos; meta.json is UTF-8 even where the
    locale's default is ASCII (a C locale without Python's UTF-8 mode, in a python of its own)."""
    chars, here, ascii_locale = ["\n", " ", "a", "é", "—"], tmp_path / "here", tmp_path / "c-locale"
    os.makedirs(here)
    save_vocab(here, chars)
    with open(here / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {
            "vocab_size": 5,
            "itos": dict(enumerate(chars)),
            "stoi": {c: i for i, c in enumerate(chars)},
        }
    assert json.loads((here / "meta.json").read_bytes().decode("utf-8")) == {
        "vocab_size": 5,
        "itos": chars,
    }
    assert read_vocab(str(here / "meta.json")) == read_vocab(str(here / "meta.pkl")) == (5, chars)
    os.makedirs(ascii_locale)
    # an ASCII argv
    script = (
        "from dataio import tokenizer; "
        f"tokenizer.save_vocab({ascii(str(ascii_locale))}, {ascii(chars)})"
    )
    r = python_in_c_locale(script, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("meta.json", "meta.pkl"):  # the same files
        assert (ascii_locale / name).read_bytes() == (here / name).read_bytes(), name
