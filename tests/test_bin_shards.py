"""python -m pytest tests/test_bin_shards.py -q

llm.c / modded-nanogpt `.bin` shards (a 256-int32 header, then uint16 tokens): BinShardLoader's
batches equal the record's DistributedDataLoader.next_batch for W processes (re-implemented here
from its semantics) across shard ends and the wrap-around, per process and per micro-batch; its
position resumes exactly; validation reads from the start for val_tokens; every bad shard is one
line naming the file; make_loader picks the loader by the file names (data/fineweb10B/prepare.py,
which fetches these shards: test_fineweb10b_prepare.py; token_files at its edges, every format:
test_token_files.py)."""

import os

import numpy as np
import pytest
from helpers import FIX, write_shards

from configurator import InputNotFound, RunStopped, UsageError
from dataio.dataloader import (
    BinLoader,
    BinShardLoader,
    ShardLoader,
    make_loader,
    val_batches_for,
)
from dataio.prefetch import Prefetcher
from parity.check_speedrun import write_datafile

# the record's processes, rows per process, sequence length: a global batch is 48 tokens (+1)
W, B, T = 2, 3, 8
# batches per shard: 2 (tail of 30 dropped), 1 (exactly one batch + 1 token), 4 (tail of 28
# dropped); 7 in all
TRAIN_SIZES = [126, 49, 220]


class RecordLoader:
    """The record's DistributedDataLoader
    (records/track_1_short/2024-10-14_ModernArch/train_gpt2.py), process `rank` of `world`, on token
    arrays: it starts rank*B*T into shard 0, reads B*T+1 tokens a batch, steps world*B*T, and moves
    to the next shard (round robin, back to its rank's offset) when its position + world*B*T + 1 is
    past the shard's end."""

    def __init__(self, shards, B, T, rank, world):
        self.shards, self.B, self.T, self.rank, self.world = shards, B, T, rank, world
        self.reset()

    def reset(self):
        self.shard, self.position = 0, self.rank * self.B * self.T

    def next_batch(self):
        tokens, n = self.shards[self.shard], self.B * self.T
        buf = tokens[self.position : self.position + n + 1].astype(np.int32)
        self.position += n * self.world
        if self.position + n * self.world + 1 > len(tokens):
            self.shard, self.position = (self.shard + 1) % len(self.shards), self.rank * n
        return buf[:-1].reshape(self.B, self.T), buf[1:].reshape(self.B, self.T)


@pytest.fixture
def data(tmp_path):
    """A folder of 3 train shards and 2 val shards; their token arrays."""
    train = write_shards(tmp_path, TRAIN_SIZES)
    val = write_shards(tmp_path, [126, 60], split="val", seed=1)
    return tmp_path, train, val


def process_loaders(folder, split="train", **kw):
    """BinShardLoader as each of the W processes makes it: the global rows W*B, its own rows B."""
    return [
        make_loader(str(folder), split, T, W * B, seed=0, row_slice=slice(r * B, (r + 1) * B), **kw)
        for r in range(W)
    ]


def test_batches_equal_the_records_loader_per_process_across_shard_ends_and_the_wrap(data):
    folder, train, _ = data
    ours, record = process_loaders(folder), [RecordLoader(train, B, T, r, W) for r in range(W)]
    whole = make_loader(str(folder), "train", T, W * B, seed=0)
    assert isinstance(whole, BinShardLoader)
    for _ in range(16):  # 7 batches a pass over the shards: wraps twice
        xs = []
        for mine, theirs in zip(ours, record):
            x, y = mine.next(1)
            want_x, want_y = theirs.next_batch()
            assert x.shape == y.shape == (1, B, T) and x.dtype == y.dtype == np.int32
            np.testing.assert_array_equal(x[0], want_x)
            np.testing.assert_array_equal(y[0], want_y)
            xs.append(x)
        # the processes' rows compose it
        np.testing.assert_array_equal(whole.next(1)[0], np.concatenate(xs, axis=1))
    # 16 = 2 x 7 + shard 0's 2; its tail of 30 dropped
    assert whole.state_dict() == {"shard": 1, "offset": 0}


def test_a_micro_batch_is_one_record_batch(data):
    folder, train, _ = data
    record = [RecordLoader(train, B, T, r, W) for r in range(W)]
    for loader, theirs in zip(process_loaders(folder), record):
        for _ in range(5):  # 15 batches
            x, y = loader.next(3)
            assert x.shape == (3, B, T)
            for k in range(3):
                want_x, want_y = theirs.next_batch()
                np.testing.assert_array_equal(x[k], want_x)
                np.testing.assert_array_equal(y[k], want_y)


def test_the_record_ranks_part_at_a_short_tail_and_we_follow_rank_0(tmp_path):
    """The record's rank r tests its own position, r*B*T past the global window's: where a shard's
    tail holds fewer than (W-1)*B*T+1 tokens after its last window, ranks r > 0 move on one batch
    early and read other tokens than rank 0 from then on. We follow rank 0 (the agreed global
    semantics): the record exactly for one process, and for every rank where each shard's tail holds
    (W-1)*B*T+1 tokens (TRAIN_SIZES)."""
    # 4 global batches in shard 0, then a tail of 8 tokens
    train = write_shards(tmp_path, [200, 49])
    mine = make_loader(str(tmp_path), "train", T, W * B, seed=0, row_slice=slice(B, 2 * B))
    rank0, rank1 = RecordLoader(train, B, T, 0, W), RecordLoader(train, B, T, 1, W)
    for k in range(4):
        x = mine.next(1)[0][0]
        rank0.next_batch()
        if k < 3:
            np.testing.assert_array_equal(x, rank1.next_batch()[0])
    # rank 1's rows of shard 0's 4th batch
    np.testing.assert_array_equal(x.reshape(-1), train[0][168:192])
    assert not np.array_equal(x, rank1.next_batch()[0])  # the record's rank 1 is in shard 1 already
    assert mine.state_dict() == {"shard": 1, "offset": 0} and rank0.shard == 1


def test_position_resumes_exactly_and_the_prefetcher_carries_it(data):
    folder, _, _ = data
    a = make_loader(str(folder), "train", T, W * B, seed=0)
    a.next(3)  # shards 0 and 1: shard 2's first batch is next
    state = a.state_dict()
    assert state == {"shard": 2, "offset": 0}
    expected = [a.next(2) for _ in range(4)]  # through the wrap
    b = make_loader(str(folder), "train", T, W * B, seed=0)
    b.load_state_dict(state)
    ahead = Prefetcher(b, accum=2, put=np.copy)
    try:
        for want_x, want_y in expected:
            x, y = ahead.next()
            np.testing.assert_array_equal(x, want_x)
            np.testing.assert_array_equal(y, want_y)
        assert ahead.state == a.state_dict()
    finally:
        ahead.close()
    with pytest.raises(UsageError) as bad:  # a checkpoint of other data or another batch size
        b.load_state_dict({"shard": 1, "offset": 48})
    assert str(bad.value) == (
        f"the checkpoint's data position (shard 1, offset 48) is past the end of the 3 shards in "
        f"{folder} at 6 rows x 8: resume on the data and batch size it was saved with"
    )


def test_the_tail_rule_and_a_resumed_position_at_their_bounds(tmp_path):
    """One process, the record exactly: a shard of 2 batches + 1 token gives both, one token fewer
    gives one; a saved position is good up to the last batch that fits, in a shard there is; a
    process reads one run of rows."""
    train = write_shards(tmp_path, [97, 96, 145])  # 2, 1 and 3 batches of 48 tokens (+1)
    ours, record = (
        make_loader(str(tmp_path), "train", T, W * B, seed=0),
        RecordLoader(train, W * B, T, 0, 1),
    )
    for _ in range(12):  # twice around
        x, y = ours.next(1)
        want_x, want_y = record.next_batch()
        np.testing.assert_array_equal(x[0], want_x)
        np.testing.assert_array_equal(y[0], want_y)
    ours.load_state_dict({"shard": 0, "offset": 48})
    # to the shard's last token
    np.testing.assert_array_equal(ours.next(1)[1][0].reshape(-1), train[0][49:97])
    for shard, offset in ((0, 49), (1, 48), (3, 0)):
        with pytest.raises(
            UsageError,
            match=rf"position \(shard {shard}, offset {offset}\) is past the end of the 3",
        ):
            ours.load_state_dict({"shard": shard, "offset": offset})
    one = tmp_path / "one"
    one.mkdir()
    write_shards(one, [97])
    with pytest.raises(
        UsageError, match=f"past the end of the 1 shards in {one} at 6 rows x 8: resume"
    ):
        make_loader(str(one), "train", T, W * B, seed=0).load_state_dict({"shard": 0, "offset": 49})
    for rows in (slice(0, 6, 2), slice(3, 3)):  # every other row, or none
        with pytest.raises(AssertionError, match="a process reads one contiguous range of rows"):
            make_loader(str(tmp_path), "train", T, W * B, seed=0, row_slice=rows)


def test_val_reads_val_tokens_from_the_start_every_time(data):
    folder, _, val = data
    n = val_batches_for(4 * W * B * T, W * B, T)
    assert n == 4 and val_batches_for(0, W * B, T) == 0
    assert val_batches_for(10_485_760, 8 * 64, 1024) == 20  # the record: 8 GPUs x 64 rows x 1024
    for r, loader in enumerate(process_loaders(folder, "val")):
        loader.next(1)  # a step of its own: eval does not move it, nor follow it
        record = RecordLoader(val, B, T, r, W)
        for _ in range(2):
            record.reset()
            got = list(loader.eval_batches(n, tag=123))
            assert len(got) == n
            for x, y in got:  # 126 tokens: 2 batches; 60: 1 batch; then the first shard again
                want_x, want_y = record.next_batch()
                np.testing.assert_array_equal(x, want_x)
                np.testing.assert_array_equal(y, want_y)
        assert loader.state_dict() == {"shard": 0, "offset": 48}
    with pytest.raises(UsageError) as bad:
        val_batches_for(10_485_760, 6 * 64, 1024)
    assert str(bad.value) == (
        "val_tokens=10485760 is not a multiple of one eval batch, 384 rows x 1024 = 393216 "
        "tokens: set --val_tokens=10616832, or 0 to evaluate eval_iters batches"
    )
    # fewer than one batch: one batch
    with pytest.raises(UsageError, match=r"set --val_tokens=48, or 0"):
        val_batches_for(20, W * B, T)


# --- bad input: one line each, naming the file
# ----------------------------------------------------------------

HINT = "rerun `python data/fineweb10B/prepare.py`"


@pytest.mark.parametrize(
    "fault, what",
    [
        (
            dict(magic=20240521),
            "has magic number 20240521, not llm.c's 20240520: not an llm.c token shard",
        ),
        (dict(version=2), "has version 2: only version 1 (uint16 tokens) is read"),
        (dict(count=130), "is truncated (it holds 126 of the 130 tokens its header declares)"),
        (dict(count=100), "holds 126 tokens, more than the 100 its header declares"),
        (dict(extra=b"\0"), "holds 253 bytes after its header, not whole uint16 tokens"),
        (
            dict(size=600),
            "holds 600 bytes, fewer than the 1024-byte header of an llm.c token shard",
        ),
    ],
)
def test_a_bad_shard_is_one_line_naming_it(data, fault, what):
    folder, train, _ = data
    path = folder / "fineweb_train_000001.bin"
    extra, size = fault.pop("extra", b""), fault.pop("size", None)
    write_datafile(path, train[0], **fault)
    with open(path, "ab") as f:
        f.write(extra)
    if size is not None:
        os.truncate(path, size)
    with pytest.raises(UsageError) as bad:
        make_loader(str(folder), "train", T, W * B, seed=0)
    assert str(bad.value) == f"{path} {what}: {HINT}"


def test_short_shards_missing_shards_and_foreign_ids_are_one_line(data):
    folder, _, _ = data
    with pytest.raises(UsageError) as bad:
        # 56 + 1 tokens do not fit the 49-token shard
        make_loader(str(folder), "train", T, rows=W * B + 1, seed=0)
    assert str(bad.value) == (
        f"{folder / 'fineweb_train_000002.bin'} holds 49 tokens, fewer than one batch of 7 rows "
        "x 8 + 1 = 57: lower batch_size or block_size"
    )
    for f in folder.glob("fineweb_val_*.bin"):
        f.unlink()
    with pytest.raises(InputNotFound) as missing:
        make_loader(str(folder), "val", T, W * B, seed=0)
    assert str(missing.value) == (
        f"no val.bin or val shards (*_val_*.bin, *val*.npy) in {folder}: run "
        f"`python {folder / 'prepare.py'}` first"
    )
    # a data folder's own script is the hint (data/fineweb10B/ has one)
    (folder / "prepare.py").write_text("")
    write_datafile(folder / "fineweb_val_000000.bin", [1, 2, 3])
    with pytest.raises(UsageError, match="fewer than one batch .*: lower batch_size"):
        make_loader(str(folder), "val", T, W * B, seed=0)
    loader = make_loader(str(folder), "train", T, W * B, seed=0, vocab_size=50304)
    with pytest.raises(UsageError) as bad:
        loader.next(1)
    assert str(bad.value).startswith(f"{folder / 'fineweb_train_000001.bin'} holds token id ")
    assert str(bad.value).endswith(
        "outside the model's vocabulary (vocab_size 50304): set --vocab_size, or prepare "
        "the data with the model's tokenizer"
    )


def test_a_shard_changed_after_the_listing_stops_the_run_when_reached(data):
    folder, train, _ = data
    loader = make_loader(str(folder), "train", T, W * B, seed=0)
    loader.next(1)
    second = folder / "fineweb_train_000002.bin"
    write_datafile(second, train[1][:-1])  # one token shorter, well formed
    loader.next(1)  # still shard 0
    with pytest.raises(RunStopped) as stop:
        loader.next(1)
    assert (
        str(stop.value)
        == f"{second} changed since the run listed the shards (now 48 tokens, was 49): {FIX}"
    )
    loader.load_state_dict({"shard": 0, "offset": 0})
    loader.next(1)
    second.unlink()
    loader.next(1)
    with pytest.raises(RunStopped) as stop:
        loader.next(1)
    assert str(stop.value) == f"{second} is gone (deleted after the run listed the shards): {FIX}"
    write_datafile(second, train[1], magic=7)  # back, of the length listed, with a foreign header
    with pytest.raises(RunStopped) as stop:
        loader.next(1)
    assert (
        str(stop.value)
        == f"{second} has magic number 7, not llm.c's 20240520: not an llm.c token shard: {FIX}"
    )
    val = folder / "fineweb_val_000000.bin"
    loader = make_loader(str(folder), "val", T, W * B, seed=0)
    loader.next(1)
    os.truncate(val, 1024 + 100)  # the shard it reads shrinks
    with pytest.raises(RunStopped) as stop:
        loader.next(1)
    assert str(stop.value) == f"{val} changed while the run read it (now 50 tokens, was 126): {FIX}"


def test_make_loader_tells_the_formats_apart_by_name(data, tmp_path_factory):
    folder, _, _ = data
    assert isinstance(make_loader(str(folder), "train", T, W * B, seed=0), BinShardLoader)
    # nanoGPT's, beside them: it is read, as before
    np.arange(500, dtype=np.uint16).tofile(folder / "train.bin")
    assert isinstance(make_loader(str(folder), "train", T, W * B, seed=0), BinLoader)
    npy = tmp_path_factory.mktemp("npy")
    np.save(npy / "edufineweb_train_000001.npy", np.arange(500, dtype=np.uint16))
    assert isinstance(make_loader(str(npy), "train", T, W * B, seed=0), ShardLoader)
    (folder / "train.bin").unlink()
    assert isinstance(
        make_loader(str(folder), "val", T, W * B, seed=0, shuffle_shards=True), BinShardLoader
    )
    with pytest.raises(UsageError) as bad:  # train.py asks it for train's loaders only
        make_loader(str(folder), "train", T, W * B, seed=0, shuffle_shards=True)
    assert str(bad.value) == (
        f"shuffle_shards is for .npy shards: the .bin shards in {folder} are read in order, as "
        "modded-nanogpt reads them; drop --shuffle_shards"
    )
