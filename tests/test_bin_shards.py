"""python -m pytest tests/test_bin_shards.py -q

llm.c / modded-nanogpt `.bin` shards (a 256-int32 header, then uint16 tokens): BinShardLoader's
batches equal the record's DistributedDataLoader.next_batch for W processes (re-implemented here
from its semantics) across shard ends and the wrap-around, per process and per micro-batch; its
position resumes exactly; validation reads from the start for val_tokens; every bad shard is one
line naming the file; make_loader picks the loader by the file names; data/fineweb10B/prepare.py
links shards from --local and says what to do offline. And token_files at its edges, for every
format: .npy headers of any length, and a file at a URL (fsspec's memory:// store here;
test_gcs_data.py has Cloud Storage's) giving the local file's tokens by ranged reads of its windows
only."""

import importlib.util
import os

import numpy as np
import pytest

import storage
import token_files
from configurator import InputNotFound, RunStopped, UsageError, exit_on_bad_input
from dataloader import (
    BinLoader,
    BinShardLoader,
    Prefetcher,
    ShardLoader,
    make_loader,
    val_batches_for,
)
from parity.check_speedrun import write_datafile
from token_files import token_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = "the run stopped; restore the file and resume with --init_from=resume"
# the record's processes, rows per process, sequence length: a global batch is 48 tokens (+1)
W, B, T = 2, 3, 8
# batches per shard: 2 (tail of 30 dropped), 1 (exactly one batch + 1 token), 4 (tail of 28
# dropped); 7 in all
TRAIN_SIZES = [126, 49, 220]


def write_shards(folder, sizes, split="train", seed=0):
    """Random uint16 shards named as the record's (fineweb_train_000001.bin, ...; val from 000000);
    their tokens."""
    rng, arrays = np.random.default_rng(seed), []
    for i, n in enumerate(sizes):
        arrays.append(rng.integers(0, 2**16, n, dtype=np.uint16))
        write_datafile(folder / f"fineweb_{split}_{i + (split == 'train'):06d}.bin", arrays[-1])
    return arrays


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


# --- data/fineweb10B/prepare.py
# ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepare():
    spec = importlib.util.spec_from_file_location(
        "fineweb10B_prepare", os.path.join(REPO, "data", "fineweb10B", "prepare.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line(main, capsys):
    """What the command line prints for main's UsageError: its exit code and the one line on
    stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        exit_on_bad_input(main)
    err = capsys.readouterr().err
    return done.value.code, err.splitlines()[-1]


def test_prepare_links_shards_from_local_and_skips_complete_ones(
    prepare, tmp_path, capsys, monkeypatch
):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    write_shards(src, [100, 70, 90])  # fineweb_train_000001..3
    write_shards(src, [60], split="val")
    assert prepare.main(["--num_chunks=2", f"--local={src}", f"--out_dir={out}"]) == 0
    names = ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert sorted(os.listdir(out)) == sorted(names)
    for name in names:
        # hard links: no copy on the same filesystem
        assert os.path.samefile(out / name, src / name)
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("the val shard and 2 train shards (3 fetched now), 230 tokens")
    )
    # a broken shard (a hard link of the source: replaced, not truncated in place)
    (out / names[1]).unlink()
    # fetched again; the others skipped
    (out / names[1]).write_bytes((src / names[1]).read_bytes()[: 1024 + 50])

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")

    with monkeypatch.context() as m:
        m.setattr(prepare.os, "link", no_links)  # another filesystem: a copy
        assert prepare.main(["--num_chunks=2", f"--local={src}", f"--out_dir={out}"]) == 0
    assert "(1 fetched now)" in capsys.readouterr().out
    assert not os.path.samefile(out / names[1], src / names[1])
    assert (out / names[1]).read_bytes() == (src / names[1]).read_bytes()
    assert sorted(os.listdir(out)) == sorted(names)  # no temporary file left
    assert isinstance(make_loader(str(out), "train", 8, 2, seed=0), BinShardLoader)

    code, line = one_line(
        lambda: prepare.main(["--num_chunks=4", f"--local={src}", f"--out_dir={out}"]), capsys
    )
    assert (code, line) == (2, f"error: --local {src} holds no fineweb_train_000004.bin")
    write_datafile(src / "fineweb_train_000003.bin", [1, 2], version=7)
    code, line = one_line(
        lambda: prepare.main(["--num_chunks=3", f"--local={src}", f"--out_dir={out}"]), capsys
    )
    assert (code, line) == (
        2,
        f"error: {src / 'fineweb_train_000003.bin'} has version 7: only version 1 (uint16 "
        "tokens) is read: --local needs complete shards",
    )
    assert not (out / "fineweb_train_000003.bin").exists()


def test_prepare_downloads_the_records_files_and_says_what_to_do_offline(
    prepare, tmp_path, capsys, monkeypatch
):
    calls = []

    # the hub, as far as hf_hub_download goes: writes the file
    def hub(repo_id, filename, repo_type, local_dir):
        calls.append((repo_id, filename, repo_type, local_dir))
        write_datafile(os.path.join(local_dir, filename), np.arange(64))

    monkeypatch.setattr(prepare, "hf_hub_download", hub)
    assert prepare.main(["--num_chunks=1", f"--out_dir={tmp_path}"]) == 0
    assert calls == [
        ("kjj0/fineweb10B-gpt2", name, "dataset", str(tmp_path))
        for name in ("fineweb_val_000000.bin", "fineweb_train_000001.bin")
    ]

    def offline(**kw):
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError(
            "An error happened while trying to locate the file on the Hub and we cannot "
            "find the requested files in the local cache.\nPlease check your connection"
        )

    monkeypatch.setattr(prepare, "hf_hub_download", offline)
    code, line = one_line(lambda: prepare.main(["--num_chunks=2", f"--out_dir={tmp_path}"]), capsys)
    assert (code, line) == (
        2,
        "error: could not download fineweb_train_000002.bin from the HF hub dataset "
        "kjj0/fineweb10B-gpt2 (LocalEntryNotFoundError); offline? link the shards from a local "
        "directory with --local DIR",
    )


# --- token_files at its edges: .npy headers of any length, a URL's file read as the local one
# ---------------------


def test_npy_headers_longer_than_the_first_read_are_read_whole_and_format_3_is_refused(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    # 4614 bytes of header: past NPY_PEEK, and its length read big-endian (0x0612) would not be
    text = "{'descr': '<u2', 'fortran_order': False, 'shape': (100,), }".ljust(4613) + "\n"
    # the header's length in 2 bytes (format 1.0) or 4 (2.0)
    for version, width in ((1, 2), (2, 4)):
        path = tmp_path / f"long_{version}.npy"
        path.write_bytes(
            b"\x93NUMPY"
            + bytes([version, 0])
            + len(text).to_bytes(width, "little")
            + text.encode()
            + tokens.tobytes()
        )
        np.testing.assert_array_equal(np.load(path), tokens)  # a good file, as numpy reads it
        np.testing.assert_array_equal(
            token_file(str(path), "npy").read([0, 90], 10), [tokens[:10], tokens[90:]]
        )
    with open(tmp_path / "v3.npy", "wb") as f:
        np.lib.format.write_array(f, tokens, version=(3, 0))
    with pytest.raises(
        RunStopped, match=r"has a bad .npy header \(unsupported .npy format version \(3, 0\)\)"
    ):
        token_file(str(tmp_path / "v3.npy"), "npy")
    # 1-byte tokens, cut to the bare header under the run
    np.save(tmp_path / "bytes.npy", tokens.astype(np.uint8))
    loader = ShardLoader([str(tmp_path / "bytes.npy")], block_size=10, rows=1, seed=0)
    loader.next(1)
    os.truncate(tmp_path / "bytes.npy", 128)  # np.save's header of a 1-D array
    with pytest.raises(
        RunStopped, match=r"changed while the run read it \(now 0 tokens, was 100\)"
    ):
        loader.next(1)


@pytest.fixture
def at_url(tmp_path):
    """A folder at a memory:// URL: fsspec's store in this process, read by the URL reader's
    code."""
    url = f"memory://nanogpt-tests/{tmp_path.name}"
    yield url
    storage.remove(url, recursive=True)


def test_a_url_file_reads_the_local_files_tokens_by_ranges_of_its_windows_only(
    tmp_path, at_url, monkeypatch
):
    # 600 KB: > 2 x MERGE_GAP
    tokens = np.random.default_rng(0).integers(0, 2**16, 300_000, dtype=np.uint16)
    np.save(tmp_path / "a.npy", tokens)
    write_datafile(tmp_path / "a_llmc.bin", tokens)
    tokens.tofile(tmp_path / "a.bin")
    # what the URL reader asks the store for
    reads, ranges, whole_below = [], [], token_files.WHOLE_BELOW
    read_bytes, read_ranges = storage.read_bytes, storage.read_ranges
    monkeypatch.setattr(storage, "read_bytes", lambda p, *a: reads.append(a) or read_bytes(p, *a))
    monkeypatch.setattr(
        storage,
        "read_ranges",
        lambda p, s, e: ranges.append([b - a for a, b in zip(s, e)]) or read_ranges(p, s, e),
    )
    # two windows together, two far apart, the last at the very end
    n, starts = 16, [0, 5, 150_000, 300_000 - 16]
    headers = {
        "raw": [],
        "npy": [(0, token_files.NPY_PEEK)],
        "llmc": [(0, token_files.LLMC_HEADER)],
    }
    for name, layout, whole in [
        ("a.bin", "raw", True),
        ("a.bin", "raw", False),
        ("a.npy", "npy", False),
        ("a_llmc.bin", "llmc", False),
    ]:
        storage.write_bytes(f"{at_url}/{name}", (tmp_path / name).read_bytes())
        monkeypatch.setattr(token_files, "WHOLE_BELOW", whole_below if whole else 0)
        reads.clear(), ranges.clear()
        url, local = (
            token_file(f"{at_url}/{name}", layout),
            token_file(str(tmp_path / name), layout),
        )
        # the whole small file, or a header: no more
        assert reads == ([()] if whole else headers[layout])
        np.testing.assert_array_equal(url.read(starts, n), local.read(starts, n))
        assert url.read([], n).shape == (0, n) and url.read(starts, 0).shape == (4, 0)
        # windows closer than MERGE_GAP: one range
        assert ranges == ([] if whole else [[42, 32, 32]])
    monkeypatch.setattr(token_files, "WHOLE_BELOW", whole_below)
    with pytest.raises(RunStopped) as stop:  # held whole: a window past its end
        token_file(f"{at_url}/a.bin").read([300_000 - 15], 16)
    assert str(stop.value) == f"{at_url}/a.bin has no 16 tokens from token 299985: {FIX}"
    # the store answers short
    monkeypatch.setattr(storage, "read_ranges", lambda p, s, e: [b"" for _ in s])
    with pytest.raises(RunStopped) as stop:
        token_file(f"{at_url}/a.npy", "npy").read([0], 4)
    assert (
        str(stop.value) == f"{at_url}/a.npy came back short from the store, though unchanged: {FIX}"
    )
    reads.clear()
    storage.write_bytes(f"{at_url}/not.npy", b"tokens, not a .npy" + bytes(5000))
    with pytest.raises(RunStopped, match="the magic string is not correct"):
        token_file(f"{at_url}/not.npy", "npy")
    assert reads == [(0, token_files.NPY_PEEK)]  # no header length read from a file that is no .npy
    storage.write_bytes(f"{at_url}/empty.npy", b"")
    with pytest.raises(
        RunStopped, match=r"bad .npy header \(EOF: reading magic string, expected 8 bytes got 0\)"
    ):
        token_file(f"{at_url}/empty.npy", "npy")
