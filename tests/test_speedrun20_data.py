"""python -m pytest tests/test_speedrun20_data.py -q

Record 20's loader (dataloader.Record20ShardLoader, make_loader's record20) against the record's
distributed_data_generator (parity/speedrun20_training.py): the same tokens step after step across
shard ends, a tail that would just fit dropped, and a resume that goes on bit for bit."""

import numpy as np
import pytest

from dataio.dataloader import BinShardLoader, make_loader
from parity.check_speedrun import write_datafile
from parity.speedrun20_training import data_generator

T, ROWS, ACCUM = 8, 2, 2  # a step: 2 micro-batches of 2 sequences of 8 tokens, 32 tokens


@pytest.fixture
def shards(tmp_path):
    """Train shards whose ends fall mid-step and, in the second, exactly one step and its extra
    token past a step (33 tokens: record 5's loader would read it, record 20's drops it)."""
    rng = np.random.default_rng(0)
    for i, n in enumerate([100, 33 + 32, 90]):
        write_datafile(tmp_path / f"fineweb_train_{i + 1:06d}.bin", rng.integers(0, 2**16, n))
    return tmp_path


def records_steps(folder, n):
    steps = data_generator(str(folder / "fineweb_train_*.bin"), ACCUM * ROWS * T, 0, 1)
    return [next(steps) for _ in range(n)]


def test_the_steps_are_the_records(shards):
    loader = make_loader(shards, "train", T, ROWS, seed=0, record20=True)
    for inputs, targets in records_steps(shards, 6):
        x, y = loader.next(ACCUM)  # (accum, rows, T)
        np.testing.assert_array_equal(x.reshape(-1), inputs.numpy())
        np.testing.assert_array_equal(y.reshape(-1), targets.numpy())


def test_record_5s_loader_reads_the_tail_record_20s_drops(shards):
    """The second shard holds exactly one step and its extra token: record 5's reads it."""
    ours = make_loader(shards, "train", T, ROWS, seed=0, record20=True)
    record5 = BinShardLoader(sorted(shards.glob("*train*")), T, ROWS)
    steps = [(ours.next(ACCUM), record5.next(ACCUM)) for _ in range(5)]
    assert any(not np.array_equal(a[0], b[0]) for a, b in steps)


def test_a_resumed_loader_goes_on_bit_for_bit(shards):
    loader = make_loader(shards, "train", T, ROWS, seed=0, record20=True)
    for _ in range(3):
        loader.next(ACCUM)
    resumed = make_loader(shards, "train", T, ROWS, seed=0, record20=True)
    resumed.load_state_dict(loader.state_dict())
    for _ in range(3):
        np.testing.assert_array_equal(resumed.next(ACCUM)[0], loader.next(ACCUM)[0])
