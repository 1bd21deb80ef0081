"""python -m pytest tests/test_dataloader.py -q

The loaders: determinism, per-process rows composing the global batch, shard order, wrap-around
across shards, exact resume position, the missing-data errors, the prefetching thread, and where
--dataset is found. (Their reads without a memory map, and a data file that changes under a run:
test_dataloader_pread.py.)"""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO

from configurator import UsageError
from dataio import dataloader
from dataio.dataloader import BinLoader, ShardLoader, make_loader
from dataio.prefetch import Prefetcher
from dataio.token_files import prepare_hint


def test_bin_windows_are_targets_shifted_by_one_and_deterministic(bin_file):
    a = BinLoader(bin_file, block_size=8, rows=4, seed=1)
    x, y = a.next(accum=3)
    assert x.shape == y.shape == (3, 4, 8) and x.dtype == np.int32
    np.testing.assert_array_equal(y[..., :-1], x[..., 1:])
    np.testing.assert_array_equal(x[..., 1:] - x[..., :-1], 1)  # windows of consecutive tokens
    b = BinLoader(bin_file, block_size=8, rows=4, seed=1)
    np.testing.assert_array_equal(b.next(3)[0], x)
    assert not np.array_equal(BinLoader(bin_file, 8, 4, seed=2).next(3)[0], x)
    assert not np.array_equal(a.next(3)[0], x)  # the next step differs


def test_process_rows_compose_the_global_batch(bin_file):
    whole = BinLoader(bin_file, 8, rows=6, seed=0).next(2)[0]
    parts = [
        BinLoader(bin_file, 8, rows=6, seed=0, row_slice=slice(i, i + 2)).next(2)[0]
        for i in (0, 2, 4)
    ]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


def test_accumulation_layout_is_the_same_tokens(bin_file):
    """accum 4 x rows 2 and accum 1 x rows 8 read the same windows (the accumulation
    equivalence)."""
    a = BinLoader(bin_file, 8, rows=2, seed=3).next(4)[0]
    b = BinLoader(bin_file, 8, rows=8, seed=3).next(1)[0]
    np.testing.assert_array_equal(a.reshape(8, 8), b.reshape(8, 8))


def test_bin_resume_position(bin_file):
    a = BinLoader(bin_file, 8, 4, seed=0)
    a.next(1), a.next(1)
    state = a.state_dict()
    expected = a.next(1)[0]
    b = BinLoader(bin_file, 8, 4, seed=0)
    b.load_state_dict(state)
    np.testing.assert_array_equal(b.next(1)[0], expected)


def test_shards_are_read_in_order_and_wrap_around(shards):
    _, paths = shards
    loader = ShardLoader(paths, block_size=10, rows=3, seed=0)  # 30 tokens per step, 300 per epoch
    seen = []
    for _ in range(12):  # 360 tokens: crosses both shard boundaries and the epoch end
        x, y = loader.next(1)
        np.testing.assert_array_equal(y.reshape(-1)[:-1], x.reshape(-1)[1:])
        seen.append(x.reshape(-1))
    stream = np.concatenate(seen)
    np.testing.assert_array_equal(stream, np.arange(360) % 300)
    assert loader.state_dict() == {"epoch": 1, "shard": 0, "offset": 60}


def test_shard_rows_per_process_and_exact_resume(shards):
    _, paths = shards
    whole = ShardLoader(paths, 10, rows=4, seed=0)
    halves = [
        ShardLoader(paths, 10, rows=4, seed=0, row_slice=s) for s in (slice(0, 2), slice(2, 4))
    ]
    for _ in range(5):
        x = whole.next(2)[0]
        np.testing.assert_array_equal(np.concatenate([h.next(2)[0] for h in halves], axis=1), x)
    state = whole.state_dict()
    expected = [whole.next(2)[0] for _ in range(3)]
    resumed = ShardLoader(paths, 10, rows=4, seed=0)
    resumed.load_state_dict(state)
    for e in expected:
        np.testing.assert_array_equal(resumed.next(2)[0], e)


def test_shuffled_shard_order_is_seeded_per_epoch(shards):
    _, paths = shards

    def epoch_order(seed, epochs=4):
        loader = ShardLoader(paths, block_size=10, rows=1, seed=seed, shuffle_shards=True)
        # 300 tokens = 1 epoch
        firsts = [int(loader.next(30)[0].reshape(-1)[0]) for _ in range(epochs)]
        return firsts

    a, b = epoch_order(0), epoch_order(0)
    assert a == b  # seeded
    assert all(f in (0, 100, 170) for f in a)  # each epoch starts at a shard boundary
    assert len(set(epoch_order(0, 8))) > 1  # the order changes between epochs


def test_val_batches_restart_from_the_beginning(shards):
    tmp, _ = shards
    val = make_loader(str(tmp), "val", block_size=10, rows=2, seed=0)
    first = [x for x, _ in val.eval_batches(3)]
    again = [x for x, _ in val.eval_batches(3)]
    np.testing.assert_array_equal(first, again)
    assert first[0][0, 0] == 1000


def test_shard_eval_batches_are_epoch_0s_first_and_ids_are_checked(shards):
    tmp, paths = shards
    # seed 1: epoch 1 starts elsewhere
    loader = ShardLoader(paths, block_size=10, rows=3, seed=1, shuffle_shards=True)
    first = ShardLoader(paths, block_size=10, rows=3, seed=1, shuffle_shards=True).next(4)
    for _ in range(12):  # into epoch 1
        loader.next(1)
    got = list(loader.eval_batches(4))
    np.testing.assert_array_equal([x for x, _ in got], first[0])
    np.testing.assert_array_equal([y for _, y in got], first[1])
    assert loader.state_dict() == {"epoch": 1, "shard": 0, "offset": 60}
    with pytest.raises(UsageError) as bad:
        ShardLoader(paths, block_size=10, rows=3, seed=0, vocab_size=20).next(1)  # ids 0..30
    assert str(bad.value) == (
        f"{tmp} holds token id 30, outside the model's vocabulary (vocab_size 20): set "
        "--vocab_size, or prepare the data with the model's tokenizer"
    )


def test_missing_data_names_the_command(tmp_path):
    (tmp_path / "edu_fineweb10B").mkdir()
    with pytest.raises(FileNotFoundError, match="run `python fineweb.py` first"):
        make_loader(str(tmp_path / "edu_fineweb10B"), "train", 8, 2, 0)
    with pytest.raises(
        FileNotFoundError, match=r"no train.bin .* run `python data/nope/prepare.py` first"
    ):
        make_loader("data/nope", "train", 8, 2, 0)
    # a URL folder has no prepare.py to ask: the hint is by its name
    assert (
        prepare_hint("gs://bucket/runs/shakespeare_char/")
        == "python data/shakespeare_char/prepare.py"
    )
    assert prepare_hint("gs://bucket/edu_fineweb10B") == "python fineweb.py"
    assert (
        prepare_hint("gs://bucket/shakespeare_char", bin_shards=True)
        == "python data/fineweb10B/prepare.py"
    )


def test_prefetcher_gives_the_loaders_batches_and_the_position_after_the_last_taken(shards):
    _, paths = shards
    direct = ShardLoader(paths, block_size=4, rows=2, seed=0)
    ahead = Prefetcher(
        ShardLoader(paths, block_size=4, rows=2, seed=0), accum=3, put=np.copy, depth=2
    )
    try:
        # before the first batch: the loader's (a checkpoint at step 0)
        assert ahead.state == direct.state_dict()
        for _ in range(5):  # wraps around the shards
            x, y = ahead.next()
            want = direct.next(3)
            np.testing.assert_array_equal(x, want[0])
            np.testing.assert_array_equal(y, want[1])
            assert ahead.state == direct.state_dict()  # though the thread has read further
    finally:
        ahead.close()


def test_prefetcher_raises_a_read_error_at_the_batch_that_hit_it(tmp_path):
    np.full(200, 64, np.uint16).tofile(tmp_path / "train.bin")
    # every id is 64
    loader = BinLoader(str(tmp_path / "train.bin"), block_size=4, rows=2, seed=0, vocab_size=64)
    ahead = Prefetcher(loader, accum=1, put=np.copy)
    with pytest.raises(UsageError) as bad:
        ahead.next()
    assert str(bad.value).startswith(
        f"{tmp_path / 'train.bin'} holds token id 64, outside the model's vocabulary"
    )
    assert not ahead._thread.is_alive()


def test_a_run_that_dies_without_closing_its_prefetcher_still_exits(bin_file):
    """The thread is a daemon: an error in the training loop ends the process, where it would wait
    on the thread."""
    script = (
        "import sys, numpy as np; from dataio.dataloader import BinLoader; "
        "from dataio.prefetch import Prefetcher; "
        "Prefetcher(BinLoader(sys.argv[1], 8, 4, seed=0), accum=1, put=np.copy).next(); sys.exit(3)"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, bin_file],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3, r.stderr[-2000:]
    # in this process too: mutmut runs a test against a mutant only where the test calls its
    # function in-process
    ahead = Prefetcher(BinLoader(bin_file, 8, 4, seed=0), accum=1, put=np.copy)
    ahead.close()
    assert ahead._thread.daemon


def test_make_loader_hands_each_loader_its_settings(shards):
    tmp, _ = shards
    # shuffle_shards: the train split's only
    for split, shuffled in (("train", True), ("val", False)):
        got = make_loader(
            str(tmp),
            split,
            10,
            4,
            seed=1,
            row_slice=slice(1, 3),
            shuffle_shards=True,
            vocab_size=2000,
        )
        assert (got.seed, got.row_slice, got.shuffle_shards, got.vocab_size) == (
            1,
            slice(1, 3),
            shuffled,
            2000,
        )
    np.arange(100, dtype=np.uint16).tofile(tmp / "train.bin")
    got = make_loader(str(tmp), "train", 10, 4, seed=1, row_slice=slice(1, 3), vocab_size=2000)
    assert (type(got), got.seed, got.row_slice, got.vocab_size) == (BinLoader, 1, slice(1, 3), 2000)


def test_a_run_from_another_directory_finds_the_projects_data(tmp_path, monkeypatch):
    """train.py --dataset=shakespeare_char started from another directory reads the project's
    data/shakespeare_char (it said to run prepare.py); a local data/<name> or a path still comes
    first, and a name found nowhere is one line naming where it looked and the datasets the project
    prepares (issue 33)."""
    project = os.path.join(REPO, "data", "shakespeare_char")
    monkeypatch.chdir(tmp_path)
    assert dataloader.data_dir_for("shakespeare_char") == project
    with pytest.raises(FileNotFoundError) as e:
        dataloader.data_dir_for("nowhere")
    looked = [
        str(tmp_path / "data" / "nowhere"),
        str(tmp_path / "nowhere"),
        os.path.join(REPO, "data", "nowhere"),
    ]
    assert str(e.value).startswith(
        f"no dataset 'nowhere': no such folder ({', '.join(looked)}): give --dataset"
    )
    assert (
        "(chat, fineweb10B, nanochat, openwebtext, shakespeare, shakespeare_char: "
        "python data/NAME/prepare.py;" in str(e.value)
    )
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    assert dataloader.data_dir_for("shakespeare_char") == os.path.join("data", "shakespeare_char")
