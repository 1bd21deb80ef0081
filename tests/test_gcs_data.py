"""python -m pytest tests/test_gcs_data.py -q

--dataset=gs://bucket/folder, on the Cloud Storage emulator (tools/gcs_emulator.py): each token-file
format the loaders read (nanoGPT's train.bin/val.bin, llm.c .bin shards, .npy shards) gives over
gs:// the batches of the same files on local disk (next, eval_batches, a resumed position), by
ranged reads; a missing shard, a bad header or a file changed under the run is the local error's one
line, naming the URL; and train.py on gs:// logs the losses of the same run on the local copy."""

import errno
import pickle

import numpy as np
import pytest
from helpers import TINY, read_log, run, train_cli

from configurator import InputNotFound, RunStopped, UsageError
from dataio import storage, token_files
from dataio.dataloader import (
    BinLoader,
    BinShardLoader,
    ShardLoader,
    data_dir_for,
    data_meta,
    make_loader,
)
from dataio.prefetch import Prefetcher
from parity.check_speedrun import write_datafile

FIX = "the run stopped; restore the file and resume with --init_from=resume"
T, ROWS = 8, 6  # sequence length; global rows (a process's: ROWS_SLICE)
ROWS_SLICE = slice(2, 5)  # the rows one process of several reads


def write_raw(folder):
    rng = np.random.default_rng(0)
    rng.integers(0, 2**16, 3000, dtype=np.uint16).tofile(folder / "train.bin")  # every byte matters
    rng.integers(0, 2**16, 600, dtype=np.uint16).tofile(folder / "val.bin")
    chars = [chr(48 + i) for i in range(64)]
    # as nanoGPT's data/shakespeare_char/prepare.py writes it
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": 64,
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )


def write_llmc(folder):
    """The record's names (val from 000000, train from 000001); shard ends and a dropped tail within
    a few steps."""
    rng = np.random.default_rng(1)
    for split, sizes in (("train", [126, 60, 220]), ("val", [126, 60])):
        for i, n in enumerate(sizes):
            write_datafile(
                folder / f"fineweb_{split}_{i + (split == 'train'):06d}.bin",
                rng.integers(0, 2**16, n, dtype=np.uint16),
            )


def write_npy(folder):
    """Shards of formats 1.0 and 2.0, read across their ends and the epoch's."""
    rng = np.random.default_rng(2)
    for name, n, version in [
        ("train_000001", 100, (1, 0)),
        ("train_000002", 70, (2, 0)),
        ("train_000003", 130, (1, 0)),
        ("val_000000", 120, (1, 0)),
    ]:
        with open(folder / f"edufineweb_{name}.npy", "wb") as f:
            np.lib.format.write_array(
                f, rng.integers(0, 2**16, n, dtype=np.uint16), version=version
            )


FORMATS = {
    "raw": (write_raw, BinLoader),
    "llmc": (write_llmc, BinShardLoader),
    "npy": (write_npy, ShardLoader),
}


@pytest.fixture
def data(request, tmp_path, gcs_dir):
    """(local folder, the same files on gs://) of the format named by the test's parameter."""
    # the name that makes "python fineweb.py" the hint, local and remote
    local = tmp_path / "edu_fineweb10B"
    local.mkdir()
    FORMATS[request.param][0](local)
    url = f"{gcs_dir}/edu_fineweb10B"
    storage.upload(str(local), url)
    return str(local), url


def loaders(local, url, split="train", **kw):
    return [make_loader(d, split, T, ROWS, seed=3, **kw) for d in (local, url)]


def assert_same(a, b):
    for u, v in zip(a, b, strict=True):
        assert u.dtype == v.dtype == np.int32
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("data", FORMATS, indirect=True)
def test_gs_gives_the_local_batches(data, request):
    local, url = data
    kind = FORMATS[request.node.callspec.params["data"]][1]
    for row_slice in (None, ROWS_SLICE):
        mine, theirs = loaders(local, url, row_slice=row_slice)
        assert type(mine) is type(theirs) is kind
        for accum in (1, 3, 2, 1, 3):  # past the shards' ends and the wrap-around
            assert_same(mine.next(accum), theirs.next(accum))
        assert mine.state_dict() == theirs.state_dict()
        for _ in range(2):  # the same every time, and no move of the position
            assert_same(
                np.stack([x for x, _ in mine.eval_batches(3, tag=40)]),
                np.stack([x for x, _ in theirs.eval_batches(3, tag=40)]),
            )
        state, want = mine.state_dict(), [mine.next(2) for _ in range(3)]
        resumed = make_loader(url, "train", T, ROWS, seed=3, row_slice=row_slice)
        resumed.load_state_dict(state)
        for w in want:
            assert_same(resumed.next(2), w)
    val_mine, val_theirs = loaders(local, url, "val")
    assert_same(val_mine.next(2), val_theirs.next(2))
    assert data_meta(url) == data_meta(local) and data_dir_for(url) == url


@pytest.mark.parametrize("data", FORMATS, indirect=True)
def test_a_batch_is_ranged_reads_of_its_own_bytes(data, request, monkeypatch):
    """No shard is downloaded: each next() is one call of concurrent ranged reads (two where it
    crosses a shard end), of the bytes it needs (the shards' loaders) or of its random windows (a
    train.bin over WHOLE_BELOW). A small train.bin is read whole once, at open: its batches make no
    request."""
    local, url = data
    raw = request.node.callspec.params["data"] == "raw"
    if raw:
        held = make_loader(url, "train", T, ROWS, seed=3)
        monkeypatch.setattr(token_files, "WHOLE_BELOW", 0)
    loader = make_loader(url, "train", T, ROWS, seed=3)
    calls, read_ranges = [], storage.read_ranges
    monkeypatch.setattr(
        storage,
        "read_ranges",
        lambda paths, starts, ends: (
            calls.append(sum(e - s for s, e in zip(starts, ends)))
            or read_ranges(paths, starts, ends)
        ),
    )
    if raw:
        np.testing.assert_array_equal(held.next(1), loader.next(1))
        assert len(calls) == 1  # the ranged loader's; the held one made none
    else:
        loader.next(1)
        assert calls == [(ROWS * T + 1) * 2]


def test_isdir_and_isfile_on_gs_say_what_is_there_and_a_store_that_cannot_answer_is_one_line(
    gcs_dir, monkeypatch
):
    """A checkpoint's folder on gs:// that cannot be listed (the network gone) is not 'no folder
    there': fsspec's own isdir and isfile answer False to any OSError."""
    storage.write_bytes(f"{gcs_dir}/ckpt/50/meta", b"{}")
    assert storage.isdir(f"{gcs_dir}/ckpt/50") and storage.isfile(f"{gcs_dir}/ckpt/50/meta")
    assert not storage.isdir(f"{gcs_dir}/ckpt/50/meta") and not storage.isfile(f"{gcs_dir}/ckpt/50")
    assert not storage.isdir(f"{gcs_dir}/ckpt/100") and not storage.isfile(f"{gcs_dir}/ckpt/100")
    fs, _ = storage.filesystem(gcs_dir)

    def unreachable(*args, **kwargs):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed ('127.0.0.1', 1)")

    monkeypatch.setattr(fs, "info", unreachable)
    for ask in (storage.isdir, storage.isfile):
        with pytest.raises(
            RunStopped, match="cannot reach gs://nanogpt-test .*: check the network and retry$"
        ):
            ask(f"{gcs_dir}/ckpt/50")


def test_a_refused_connection_is_the_network_whatever_its_port_and_a_403_is_permission():
    # "403" in it
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Cannot connect to host 127.0.0.1:54031")
    assert isinstance(storage.failure_line("gs://b/run", refused), RunStopped)
    for denied in (
        OSError("GET https://storage.googleapis.com/b: 403 Forbidden"),
        PermissionError("no access"),
    ):
        assert isinstance(storage.failure_line("gs://b/run", denied), UsageError)
    assert storage.failure_line("gs://b/run", FileNotFoundError("b/run/x 4031 bytes")) is None


def test_a_missing_shard_on_gs_is_the_local_line_naming_the_url(gcs_dir, tmp_path):
    for write, shard in (
        (write_npy, "edufineweb_train_000002.npy"),
        (write_llmc, "fineweb_train_000002.bin"),
    ):
        local, url = tmp_path / shard[-3:], f"{gcs_dir}/{shard[-3:]}"
        local.mkdir()
        write(local)
        storage.upload(str(local), url)
        loader = make_loader(url, "train", T, ROWS, seed=3)
        # after the run listed the shards; the third batch reaches it
        storage.remove(f"{url}/{shard}")
        ahead = Prefetcher(loader, accum=1, put=np.copy)
        for _ in range(2):
            ahead.next()
        with pytest.raises(RunStopped) as stop:
            ahead.next()
        assert (
            str(stop.value)
            == f"{url}/{shard} is gone (deleted after the run listed the shards): {FIX}"
        )
    missing = f"{gcs_dir}/edu_fineweb10B"
    assert data_dir_for(missing) == missing and data_meta(missing) == (0, "gpt2")
    with pytest.raises(InputNotFound) as nothing:
        make_loader(missing, "train", T, ROWS, seed=0)
    assert str(nothing.value) == (
        f"no train.bin or train shards (*_train_*.bin, *train*.npy) in {missing}: write "
        "them with `python fineweb.py`, then copy them there (gcloud storage cp)"
    )
    with pytest.raises(UsageError) as bad:
        data_dir_for("gs://no-such-bucket/edu_fineweb10B")
    assert str(bad.value) == (
        "dataset gs://no-such-bucket/edu_fineweb10B: the bucket gs://no-such-bucket does not "
        "exist: create it (gcloud storage buckets create gs://no-such-bucket) or check the name"
    )
    with pytest.raises(
        InputNotFound, match="^no val.bin or val shards .* in gs://no-such-bucket/data: write"
    ):
        # asked directly: nothing there either
        make_loader("gs://no-such-bucket/data", "val", T, ROWS, seed=0)


@pytest.mark.parametrize(
    "fault", [dict(magic=20240521), dict(version=2), dict(count=130), dict(size=600)]
)
def test_a_bad_llmc_header_on_gs_is_the_local_line_naming_the_url(fault, gcs_dir, tmp_path):
    write_llmc(tmp_path)
    path = tmp_path / "fineweb_train_000001.bin"
    size = fault.pop("size", None)
    write_datafile(path, np.arange(126), **fault)
    if size is not None:
        with open(path, "r+b") as f:
            f.truncate(size)
    storage.upload(str(tmp_path), gcs_dir)
    errors = []
    for where in (str(tmp_path), gcs_dir):
        with pytest.raises(UsageError) as bad:
            make_loader(where, "train", T, ROWS, seed=0)
        errors.append(str(bad.value))
    assert errors[1] == errors[0].replace(str(tmp_path), gcs_dir)
    assert errors[1].startswith(f"{gcs_dir}/fineweb_train_000001.bin ") and "\n" not in errors[1]


@pytest.mark.parametrize("fault", ["truncated", "not npy", "2-D"])
def test_a_bad_npy_shard_on_gs_is_the_local_line_naming_the_url(fault, gcs_dir, tmp_path):
    write_npy(tmp_path)
    path = tmp_path / "edufineweb_train_000001.npy"
    if fault == "truncated":
        path.write_bytes(path.read_bytes()[: 128 + 70])
    elif fault == "not npy":
        path.write_bytes(b"tokens, not a .npy")
    else:
        np.save(path, np.zeros((2, 50), np.uint16))
    storage.upload(str(tmp_path), gcs_dir)
    errors = []
    for where in (str(tmp_path), gcs_dir):
        with pytest.raises(RunStopped) as stop:
            make_loader(where, "train", T, ROWS, seed=0).next(1)
        errors.append(str(stop.value))
    assert errors[1] == errors[0].replace(str(tmp_path), gcs_dir)
    assert errors[1].startswith(f"{gcs_dir}/edufineweb_train_000001.npy ")


def test_a_file_changed_on_gs_under_the_run_stops_it_in_one_line(gcs_dir, tmp_path, monkeypatch):
    """Read by ranges (a train.bin over WHOLE_BELOW, any shard): a change stops the run. A small
    train.bin, held whole, keeps giving the data the run started with."""
    write_raw(tmp_path)
    storage.upload(str(tmp_path), f"{gcs_dir}/held")
    held, same = (
        make_loader(d, "train", T, ROWS, seed=0) for d in (f"{gcs_dir}/held", str(tmp_path))
    )
    held.next(1), same.next(1)
    storage.write_bytes(f"{gcs_dir}/held/train.bin", (tmp_path / "train.bin").read_bytes()[::-1])
    for a, b in zip(held.next(1), same.next(1)):  # no request, the data it started with
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(token_files, "WHOLE_BELOW", 0)
    train_bin, tokens = f"{gcs_dir}/raw/train.bin", (tmp_path / "train.bin").read_bytes()
    changes = [
        (tokens[:200], "changed while the run read it (now 100 tokens, was 3000)"),
        (tokens[::-1], "changed while the run read it (rewritten in place)"),
        (None, "is gone (deleted while the run read it)"),
    ]
    for change, what in changes:
        storage.write_bytes(train_bin, tokens)
        loader = make_loader(f"{gcs_dir}/raw", "train", T, ROWS, seed=0)
        loader.next(1)
        storage.remove(train_bin) if change is None else storage.write_bytes(train_bin, change)
        with pytest.raises(RunStopped) as stop:
            loader.next(1)
        assert str(stop.value) == f"{train_bin} {what}: {FIX}"
    shards = tmp_path / "llmc"
    shards.mkdir()
    write_llmc(shards)
    storage.upload(str(shards), f"{gcs_dir}/llmc")
    loader = make_loader(f"{gcs_dir}/llmc", "train", T, ROWS, seed=0)
    loader.next(1)
    second = f"{gcs_dir}/llmc/fineweb_train_000002.bin"
    write_datafile(shards / "new.bin", np.arange(59))  # one token shorter, well formed
    storage.write_bytes(second, (shards / "new.bin").read_bytes())
    with pytest.raises(RunStopped) as stop:
        loader.next(2)  # the first batch still in shard 1, the second in shard 2
    assert (
        str(stop.value)
        == f"{second} changed since the run listed the shards (now 59 tokens, was 60): {FIX}"
    )


@pytest.mark.slow
def test_train_py_on_gs_logs_the_losses_of_the_local_run(dataset, gcs_dir, tmp_path):
    storage.upload(dataset, gcs_dir)
    run(dataset, tmp_path / "local")
    r = train_cli([*TINY, f"--dataset={gcs_dir}", f"--out_dir={tmp_path / 'gs'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"found vocab_size = 64 (inside {gcs_dir}/meta.pkl)" in r.stdout
    for key in ("loss", "val_loss"):
        assert read_log(tmp_path / "gs", key) == read_log(tmp_path / "local", key) != []
