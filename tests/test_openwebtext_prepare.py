"""python -m pytest tests/test_openwebtext_prepare.py -q

data/openwebtext/prepare.py, nanoGPT's default dataset: on a sample of a few documents (--local, no
network) it makes nanoGPT's split and its train.bin / val.bin, which decode back to the documents
each followed by <|endoftext|>, and which train.py trains on; a write that fails leaves the files of
the run before and no temporary file; a bad --local, too few documents, datasets missing, the hub
offline or refusing its loading script: one line each, nothing written."""

import json
import os
import sys

import numpy as np
import pytest
from datasets import Dataset
from helpers import TINY, exit_line, prepare_script, train_cli

from dataio.tokenizer import EOT, get_encoding

# documents as the hub's rows hold them: several lines, unicode, a "<|endoftext|>" that is text;
# each longer than TINY's block of 16 tokens, so the one that becomes val.bin fills a window
DOCS = [
    "The first document.\nIt has two lines, and enough words to fill a block of sixteen tokens.",
    'The second one writes "<|endoftext|>" as text: encode_ordinary reads it as characters.',
    "Unicode too: café, naïve, Zürich, 東京, and an emoji 🙂, each as GPT-2's bytes encode them.",
] + [
    f"Paragraph {i}: " + "the quick brown fox jumps over the lazy dog. " * (i + 2) for i in range(7)
]


@pytest.fixture(scope="module")
def prepare():
    return prepare_script("openwebtext")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    path = tmp_path_factory.mktemp("owt") / "sample.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(prepare, sample):
    """The sample's train.bin and val.bin, and what the command printed."""
    out = sample.parent / "data"
    assert prepare.main([f"--local={sample}", f"--out_dir={out}", "--num_proc=1"]) == 0
    return out


def documents(path):
    """The documents of a .bin: its uint16 tokens cut after each <|endoftext|>, each decoded."""
    tokens = np.fromfile(path, dtype=np.uint16)
    assert tokens.size and tokens[-1] == EOT
    enc = get_encoding()
    pieces = np.split(tokens, np.flatnonzero(tokens == EOT) + 1)[:-1]
    docs = [enc.decode(p[:-1].tolist()) for p in pieces]
    # the whole file: the documents joined by <|endoftext|>, each one's tokens encode_ordinary's
    assert enc.decode(tokens.tolist()) == "".join(d + "<|endoftext|>" for d in docs)
    assert [t for d in docs for t in enc.encode_ordinary(d) + [EOT]] == tokens.tolist()
    return docs


def test_prepare_writes_nanogpts_split_of_the_documents(prepare, prepared, sample, tmp_path):
    assert sorted(os.listdir(prepared)) == ["train.bin", "val.bin"]
    train, val = documents(prepared / "train.bin"), documents(prepared / "val.bin")
    # nanoGPT's split: 0.05% to val (rounded up: one of ten documents), shuffled with seed 2357
    nanogpt = Dataset.from_dict({"text": DOCS}).train_test_split(
        test_size=0.0005, seed=2357, shuffle=True
    )
    assert (train, val) == (nanogpt["train"]["text"], nanogpt["test"]["text"])
    assert len(val) == 1 and sorted(train + val) == sorted(DOCS)

    # a folder of .txt files, one document each in name order: the same documents, the same bytes
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, d in enumerate(DOCS):
        (folder / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    out = tmp_path / "out"
    assert prepare.main([f"--local={folder}", f"--out_dir={out}", "--num_proc=1"]) == 0
    for name in ("train.bin", "val.bin"):
        assert (out / name).read_bytes() == (prepared / name).read_bytes()


def test_a_failed_write_leaves_the_files_before_it_and_no_part(
    prepare, prepared, sample, tmp_path, monkeypatch, capsys
):
    real = prepare.tqdm

    def disk_full_in(which, at):
        """tqdm over the writes, the disk full at batch `at` of the file `which`."""

        def bar(batches, desc, **kw):
            for i, batch in enumerate(real(batches, desc=desc, **kw)):
                if desc.endswith(which) and i == at:
                    raise OSError(28, "No space left on device")
                yield batch

        return bar

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(prepare, "tqdm", disk_full_in("train.bin", at=1))
    with pytest.raises(OSError, match="No space left"):
        prepare.main([f"--local={sample}", f"--out_dir={fresh}", "--num_proc=1"])
    assert os.listdir(fresh) == []
    # a whole train.bin written, val.bin's write fails: the old pair stays, the new train.bin goes
    old = tmp_path / "old"
    old.mkdir()
    for name in ("train.bin", "val.bin"):
        (old / name).write_bytes(b"\x01\x00" * 40)
    monkeypatch.setattr(prepare, "tqdm", disk_full_in("val.bin", at=0))
    with pytest.raises(OSError, match="No space left"):
        prepare.main([f"--local={sample}", f"--out_dir={old}", "--num_proc=1"])
    assert sorted(os.listdir(old)) == ["train.bin", "val.bin"]
    assert all((old / n).read_bytes() == b"\x01\x00" * 40 for n in ("train.bin", "val.bin"))
    assert "writing" in capsys.readouterr().err  # the bar ran


def test_bad_input_is_one_line_and_writes_nothing(prepare, sample, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    missing = tmp_path / "nope.jsonl"

    def main(*args):
        return lambda: prepare.main([f"--out_dir={out}", "--num_proc=1", *args])

    assert exit_line(main(f"--local={missing}"), capsys) == (
        2,
        f"error: --local {str(missing)!r} matches no files",
    )
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": DOCS[0]}) + "\n")
    assert exit_line(main(f"--local={one}"), capsys) == (
        2,
        "error: 1 document(s): the split needs 2 or more (1 goes to val)",
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    assert exit_line(main(f"--local={bad}"), capsys) == (
        2,
        f"error: {bad}:2: no string field 'text'",
    )
    assert exit_line(main(f"--local={sample}", "--num_proc=0"), capsys) == (
        2,
        "error: --num_proc=0: give at least 1",
    )
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "datasets", None)  # as if not installed
        m.setattr(sys, "argv", ["data/openwebtext/prepare.py"])
        assert exit_line(main(f"--local={sample}"), capsys) == (
            2,
            "error: prepare.py needs the data extras (no module named 'datasets'): "
            "pip install -c constraints.txt -e '.[data]'",
        )
    assert not out.exists()


def test_the_hub_route_loads_nanogpts_dataset_or_says_why_not(
    prepare, tmp_path, capsys, monkeypatch
):
    import datasets

    calls = []

    def hub(name, split, num_proc):
        calls.append((name, split, num_proc))
        return Dataset.from_dict({"text": DOCS})

    monkeypatch.setattr(datasets, "load_dataset", hub)
    out = tmp_path / "out"
    assert prepare.main([f"--out_dir={out}", "--num_proc=1"]) == 0
    assert calls == [("openwebtext", "train", 1)]
    assert sorted(documents(out / "train.bin") + documents(out / "val.bin")) == sorted(DOCS)

    def refusing(error):
        def load_dataset(*args, **kw):
            raise error

        return load_dataset

    out = tmp_path / "none"
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        refusing(ConnectionError("Couldn't reach 'openwebtext' on the Hub (OfflineModeIsEnabled)")),
    )
    assert exit_line(lambda: prepare.main([f"--out_dir={out}"]), capsys) == (
        2,
        "error: could not load 'openwebtext' from the HF hub (ConnectionError: Couldn't reach "
        "'openwebtext' on the Hub (OfflineModeIsEnabled)); offline? give --local files",
    )
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        refusing(RuntimeError("Dataset scripts are no longer supported, but found openwebtext.py")),
    )
    code, line = exit_line(lambda: prepare.main([f"--out_dir={out}"]), capsys)
    assert code == 2 and line.startswith("error: the HF hub's 'openwebtext' is a loading script")
    assert "--dataset" in line and "--local" in line
    assert not out.exists()


# make test-slow (CI runs it): the shards' format is checked above, and train.py trains on such
# shards throughout make test
@pytest.mark.slow
def test_train_trains_on_what_it_wrote(prepared, tmp_path):
    r = train_cli([*TINY, "--max_iters=2", f"--dataset={prepared}", f"--out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert any(line.startswith("step 2: train loss") for line in r.stdout.splitlines()), r.stdout
