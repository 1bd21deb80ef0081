"""python -m pytest tests/test_dataloader.py -q

The loaders: determinism, per-process rows composing the global batch, shard order, wrap-around across
shards, exact resume position, the missing-data errors, and the prefetching thread."""

import numpy as np
import pytest

from configurator import UsageError
from dataloader import BinLoader, Prefetcher, ShardLoader, make_loader


@pytest.fixture
def bin_file(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.fixture
def shards(tmp_path):
    """Three train shards of different lengths holding consecutive integers, and one val shard."""
    sizes, start, paths = [100, 70, 130], 0, []
    for i, n in enumerate(sizes):
        p = tmp_path / f"edufineweb_train_{i + 1:06d}.npy"
        np.save(p, np.arange(start, start + n, dtype=np.uint16))
        paths.append(str(p))
        start += n
    np.save(tmp_path / "edufineweb_val_000000.npy", np.arange(1000, 1100, dtype=np.uint16))
    return tmp_path, paths


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
    parts = [BinLoader(bin_file, 8, rows=6, seed=0, row_slice=slice(i, i + 2)).next(2)[0] for i in (0, 2, 4)]
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


def test_accumulation_layout_is_the_same_tokens(bin_file):
    """accum 4 x rows 2 and accum 1 x rows 8 read the same windows (the accumulation equivalence)."""
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
    halves = [ShardLoader(paths, 10, rows=4, seed=0, row_slice=s) for s in (slice(0, 2), slice(2, 4))]
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
        firsts = [int(loader.next(30)[0].reshape(-1)[0]) for _ in range(epochs)]  # 300 tokens = 1 epoch
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


def test_missing_data_names_the_command(tmp_path):
    (tmp_path / "edu_fineweb10B").mkdir()
    with pytest.raises(FileNotFoundError, match="run `python fineweb.py` first"):
        make_loader(str(tmp_path / "edu_fineweb10B"), "train", 8, 2, 0)
    with pytest.raises(FileNotFoundError, match=r"no train.bin .* run `python data/nope/prepare.py` first"):
        make_loader("data/nope", "train", 8, 2, 0)


def test_prefetcher_gives_the_loaders_batches_and_the_position_after_the_last_taken(shards):
    _, paths = shards
    direct = ShardLoader(paths, block_size=4, rows=2, seed=0)
    ahead = Prefetcher(ShardLoader(paths, block_size=4, rows=2, seed=0), accum=3, put=np.copy, depth=2)
    try:
        for _ in range(5):  # wraps around the shards
            x, y = ahead.next()
            want = direct.next(3)
            np.testing.assert_array_equal(x, want[0])
            np.testing.assert_array_equal(y, want[1])
            assert ahead.state == direct.state_dict()  # though the thread has read further
    finally:
        ahead.close()


def test_prefetcher_raises_a_read_error_at_the_batch_that_hit_it(tmp_path):
    np.full(200, 70, np.uint16).tofile(tmp_path / "train.bin")
    loader = BinLoader(str(tmp_path / "train.bin"), block_size=4, rows=2, seed=0)
    loader.vocab_size = 64  # every id (70) is outside it
    ahead = Prefetcher(loader, accum=1, put=np.copy)
    with pytest.raises(UsageError, match="outside the model's vocabulary"):
        ahead.next()
    assert not ahead._thread.is_alive()
