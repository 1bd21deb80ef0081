"""python -m pytest tests/test_meta_pkl.py -q

Reading a dataset or a model runs nothing it names: a meta.pkl whose pickle calls os.system, builtins.exec or
subprocess is refused in one line (exit 2) by train.py, sample.py, eval.py and hellaswag.py, wherever they find it,
and its command never runs; nanoGPT's own prepare.py output still trains and samples; export.py writes a JSON twin
that our readers take first."""

import builtins
import json
import os
import pickle
import runpy
import shutil
import subprocess
from types import SimpleNamespace

import pytest

import eval as lm_eval_py
import export
import hellaswag
import sample
from configurator import UsageError, exit_on_bad_input
from dataloader import data_meta
from helpers import REPO, one_line_error, run, train_cli
from parity import nanogpt_reference as nanogpt
from parity.common import save_random_hf_model
from tokenizer import codec_for, read_vocab

CHARS = [chr(48 + i) for i in range(64)]  # the `dataset` fixture's 64 characters: its programs are compiled already
HELLASWAG = os.path.join(REPO, "tests", "fixtures", "hellaswag_small.jsonl")


class Call:
    """Pickles as the call fn(*args), which a plain pickle.load makes."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


# what each pickle runs: it creates `marker`
PAYLOADS = {
    "os.system": lambda marker: Call(os.system, f"touch {marker}"),
    "builtins.exec": lambda marker: Call(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
    "subprocess.call": lambda marker: Call(subprocess.call, ["touch", str(marker)]),
}
NANOGPT = {"vocab_size": 64, "itos": dict(enumerate(CHARS)), "stoi": {c: i for i, c in enumerate(CHARS)}}
WRONG_SHAPES = {  # valid pickles of builtins only, not nanoGPT's vocabulary: (meta, what the error says)
    "itos a list": ({**NANOGPT, "itos": CHARS}, "itos is a list, not a dict id -> character"),
    "itos multi-char": ({**NANOGPT, "itos": {**NANOGPT["itos"], 3: "ab"}}, "itos[3] is 'ab', not one character"),
    "no vocab_size": ({"itos": NANOGPT["itos"]}, "it has no vocab_size"),
    "itos empty": ({"vocab_size": 64, "itos": {}, "stoi": {}}, "itos holds 0 characters, vocab_size says 64"),
}


def write_meta(directory, kind, marker):
    """meta.pkl of `kind` in `directory`: nanoGPT's with a payload among its values, or a wrong shape. -> (its path,
    what the error says)."""
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
    return one_line_error(SimpleNamespace(returncode=e.value.code, stderr=capsys.readouterr().err), 2)


@pytest.mark.parametrize("kind", [*PAYLOADS, *WRONG_SHAPES])
def test_the_reader_refuses_all_but_a_vocabulary_in_one_line_and_runs_nothing(kind, tmp_path):
    marker = tmp_path / "PWNED"
    path, message = write_meta(tmp_path / "data", kind, marker)
    # the reader, and what calls it: a dataset's folder (train.py), beside an export, a nanoGPT run's dataset
    folder = str(tmp_path / "data")
    for read in (lambda: read_vocab(path), lambda: data_meta(folder), lambda: codec_for(64, beside=folder),
                 lambda: codec_for(64, dataset=folder)):
        with pytest.raises(UsageError) as e:
            read()
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert not marker.exists()
    if kind in PAYLOADS:  # the payload is live: a plain pickle.load runs it
        with open(path, "rb") as f:
            pickle.load(f)
        assert marker.exists()


def test_train_py_refuses_a_dataset_whose_meta_pkl_runs_code(dataset, tmp_path):
    """The issue's command: python train.py config/train_shakespeare_char.py --dataset=DIR."""
    data, out, marker = tmp_path / "data", tmp_path / "out", tmp_path / "PWNED"
    shutil.copytree(dataset, data)
    _, message = write_meta(data, "os.system", marker)
    err = one_line_error(train_cli(["config/train_shakespeare_char.py", f"--dataset={data}", f"--out_dir={out}"]), 2)
    assert err.startswith(f"error: {message}"), err
    assert not marker.exists() and not out.exists()


def test_sample_refuses_a_meta_pkl_beside_an_hf_export_that_runs_code(tmp_path, capsys):
    hf, marker = tmp_path / "hf", tmp_path / "PWNED"
    save_random_hf_model(hf, seed=0, n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=64)
    _, message = write_meta(hf, "builtins.exec", marker)
    assert refused(capsys, sample.main, f"--init_from={hf}").startswith(f"error: {message}")
    assert not marker.exists()


def test_sample_eval_and_hellaswag_refuse_a_nanogpt_runs_meta_pkl_that_runs_code(tmp_path, capsys):
    """A nanoGPT ckpt.pt: its dataset's meta.pkl decodes it (sample.py), or says it is character-level (eval.py,
    hellaswag.py): each reads it first."""
    data, marker = tmp_path / "data", tmp_path / "PWNED"
    config = nanogpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
    nanogpt.save_ckpt(nanogpt.GPT(config), tmp_path / "ckpt.pt", config={"dataset": str(data)})
    ckpt = f"--init_from={tmp_path / 'ckpt.pt'}"
    _, message = write_meta(data, "subprocess.call", marker)
    for main, argv in ((sample.main, [ckpt]), (hellaswag.main, [ckpt, "--path", HELLASWAG]),
                       (lm_eval_py.main, [ckpt, "--tasks=hellaswag_local", f"--include_path={REPO}/eval_tasks"])):
        assert refused(capsys, main, *argv).startswith(f"error: {message}"), main
    _, message = write_meta(data, "itos multi-char", marker)
    assert refused(capsys, hellaswag.main, ckpt, "--path", HELLASWAG).startswith(f"error: {message}")
    assert not marker.exists()


def test_nanogpts_prepare_output_trains_and_samples_and_the_export_reads_without_pickle(tmp_path, capsys):
    # nanoGPT's data/shakespeare_char/prepare.py, run on a text of the 64 characters: train.bin, val.bin, meta.pkl
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(os.path.join(REPO, "data", "shakespeare_char", "prepare.py"), data)
    (data / "input.txt").write_text("".join(CHARS[i * 7 % 64] for i in range(20000)), encoding="utf-8")
    runpy.run_path(str(data / "prepare.py"))
    assert read_vocab(str(data / "meta.pkl")) == (64, CHARS)
    run(str(data), tmp_path / "out", "--max_iters=2")
    capsys.readouterr()
    argv = ["--start=0123", "--num_samples=1", "--max_new_tokens=4", "--seed=1"]
    assert sample.main([f"--out_dir={tmp_path / 'out'}", *argv]) == 0
    text = capsys.readouterr().out
    assert text.startswith("0123")

    # the export: meta.json (ours, read first) beside nanoGPT's meta.pkl, the same characters
    hf = tmp_path / "hf"
    assert export.main([f"--out_dir={tmp_path / 'out'}", f"--to={hf}"]) == 0
    assert json.loads((hf / "meta.json").read_text(encoding="utf-8")) == {"vocab_size": 64, "itos": CHARS}
    assert read_vocab(str(hf / "meta.pkl")) == (64, CHARS)
    capsys.readouterr()
    assert sample.main([f"--init_from={hf}", *argv]) == 0
    out = capsys.readouterr()
    assert out.out == text and f"Loading meta from {hf / 'meta.json'}" in out.err

    # beside the twin, meta.pkl is never opened: a payload there neither runs nor stops the sample
    marker = tmp_path / "PWNED"
    write_meta(hf, "os.system", marker)
    assert sample.main([f"--init_from={hf}", *argv]) == 0
    assert capsys.readouterr().out == text and not marker.exists()
    (hf / "meta.json").write_text(json.dumps({"vocab_size": 64, "itos": "".join(CHARS)}))
    err = refused(capsys, sample.main, f"--init_from={hf}", *argv)
    assert err == (f"error: {hf / 'meta.json'} is not a plain character vocabulary: itos is a str, not a list of "
                   'characters; export.py writes {"vocab_size": n, "itos": [n characters]}')
