"""python -m pytest tests/test_dataloader_pread.py -q

The loaders read their files with pread, without a memory map: the same tokens as the
memory-mapped (and np.load'ed) reference, bit for bit; a .bin of odd size, empty or too short for
one window is one line; a file dropped holds no descriptor; and a data file that changes under a run
(truncated, rewritten in place, a shard deleted or broken, train.bin cut under train.py) stops it
with one line, where a mapped file killed it with SIGBUS; a file deleted or renamed over after it
was opened keeps giving the data the run started with (the loaders' batches: test_dataloader.py)."""

import gc
import os
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, TINY, run, snapshot

from configurator import RunStopped, UsageError
from dataio.dataloader import BinLoader, ShardLoader
from dataio.prefetch import Prefetcher
from dataio.token_files import token_file
from run import checkpoint

FIX = "the run stopped; restore the file and resume with --init_from=resume"
NPY_HEADER = 128  # bytes before the tokens of a 1-D array np.save writes (format 1.0)


def memmap_batch(path, seed, key, accum, rows, block_size):
    """BinLoader.batch as it was on np.memmap: the reference, bit for bit."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    starts = np.random.default_rng([seed, *key]).integers(
        0, len(data) - block_size - 1, (accum, rows)
    )
    # (accum, rows, T+1)
    tokens = data[starts[..., None] + np.arange(block_size + 1)].astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


def test_bin_batches_equal_the_memory_mapped_reference(tmp_path):
    path = str(tmp_path / "train.bin")
    # every byte matters
    np.random.default_rng(0).integers(0, 2**16, 5000, dtype=np.uint16).tofile(path)
    loader = BinLoader(path, block_size=16, rows=6, seed=7, row_slice=slice(2, 4))
    for step in range(5):
        x, y = loader.next(3)
        want_x, want_y = memmap_batch(path, 7, (0, step), 3, 6, 16)
        assert x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x, want_x[:, 2:4])
        np.testing.assert_array_equal(y, want_y[:, 2:4])
    for k, (x, y) in enumerate(loader.eval_batches(2, tag=40)):
        want_x, want_y = memmap_batch(path, 7, (1, 40, k), 1, 6, 16)
        np.testing.assert_array_equal(x, want_x[0, 2:4])
        np.testing.assert_array_equal(y, want_y[0, 2:4])
    assert loader.state_dict() == {"step": 5}


def test_shard_batches_equal_the_loaded_reference(tmp_path):
    """Random tokens in shards of formats 1.0 and 2.0, read across their ends and the epoch's."""
    rng, paths = np.random.default_rng(0), []
    for i, (n, version) in enumerate([(100, (1, 0)), (70, (2, 0)), (130, (1, 0))]):
        paths.append(str(tmp_path / f"shard_train_{i}.npy"))
        with open(paths[-1], "wb") as f:
            np.lib.format.write_array(
                f, rng.integers(0, 2**16, n, dtype=np.uint16), version=version
            )
    stream = np.concatenate([np.load(p) for p in paths]).astype(np.int32)  # 300 tokens
    loader = ShardLoader(paths, block_size=10, rows=4, seed=0)
    for step in range(6):  # 80 tokens a step: 480, past the epoch's end
        x, y = loader.next(2)
        at = step * 80 + np.arange(81)
        np.testing.assert_array_equal(x.reshape(-1), stream[at[:-1] % 300])
        np.testing.assert_array_equal(y.reshape(-1), stream[at[1:] % 300])
    # 480 = 300 + 100 + 70 + 10
    assert loader.state_dict() == {"epoch": 1, "shard": 2, "offset": 10}


def test_bin_of_odd_size_is_a_usage_error(tmp_path):
    (tmp_path / "train.bin").write_bytes(bytes(2001))
    with pytest.raises(
        UsageError, match=r"train.bin holds 2001 bytes, not whole uint16 tokens: rerun `python"
    ):
        BinLoader(str(tmp_path / "train.bin"), block_size=8, rows=2, seed=0)


def test_a_bin_empty_or_too_short_for_one_window_is_one_line(tmp_path):
    path = tmp_path / "train.bin"
    # 9 = T + 1
    for n, what in (
        (0, "is empty: rerun `python"),
        (9, "holds 9 tokens: too few for block_size 8"),
    ):
        np.arange(n, dtype=np.uint16).tofile(path)
        with pytest.raises(UsageError) as bad:
            BinLoader(str(path), block_size=8, rows=2, seed=0)
        assert str(bad.value).startswith(f"{path} {what}")
    np.arange(10, dtype=np.uint16).tofile(path)  # T + 2 tokens: one window, from token 0
    np.testing.assert_array_equal(
        BinLoader(str(path), 8, rows=2, seed=0).next(1)[1], [[np.arange(1, 9)] * 2]
    )


def test_a_token_file_closes_its_descriptor_when_dropped(bin_file):
    """A long run opens each shard again every epoch: the files it is done with hold no
    descriptor."""
    before = len(os.listdir("/dev/fd"))
    for _ in range(20):
        token_file(bin_file).read([0], 4)
    gc.collect()
    # not one per file (other threads may hold a few meanwhile)
    assert len(os.listdir("/dev/fd")) < before + 10


TRUNCATE_BETWEEN_BATCHES = """if True:
    import os, sys
    from configurator import exit_on_bad_input
    from dataio.dataloader import make_loader
    data_dir, truncated, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def main():
        loader = make_loader(data_dir, "train", block_size=10, rows=3, seed=0)
        loader.next(1)
        os.truncate(truncated, size)
        loader.next(1)
    exit_on_bad_input(main)
"""


@pytest.mark.parametrize("kind", ["bin", "npy"])
def test_a_file_truncated_between_batches_stops_the_next_in_one_line(kind, request):
    """In a python of its own: a memory-mapped file that shrinks kills the process (SIGBUS), pytest
    with it."""
    if kind == "bin":
        truncated = request.getfixturevalue("bin_file")
        data_dir, size, what = os.path.dirname(truncated), 100, "now 50 tokens, was 5000"
    else:
        tmp, paths = request.getfixturevalue("shards")
        data_dir, truncated, size, what = (
            str(tmp),
            paths[0],
            NPY_HEADER + 40,
            "now 20 tokens, was 100",
        )
    r = subprocess.run(
        [sys.executable, "-c", TRUNCATE_BETWEEN_BATCHES, data_dir, truncated, str(size)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip() == f"error: {truncated} changed while the run read it ({what}): {FIX}"


def test_a_read_that_comes_back_short_stops_the_run(bin_file):
    """The file shrinks after the batch's check, before its reads."""
    loader = BinLoader(bin_file, block_size=8, rows=4, seed=0)
    check = loader.file.check

    def check_then_truncate():
        check()
        os.truncate(bin_file, 20)

    loader.file.check = check_then_truncate
    with pytest.raises(
        RunStopped, match=r"train.bin changed while the run read it \(now 10 tokens, was 5000\)"
    ):
        loader.next(1)


def test_a_file_rewritten_in_place_stops_the_run(bin_file):
    loader = BinLoader(bin_file, block_size=8, rows=4, seed=0)
    loader.next(1)
    np.arange(5000, dtype=np.uint16)[::-1].tofile(bin_file)  # the same size
    mtime = os.stat(bin_file).st_mtime_ns
    os.utime(bin_file, ns=(mtime, mtime + 10**9))  # a new mtime even where the clock is coarse
    with pytest.raises(
        RunStopped, match=f"train.bin changed while the run read it \\(rewritten in place\\): {FIX}"
    ):
        loader.next(1)


def test_a_file_deleted_or_replaced_after_opening_keeps_the_data_it_had(bin_file, shards):
    bins = [BinLoader(bin_file, block_size=8, rows=4, seed=0) for _ in range(2)]
    want = [bins[1].next(2)[0] for _ in range(3)]
    os.remove(bin_file)
    for w in want:
        np.testing.assert_array_equal(bins[0].next(2)[0], w)
    _, paths = shards
    loader = ShardLoader(paths, block_size=10, rows=3, seed=0)
    loader.next(1)  # opens the first shard
    np.save(paths[0] + ".new.npy", np.zeros(100, np.uint16))
    # a new file by rename: the loader reads the old one
    os.replace(paths[0] + ".new.npy", paths[0])
    np.testing.assert_array_equal(loader.next(1)[0].reshape(-1), np.arange(30, 60))


def test_a_shard_deleted_before_the_loader_reaches_it_stops_the_prefetcher_in_one_error(
    shards, capfd
):
    _, paths = shards
    # 30 tokens a step: the 4th reaches shard 2
    loader = ShardLoader(paths, block_size=10, rows=3, seed=0)
    os.remove(paths[1])
    ahead = Prefetcher(loader, accum=1, put=np.copy)
    for _ in range(3):
        ahead.next()
    with pytest.raises(RunStopped) as stop:
        ahead.next()
    assert str(stop.value) == f"{paths[1]} is gone (deleted after the run listed the shards): {FIX}"
    assert not ahead._thread.is_alive()
    assert capfd.readouterr().err == ""  # no traceback from the thread


def test_a_broken_shard_stops_the_run_when_the_loader_reaches_it(shards):
    _, paths = shards
    shard = paths[0]
    faults = [
        (
            lambda: os.truncate(shard, NPY_HEADER + 70),
            "is truncated (it holds 35 of the 100 tokens its header declares)",
        ),
        (
            lambda: os.truncate(shard, 5),
            "has a bad .npy header (EOF: reading magic string, expected 8 bytes got 5)",
        ),
        (
            lambda: pathlib.Path(shard).write_bytes(b"tokens, not a .npy"),
            "has a bad .npy header (the magic string is not correct; expected b'\\x93NUMPY', got "
            "b'tokens')",
        ),
        (
            lambda: np.save(shard, np.zeros((2, 50), np.uint16)),
            "holds a uint16 array of shape (2, 50), not 1-D token ids",
        ),
    ]
    for fault, what in faults:
        fault()
        with pytest.raises(RunStopped) as stop:
            ShardLoader(paths, block_size=10, rows=3, seed=0).next(1)
        assert str(stop.value) == f"{shard} {what}: {FIX}"


@pytest.mark.slow
def test_train_py_stops_in_one_line_when_train_bin_is_truncated_mid_run(tmp_path):
    """Resumed from a checkpoint, the run loses train.bin's tail while it runs: one line, exit 1 (it
    was SIGBUS, exit -7, no word), and the checkpoint it resumed from as it was."""
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()  # data of its own to truncate: test_train's dataset is other tests' too
    (np.arange(30000) % 64).astype(np.uint16).tofile(data / "train.bin")
    (np.arange(3000) % 64).astype(np.uint16).tofile(data / "val.bin")
    chars = [chr(48 + i) for i in range(64)]
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump(
            {
                "vocab_size": 64,
                "itos": dict(enumerate(chars)),
                "stoi": {c: i for i, c in enumerate(chars)},
            },
            f,
        )
    run(str(data), out, "--max_iters=4")
    saved = snapshot(checkpoint.ckpt_dir(out))
    p = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *TINY,
            f"--dataset={data}",
            f"--out_dir={out}",
            "--init_from=resume",
            "--max_iters=100000",
        ],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for line in p.stdout:
        if line.startswith("iter "):  # the run is reading train.bin
            break
    os.truncate(data / "train.bin", 1000)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1, (p.returncode, err[-2000:])
    what = "changed while the run read it (now 500 tokens, was 30000)"
    assert err.strip() == f"error: {data / 'train.bin'} {what}: {FIX}"
    assert snapshot(checkpoint.ckpt_dir(out)) == saved
