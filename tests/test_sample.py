"""python -m pytest tests/test_sample.py -q

sample.py: HF directories and our own checkpoints (char-level, with meta.pkl), nanoGPT's output
format, seeds, --stream, FILE: prompts, and one-line errors for bad input."""

import os
import pickle
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import HELLASWAG_FIXTURE, TINY, tiny_config

import sample
from configurator import UsageError, configure, exit_on_bad_input
from dataio.tokenizer import get_encoding
from model import GPT
from parity.common import save_random_hf_model
from run.settings import DEFAULTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny GPT-2 with the BPE vocabulary, as save_pretrained writes it."""
    return str(
        save_random_hf_model(
            tmp_path_factory.mktemp("hf") / "tiny",
            seed=0,
            n_layer=2,
            n_head=2,
            n_embd=64,
            n_positions=64,
        )
    )


def samples(stdout):
    """nanoGPT's format: each sample followed by a line of dashes."""
    assert stdout.endswith(sample.SEPARATOR + "\n"), stdout[-200:]
    return stdout.split("\n" + sample.SEPARATOR + "\n")[:-1]


def run(capsys, *argv):
    assert sample.main(list(argv)) == 0
    return capsys.readouterr().out


def test_samples_from_an_hf_directory(hf_dir, capsys):
    argv = [
        f"--init_from={hf_dir}",
        "--num_samples=3",
        "--max_new_tokens=12",
        "--start=",
        "--seed=5",
    ]
    out = samples(run(capsys, *argv))
    # empty start: nanoGPT's "\n"
    assert len(out) == 3 and all(s.startswith("\n") and len(s) > 1 for s in out)
    assert len(set(out)) == 3  # three different samples, decoded together
    assert samples(run(capsys, *argv)) == out  # same seed, same text
    assert samples(run(capsys, *argv[:-1], "--seed=6")) != out


@pytest.mark.slow
def test_stream_prints_the_sample_as_it_comes(hf_dir, capsys, monkeypatch):
    generated = []
    generate = GPT.generate
    monkeypatch.setattr(
        GPT, "generate", lambda *a, **kw: generated.append(generate(*a, **kw)) or generated[-1]
    )
    streamed = run(
        capsys,
        f"--init_from={hf_dir}",
        "--num_samples=1",
        "--max_new_tokens=24",
        "--start=Once upon a time",
        "--top_p=0.9",
        "--top_k=None",
        "--temperature=1.2",
        "--stream",
    )
    # token by token, the text is what decoding all the tokens at once gives, characters split
    # across tokens included
    assert (
        streamed == get_encoding().decode(generated[0][0].tolist()) + "\n" + sample.SEPARATOR + "\n"
    )
    assert streamed.startswith("Once upon a time") and len(streamed) > len("Once upon a time") + 24


@pytest.mark.slow
def test_generate_gets_the_command_lines_settings(tmp_path, capsys, monkeypatch):
    """sys.argv's settings reach generate (top_p as well), a vocabulary padded past GPT-2's
    (50257 -> 50304) is sampled below 50257, and the time said is the generation's."""
    got = []
    generate = GPT.generate
    monkeypatch.setattr(GPT, "generate", lambda *a, **kw: got.append((a, kw)) or generate(*a, **kw))
    padded = save_random_hf_model(
        tmp_path / "padded", n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=50304
    )
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "sample.py",
            f"--init_from={padded}",
            "--num_samples=2",
            "--max_new_tokens=8",
            "--top_p=0.5",
        ],
    )
    assert sample.main() == 0
    out, err = capsys.readouterr()
    assert len(samples(out)) == 2
    (_, _, max_new_tokens, _, top_k, top_p), kw = got[-1]  # model, x, ...
    assert (max_new_tokens, top_k, top_p, kw["vocab_limit"]) == (8, 200, 0.5, 50257)
    assert float(err.split("16 tokens in ")[1].split("s")[0]) < 600  # not seconds since 1970
    # a meta.pkl with more characters than the model's ids: samples, nothing to limit
    small = save_random_hf_model(
        tmp_path / "small", n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=32
    )
    chars = [chr(ord("0") + i) for i in range(40)]
    with open(small / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 40, "itos": dict(enumerate(chars))}, f)
    out = samples(run(capsys, f"--init_from={small}", "--start=012", "--max_new_tokens=4"))
    assert got[-1][1]["vocab_limit"] is None and all(len(x) == 3 + 4 for x in out), out


CHARS = sorted(set("First Citizen:\nBefore we proceed any further, hear me speak.\n"))


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A directory as nanoGPT leaves it after training shakespeare_char: data/<dataset>/meta.pkl and
    a checkpoint in out_dir whose training config names the dataset."""
    from run import checkpoint

    root = tmp_path_factory.mktemp("run")
    (root / "data" / "toy").mkdir(parents=True)
    with open(root / "data" / "toy" / "meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": len(CHARS),
                "stoi": {c: i for i, c in enumerate(CHARS)},
                "itos": dict(enumerate(CHARS)),
            },
            f,
        )
    (root / "prompt.txt").write_text("First Citizen:\n")
    model = GPT(tiny_config(vocab_size=len(CHARS)), nnx.Rngs(0))
    mngr = checkpoint.manager(root / "out")
    checkpoint.save(
        mngr,
        10,
        nnx.state(model, nnx.Param),
        {"count": jax.numpy.zeros((), "int32")},
        checkpoint.meta_for(model.config, {"dataset": "toy"}, 10, 2.0, {}),
    )
    mngr.wait_until_finished()
    mngr.close()
    return root


@pytest.mark.slow
def test_resume_a_char_level_checkpoint(char_run, monkeypatch, capsys):
    monkeypatch.chdir(char_run)
    out = samples(
        run(
            capsys,
            "--init_from=resume",
            "--out_dir=out",
            "--start=FILE:prompt.txt",
            "--num_samples=2",
            "--max_new_tokens=30",
        )
    )
    assert len(out) == 2
    assert all(
        s.startswith("First Citizen:\n") and len(s) == 15 + 30 and set(s) <= set(CHARS) for s in out
    )
    with pytest.raises(ValueError, match="characters outside the vocabulary of .*meta.pkl: '!QZ'"):
        sample.main(["--out_dir=out", "--start=Zounds! Quiet"])


def test_corrupt_checkpoints_are_one_line_errors(char_run, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{not json")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\0" * 64)
    shutil.copytree(char_run / "out", tmp_path / "out")
    for path in (tmp_path / "out").glob("ckpt/10/params/**/d/*"):
        path.write_bytes(b"\0" * 16)
    for argv in (
        [f"--init_from={tmp_path / 'hf'}"],
        ["--init_from=resume", f"--out_dir={tmp_path / 'out'}"],
    ):
        with pytest.raises(ValueError) as e:
            sample.main(argv)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, error, message",
    [
        (["--init_from=gpt7"], ValueError, "gpt7"),
        (
            ["--init_from=scratch"],
            ValueError,
            r"^init_from='scratch' has no weights to load: use resume, a gpt2\* name, an "
            r"HF directory, a nanoGPT ckpt\.pt or a modded-nanogpt state_step\*\.pt$",
        ),
        (["--init_from=resume", "--out_dir=no/such/dir"], FileNotFoundError, "no/such/dir"),
        (["--max_new_tokens=0"], ValueError, "max_new_tokens must be >= 1"),
        (["--num_samples=0"], ValueError, "num_samples must be >= 1"),
        (["--top_k=0"], ValueError, "top_k must be a positive integer"),
        (["--top_p=0.0"], ValueError, r"top_p must be in \(0, 1\]"),
        (["--top_p=1.01"], ValueError, r"top_p must be in \(0, 1\]"),
        (["--temperature=-1.0"], ValueError, "temperature must be >= 0"),
        (["--stream"], ValueError, "num_samples=1"),
        (["--dtype=float16"], ValueError, "dtype must be 'auto', 'float32' or 'bfloat16'"),
        (["--start=FILE:no/such/prompt.txt"], FileNotFoundError, "no/such/prompt.txt"),
        (["--top_k=2.5"], ValueError, "top_k must be int"),
        (["--num_samples=None"], ValueError, "num_samples must be int .* got NoneType None"),
        (["--temperature=None"], ValueError, "temperature must be float .* got NoneType None"),
        (["--nonsense=1"], ValueError, "unknown config key 'nonsense'"),
    ],
)
def test_bad_input_is_a_one_line_error(argv, error, message):
    with pytest.raises(error, match=message) as e:
        sample.main(argv)
    assert "\n" not in str(e.value)


def test_a_start_file_that_is_not_text_is_one_line(tmp_path):
    (tmp_path / "prompt.bin").write_bytes(b"ROMEO\xff\xfe:")
    with pytest.raises(
        ValueError,
        match=r"^start file .*prompt.bin is not UTF-8 text \(byte 5\): give a text file$",
    ):
        sample.main([f"--start=FILE:{tmp_path / 'prompt.bin'}"])


def test_a_small_vocabulary_is_never_decoded_as_bpe(tmp_path, char_run, monkeypatch):
    path = save_random_hf_model(
        tmp_path / "hf", seed=1, n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=128
    )
    with pytest.raises(
        FileNotFoundError,
        match=r"the model's 128 token ids are not GPT-2's BPE, and no meta.pkl "
        r"holds their characters \(.*hf/meta.pkl\)",
    ):
        sample.main([f"--init_from={path}"])
    # a checkpoint saved before checkpoints carried their vocabulary, sampled from another directory
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FileNotFoundError,
        match=r"no meta.pkl holds their characters \(data/toy/meta.pkl, "
        r"toy/meta.pkl\): run from the directory it was trained in",
    ):
        sample.main([f"--out_dir={char_run / 'out'}"])


@pytest.mark.slow  # a second folder of the same run: make test-slow (CI runs it)
def test_a_char_level_run_samples_from_any_directory(tmp_path, monkeypatch, capsys):
    """The checkpoint carries its characters: sample.py needs no meta.pkl, and export.py puts one
    beside the export."""
    import export
    import hellaswag
    import train

    data = tmp_path / "data" / "chars"
    data.mkdir(parents=True)
    chars = [chr(ord("0") + i) for i in range(64)]
    (np.arange(3000) * 7 % 64).astype(np.uint16).tofile(data / "train.bin")
    (np.arange(300) * 5 % 64).astype(np.uint16).tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": 64,
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )
    monkeypatch.chdir(tmp_path)
    train.Trainer(
        configure(DEFAULTS, [*TINY, "--dataset=chars", "--out_dir=out", "--max_iters=2"])
    ).run()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    argv = [
        f"--out_dir={tmp_path / 'out'}",
        "--start=0123",
        "--num_samples=2",
        "--max_new_tokens=10",
    ]
    out = samples(run(capsys, *argv))
    assert all(s.startswith("0123") and len(s) == 14 and set(s) <= set(chars) for s in out), out
    assert export.main([f"--out_dir={tmp_path / 'out'}", "--to=hf"]) == 0
    capsys.readouterr()
    assert samples(run(capsys, "--init_from=hf", *argv[1:])) == out
    with pytest.raises(
        UsageError, match=r"out is a character-level model \(a vocabulary of 64 characters\)"
    ):
        hellaswag.main(
            ["--init_from=resume", f"--out_dir={tmp_path / 'out'}", "--path", HELLASWAG_FIXTURE]
        )


def test_command_line(char_run, hf_dir, capsys):
    """The script as a person runs it: samples on stdout, exit 0; bad input: one line on stderr,
    exit 2."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "sample.py"),
        "--init_from=resume",
        "--num_samples=2",
        "--max_new_tokens=8",
        "--start=Before",
    ]
    done = subprocess.run(cmd, cwd=char_run, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [s.startswith("Before") and len(s) == 6 + 8 for s in samples(done.stdout)] == [
        True,
        True,
    ]
    with pytest.raises(SystemExit) as e:  # what `python sample.py --top_p=2.0` does
        exit_on_bad_input(lambda: sample.main([f"--init_from={hf_dir}", "--top_p=2.0"]))
    assert e.value.code == 2
    assert (
        capsys.readouterr().err == "error: top_p must be in (0, 1] (1 keeps everything), got 2.0\n"
    )
