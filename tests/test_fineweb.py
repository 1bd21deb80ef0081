"""python -m pytest tests/test_fineweb.py -q

fineweb.py on a few hundred local documents and tiny shards: layout, EOTs, resume, process count,
input formats.
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fineweb
from dataio.tokenizer import EOT, get_encoding

SHARD = 1000  # tokens per shard: ~13 shards from the fixture, one document spanning three


def make_docs(n=300, seed=0):
    """Prose-like documents of varied length, plus the awkward ones: empty, unicode, a literal
    '<|endoftext|>' (must stay ordinary text), and one longer than two shards."""
    rng = np.random.default_rng(seed)
    words = "the of and to a in that is was he for it with as his on be at by I had not are".split()
    words += [
        "FineWeb",
        "education",
        "tokens",
        "Ünïcödé",
        "日本語",
        "emoji🙂",
        "1234",
        "x=y+z;",
        "\n",
        "\n\n",
    ]
    docs = [" ".join(rng.choice(words, size=rng.integers(1, 60))) for _ in range(n)]
    docs[3] = ""
    docs[7] = "a literal <|endoftext|> in the text is not the separator"
    docs[100] = " ".join(rng.choice(words, size=3000))  # spans shards
    return docs


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": "x"}) + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs()
    write_jsonl(root / "part_0.jsonl", docs[:150])  # two files: sorted order is document order
    write_jsonl(root / "part_1.jsonl", docs[150:])
    enc = get_encoding()
    expected = np.concatenate([np.array([EOT] + enc.encode_ordinary(d), np.uint16) for d in docs])
    return str(root / "*.jsonl"), docs, expected


def run(pattern, out_dir, *extra):
    """fineweb.py on the files matching pattern (or, with pattern "", the source that extra
    names)."""
    local = ["--local", pattern] if pattern else []
    assert (
        fineweb.main([*local, "--out_dir", str(out_dir), "--shard_size", str(SHARD), *extra]) == 0
    )


def shard_files(out_dir):
    """In shard order ("val" sorts after "train", as in build-nanogpt; loaders sort within a
    split)."""
    return sorted(glob.glob(os.path.join(out_dir, "*.npy")), key=lambda f: f[-10:])


def read_bytes(out_dir):
    return {os.path.basename(f): open(f, "rb").read() for f in shard_files(out_dir)}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The whole corpus in one uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("reference")
    run(corpus[0], out, "--num_proc", "1")
    return out


def test_layout_eot_and_token_count(corpus, reference):
    _, docs, expected = corpus
    files = shard_files(reference)
    n_shards = -(-len(expected) // SHARD)
    assert [os.path.basename(f) for f in files] == ["edufineweb_val_000000.npy"] + [
        f"edufineweb_train_{i:06d}.npy" for i in range(1, n_shards)
    ]
    shards = [np.load(f) for f in files]
    assert all(s.dtype == np.uint16 for s in shards)
    assert [len(s) for s in shards] == [SHARD] * (n_shards - 1) + [
        len(expected) - SHARD * (n_shards - 1)
    ]
    tokens = np.concatenate(shards)
    enc = get_encoding()
    assert len(tokens) == sum(len(enc.encode_ordinary(d)) + 1 for d in docs)
    np.testing.assert_array_equal(tokens, expected)
    # one EOT per document, at its start: the literal "<|endoftext|>" in docs[7] is not one
    starts = np.cumsum([0] + [len(enc.encode_ordinary(d)) + 1 for d in docs[:-1]])
    np.testing.assert_array_equal(np.flatnonzero(tokens == EOT), starts)
    # the fixture really has a document spanning shards
    assert len(enc.encode_ordinary(docs[100])) > 2 * SHARD
    with open(os.path.join(reference, fineweb.PROGRESS)) as f:
        assert json.load(f)["done"] is True


def test_resume_is_byte_identical(corpus, reference, tmp_path):
    pattern = corpus[0]
    want = read_bytes(reference)
    # stopped after 4 shards, then continued
    run(pattern, tmp_path, "--num_proc", "1", "--max_shards", "4")
    assert len(shard_files(tmp_path)) == 4
    run(pattern, tmp_path, "--num_proc", "1")
    assert read_bytes(tmp_path) == want
    # killed mid-write: the last two shards gone, a half-written temp file left behind
    for f in shard_files(tmp_path)[-2:]:
        os.remove(f)
    stray = tmp_path / (fineweb.TMP_PREFIX + fineweb.shard_name(len(want) - 2))
    stray.write_bytes(b"half a shard")
    run(pattern, tmp_path, "--num_proc", "1")
    assert read_bytes(tmp_path) == want
    assert not stray.exists()
    # a finished run is left alone
    mtimes = [os.stat(f).st_mtime_ns for f in shard_files(tmp_path)]
    run(pattern, tmp_path, "--num_proc", "1")
    assert [os.stat(f).st_mtime_ns for f in shard_files(tmp_path)] == mtimes


def test_processes_do_not_change_the_bytes(corpus, reference, tmp_path):
    """2 workers, stopped and resumed in the middle of the document that spans shards."""
    enc = get_encoding()
    start = sum(len(enc.encode_ordinary(d)) + 1 for d in corpus[1][:100])  # where docs[100] begins
    k = start // SHARD + 1  # the first shard that ends inside docs[100]
    run(corpus[0], tmp_path, "--num_proc", "2", "--max_shards", str(k))
    assert len(shard_files(tmp_path)) == k
    with open(tmp_path / fineweb.PROGRESS) as f:
        assert json.load(f)["shards"][-1]["end"] == [100, k * SHARD - start]
    run(corpus[0], tmp_path, "--num_proc", "2")
    assert read_bytes(tmp_path) == read_bytes(reference)


def test_input_formats_agree(corpus, reference, tmp_path):
    """The same documents as parquet, and as one .txt file each, give the same shards as jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = corpus[1]
    pq.write_table(
        pa.table({"id": list(range(len(docs))), "text": docs}),
        tmp_path / "docs.parquet",
        row_group_size=64,
    )
    run(str(tmp_path / "*.parquet"), tmp_path / "from_parquet", "--num_proc", "1")
    assert read_bytes(tmp_path / "from_parquet") == read_bytes(reference)
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"doc_{i:04d}.txt").write_text(d, encoding="utf-8")
    run(str(tmp_path / "txt" / "*.txt"), tmp_path / "from_txt", "--num_proc", "1")
    assert read_bytes(tmp_path / "from_txt") == read_bytes(reference)


def test_hub_code_path_offline(corpus, reference, tmp_path, monkeypatch):
    """The datasets route (load_dataset, batched iteration, skip on resume) on a local folder laid
    out like a hub dataset, streamed: the same shards as --local."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    docs = corpus[1]
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for i, part in enumerate((docs[:170], docs[170:])):
        pq.write_table(
            pa.table({"text": part}), tmp_path / "hub" / "data" / f"train-{i:05d}-of-00002.parquet"
        )
    hub = [
        "--dataset",
        str(tmp_path / "hub"),
        "--name",
        "default",
        "--streaming",
        "--num_proc",
        "1",
    ]
    # stop in the second file, so the resume skips across files
    with open(reference / fineweb.PROGRESS) as f:
        k = 1 + next(i for i, s in enumerate(json.load(f)["shards"]) if s["end"][0] > 170)
    run("", tmp_path / "out", *hub, "--max_shards", str(k))
    assert len(shard_files(tmp_path / "out")) == k
    run("", tmp_path / "out", *hub)
    assert read_bytes(tmp_path / "out") == read_bytes(reference)


def test_rerun_with_other_options_is_refused(corpus, reference, tmp_path):
    with pytest.raises(ValueError, match="another input or shard size"):
        fineweb.main(
            ["--local", corpus[0], "--out_dir", str(reference), "--shard_size", str(SHARD + 1)]
        )
    # shards of unknown origin
    np.save(tmp_path / "edufineweb_val_000000.npy", np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="no progress.json"):
        run(corpus[0], tmp_path)


def test_bad_jsonl_line_is_reported_and_a_retry_with_good_input_runs(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no string field 'text'"):
        run(str(tmp_path / "*.jsonl"), tmp_path / "out", "--num_proc", "2")
    (tmp_path / "good.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n')
    # the same out_dir: the bad try left nothing to resume
    run(str(tmp_path / "good.jsonl"), tmp_path / "out")
    assert len(shard_files(tmp_path / "out")) == 1


def test_uint16_check():
    assert fineweb.to_uint16([0, EOT, 65535]).dtype == np.uint16
    with pytest.raises(ValueError, match="65536 does not fit uint16"):
        fineweb.to_uint16([EOT, 65536])


@pytest.mark.parametrize("pattern", ["/nonexistent/dir/*.jsonl", "*.csv-that-is-not-there"])
def test_bad_glob_cli(pattern, tmp_path):
    r = subprocess.run(
        [sys.executable, "fineweb.py", "--local", pattern, "--out_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: --local {pattern!r} matches no files"]
    assert not os.listdir(tmp_path)


def test_unsupported_extension(tmp_path):
    (tmp_path / "docs.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"docs.csv is not .jsonl, .parquet or .txt"):
        run(str(tmp_path / "*"), tmp_path / "out")
