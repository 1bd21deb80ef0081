"""python -m pytest tests/test_parquet_shards.py -q

nanochat's pretraining shards (dataio/parquet_shards.py) and data/nanochat/prepare.py: a folder's
shards sorted, the last the val split, read a row group at a time, split across ranks and resumed
after a position as nanochat's dataloader resumes, locally and on gs:// (the emulator); the download
against an HTTP server on 127.0.0.1 that the test runs: retried with nanochat's backoff after a
failure, a body cut short never left as a shard, nor one a killed download was writing; then
prepare.py downloads the shards and trains the tokenizer on the train shards alone. A missing,
empty or broken folder and a bad flag are one line."""

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import REPO, exit_line, prepare_script

from configurator import InputNotFound, UsageError
from dataio import parquet_shards, storage
from dataio.chat_tokenizer import ChatTokenizer
from dataio.parquet_shards import (
    MAX_SHARD,
    download_shard,
    download_shards,
    list_shards,
    row_groups,
    shard_name,
)

GROUPS, ROWS = 3, 4  # row groups a shard, documents a row group


def shard_texts(shard):
    """The documents of a shard, each naming where it is, with words enough to merge."""
    return [
        f"shard {shard} group {i // ROWS} doc {i % ROWS}: the cat sat on the mat {shard * i} times"
        for i in range(GROUPS * ROWS)
    ]


def shard_bytes(shard, tmp_path):
    path = tmp_path / f"build_{shard}.parquet"
    pq.write_table(pa.table({"text": shard_texts(shard)}), path, row_group_size=ROWS)
    return path.read_bytes()


@pytest.fixture
def folder(tmp_path):
    """Shards 0, 1, 2 and the val shard, written as nanochat's are named; and files that are not
    shards (a download's .tmp, another file)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in (2, 0, MAX_SHARD, 1):
        (shards / shard_name(i)).write_bytes(shard_bytes(i, tmp_path))
    (shards / f"{shard_name(3)}.tmp").write_bytes(b"partial")
    (shards / "README").write_text("not a shard")
    return str(shards)


def test_shards_are_sorted_and_the_last_is_val(folder):
    assert [os.path.basename(p) for p in list_shards(folder)] == [
        shard_name(i) for i in (0, 1, 2, MAX_SHARD)
    ]
    val = list(row_groups(folder, "val"))
    assert [position for _, position in val] == [(0, g) for g in range(GROUPS)]
    assert sum((texts for texts, _ in val), []) == shard_texts(MAX_SHARD)
    train = list(row_groups(folder, "train"))
    assert [p for _, p in train] == [(s, g) for s in range(3) for g in range(GROUPS)]
    assert sum((t for t, _ in train), []) == sum(map(shard_texts, range(3)), [])
    assert list(parquet_shards.texts(folder, "train")) == sum(map(shard_texts, range(3)), [])


@pytest.mark.parametrize("world_size", [1, 2])
def test_ranks_split_the_row_groups_and_resume_after_a_position(folder, world_size):
    everything = list(row_groups(folder, "train"))
    per_rank = [list(row_groups(folder, "train", rank=r, world_size=world_size)) for r in range(2)]
    for rank in range(world_size):  # nanochat's start=rank, step=world_size in each shard
        assert per_rank[rank] == [x for x in everything if x[1][1] % world_size == rank]
    for rank in range(world_size):
        mine = per_rank[rank]
        for i, (_, position) in enumerate(mine):
            resumed = list(
                row_groups(folder, "train", after=position, rank=rank, world_size=world_size)
            )
            assert resumed == mine[i + 1 :], (rank, position)


def test_a_missing_empty_or_broken_folder_is_one_line(folder, tmp_path):
    with pytest.raises(InputNotFound, match=r"^no shards folder .*nowhere: download some with"):
        list_shards(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputNotFound, match=r"empty holds no \*\.parquet shards: download some"):
        list_shards(str(tmp_path / "empty"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / shard_name(0)).write_bytes(shard_bytes(0, tmp_path))
    assert len(list(row_groups(str(tmp_path / "one"), "val"))) == GROUPS
    with pytest.raises(InputNotFound, match=r"only one shard .*the last is the val split"):
        next(row_groups(str(tmp_path / "one"), "train"))
    with pytest.raises(UsageError, match="split='test': it is 'train' or 'val'"):
        next(row_groups(folder, "test"))
    broken = os.path.join(folder, shard_name(1))
    with open(broken, "r+b") as f:
        f.truncate(100)
    with pytest.raises(UsageError, match=f"^{broken} is not a parquet shard .*: delete it and"):
        list(row_groups(folder, "train"))
    pq.write_table(pa.table({"body": ["x"]}), broken)
    with pytest.raises(UsageError, match=f"^{broken} row group 0 has no readable text column"):
        list(row_groups(folder, "train"))


def test_shards_on_cloud_storage_read_as_local_ones(folder, gcs_dir):
    for path in list_shards(folder):
        storage.write_bytes(storage.join(gcs_dir, os.path.basename(path)), open(path, "rb").read())
    remote = list_shards(gcs_dir)
    assert remote == [storage.join(gcs_dir, os.path.basename(p)) for p in list_shards(folder)]
    for split in ("train", "val"):
        assert list(row_groups(gcs_dir, split, after=(0, 1))) == list(
            row_groups(folder, split, after=(0, 1))
        )


class ShardServer(http.server.ThreadingHTTPServer):
    """The shards of `files` (name -> bytes) over HTTP on loopback. `fail_first`: name -> how many
    requests get a 503 first; `cut`: names whose body stops halfway (with its Content-Length:
    IncompleteRead; without: a body that is not parquet); `stall`: names whose body waits on the
    event halfway."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), ShardHandler)
        self.files, self.fail_first, self.cut, self.stall = {}, {}, {}, {}
        self.requests = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}/data"


class ShardHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        server, name = self.server, self.path.rsplit("/", 1)[-1]
        server.requests.append(name)
        if name not in server.files:
            return self.send_error(404)
        if server.fail_first.get(name, 0) > 0:
            server.fail_first[name] -= 1
            return self.send_error(503)
        body = server.files[name]
        self.send_response(200)
        if server.cut.get(name) != "no length":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if name in server.cut or name in server.stall:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            if name in server.stall:
                server.stall[name].wait(30)
            self.close_connection = True
            return
        self.wfile.write(body)


@pytest.fixture
def server(tmp_path):
    server = ShardServer()
    for i in (0, 1, MAX_SHARD):
        server.files[shard_name(i)] = shard_bytes(i, tmp_path)
    # shutdown() waits out serve_forever's poll (0.5 s by default) at each test's end
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield server
    for event in server.stall.values():
        event.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def sleeps(monkeypatch):
    """The waits between attempts, recorded instead of slept."""
    waits = []
    monkeypatch.setattr(parquet_shards, "time", SimpleNamespace(sleep=waits.append))
    return waits


def test_download_writes_the_shard_and_keeps_one_that_is_there(server, tmp_path, sleeps):
    out = tmp_path / "out"
    assert download_shards([0, MAX_SHARD], str(out), workers=2, base_url=server.url) == []
    for i in (0, MAX_SHARD):
        assert (out / shard_name(i)).read_bytes() == server.files[shard_name(i)]
    assert sorted(os.listdir(out)) == [shard_name(0), shard_name(MAX_SHARD)]
    assert (
        download_shard(0, str(out), base_url=server.url)
        and server.requests.count(shard_name(0)) == 1
    )


def test_download_retries_with_backoff_after_a_failure(server, tmp_path, sleeps, capsys):
    server.fail_first[shard_name(1)] = 1
    assert download_shard(1, str(tmp_path), base_url=server.url)
    assert (tmp_path / shard_name(1)).read_bytes() == server.files[shard_name(1)]
    assert server.requests == [shard_name(1)] * 2 and sleeps == [2.0]  # nanochat's 2**attempt s
    assert "attempt 1/5 failed: HTTP Error 503" in capsys.readouterr().out
    # never served: five attempts, waits of 2, 4, 8, 16 s, then False, and no file
    assert not download_shard(5, str(tmp_path), base_url=server.url)
    assert sleeps[1:] == [2.0, 4.0, 8.0, 16.0] and server.requests.count(shard_name(5)) == 5


@pytest.mark.parametrize("cut", ["with length", "no length"])
def test_a_body_cut_short_leaves_no_partial_file(server, tmp_path, sleeps, cut):
    server.cut[shard_name(0)] = cut
    assert download_shards([0, 1], str(tmp_path / "out"), base_url=server.url, attempts=2) == [0]
    assert os.listdir(tmp_path / "out") == [shard_name(1)]
    assert server.requests.count(shard_name(0)) == 2 and sleeps == [2.0]


def test_a_download_killed_midway_leaves_no_shard(server, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    server.stall[shard_name(0)] = threading.Event()
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from dataio.parquet_shards import download_shard\n"
        "download_shard(0, sys.argv[2], base_url=sys.argv[3])"
    )
    child = subprocess.Popen([sys.executable, "-c", script, REPO, str(out), server.url])
    partial = out / f"{shard_name(0)}.tmp"
    deadline = time.time() + 20
    while not (server.requests and partial.exists()) and time.time() < deadline:
        time.sleep(0.05)
    assert partial.exists(), "the download never began writing"
    os.kill(child.pid, signal.SIGKILL)  # a crash: no handler runs
    child.wait()
    assert os.listdir(out) == [partial.name]
    with pytest.raises(InputNotFound, match=r"holds no \*\.parquet shards"):
        list_shards(str(out))  # what it left is no shard, to nanochat's listing nor ours
    del server.stall[shard_name(0)]
    assert download_shard(0, str(out), base_url=server.url)  # the rerun writes it whole
    assert os.listdir(out) == [shard_name(0)]
    assert (out / shard_name(0)).read_bytes() == server.files[shard_name(0)]


@pytest.fixture(scope="module")
def prepare():
    return prepare_script("nanochat")


def test_prepare_downloads_and_trains_on_the_train_shards(prepare, server, tmp_path, capsys):
    shards, tokenizer = tmp_path / "shards", tmp_path / "tok"
    argv = [f"--dir={shards}", f"--tokenizer_dir={tokenizer}", "--vocab_size=300"]
    assert prepare.main(["--shards=2", f"--base_url={server.url}", *argv]) == 0
    assert sorted(os.listdir(shards)) == [shard_name(i) for i in (0, 1, MAX_SHARD)]
    out = capsys.readouterr().out
    assert "downloading 3 shards" in out and "training a 300-id tokenizer on 2 train shards" in out
    trained = ChatTokenizer.from_directory(str(tokenizer))
    # the train shards, in order; the val shard's text is never trained on
    expected = ChatTokenizer.train(iter(shard_texts(0) + shard_texts(1)), 300)
    assert trained.enc._mergeable_ranks == expected.enc._mergeable_ranks
    assert sorted(os.listdir(tokenizer)) == ["token_bytes.pt", "tokenizer.pkl"]
    # --tokenizer_only downloads nothing: no server is asked
    asked = len(server.requests)
    capped = ["--tokenizer_only", "--max_chars=100", "--doc_cap=10", *argv]
    assert prepare.main(capped) == 0 and len(server.requests) == asked
    short = ChatTokenizer.train(iter(shard_texts(0) + shard_texts(1)), 300, 10, 100)
    assert ChatTokenizer.from_directory(str(tokenizer)).enc._mergeable_ranks == (
        short.enc._mergeable_ranks
    )


def test_prepare_says_what_is_wrong_in_one_line(prepare, server, tmp_path, capsys, sleeps):
    def line(*argv):
        return exit_line(lambda: prepare.main(list(argv)), capsys)

    empty = f"--dir={tmp_path / 'none'}"
    assert line("--tokenizer_only", empty) == (
        2,
        f"error: no shards folder {tmp_path / 'none'}: download some with python "
        "data/nanochat/prepare.py",
    )
    code, text = line("--tokenizer_only", empty, "--vocab_size=100")
    assert code == 2 and text.startswith("error: vocab_size=100 leaves 91 ids")
    assert line("--shards=0", empty) == (2, "error: --shards=0: give at least 1 train shard")
    assert line("--max_chars=0", empty) == (2, "error: --max_chars=0: give at least 1")
    code, text = line("--shards=3", empty, f"--base_url={server.url}")  # shard 2 is not served
    assert code == 1 and text == (
        "error: 1 of 4 shards failed to download (shard_00002.parquet): rerun to fetch them (the "
        "others are kept)"
    )


def nanochat_modules(tmp_path, monkeypatch):
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own dataset.py needs its checkout")
    monkeypatch.syspath_prepend(checkout)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))  # read when it is imported
    from nanochat import dataloader, dataset

    return dataset, dataloader


@pytest.mark.parametrize("world_size", [1, 2])
def test_nanochats_own_reading_and_download_agree(
    folder, server, tmp_path, monkeypatch, world_size
):
    dataset, dataloader = nanochat_modules(tmp_path, monkeypatch)
    monkeypatch.setattr(dataset, "DATA_DIR", folder)
    assert dataset.list_parquet_files() == list_shards(folder)
    for split in ("train", "val"):
        for rank in range(world_size):
            theirs = list(dataset.parquets_iter_batched(split, start=rank, step=world_size))
            ours = row_groups(folder, split, rank=rank, world_size=world_size)
            assert theirs == [texts for texts, _ in ours]
    # their dataloader's resume, from each position a pass yields, for each rank
    for rank in range(world_size):
        dist = (world_size > 1, rank, rank, world_size)
        monkeypatch.setattr(dataloader, "get_dist_info", lambda: dist)
        mine = [p for _, p in row_groups(folder, "train", rank=rank, world_size=world_size)]
        for position in mine[:-1]:
            resume = {"pq_idx": position[0], "rg_idx": position[1], "epoch": 1}
            ours = list(
                row_groups(folder, "train", after=position, rank=rank, world_size=world_size)
            )
            batches = dataloader._document_batches("train", resume, tokenizer_batch_size=ROWS)
            theirs = [next(batches) for _ in ours]
            assert [(t, (s, g)) for t, (s, g, _) in theirs] == ours, (rank, position)
    # their download, from the same server: the same file where ours puts it
    monkeypatch.setattr(dataset, "BASE_URL", server.url)
    monkeypatch.setattr(dataset, "DATA_DIR", str(tmp_path / "theirs"))
    os.makedirs(dataset.DATA_DIR)
    assert dataset.download_single_file(1)
    os.makedirs(tmp_path / "ours")
    assert download_shard(1, str(tmp_path / "ours"), base_url=server.url)
    assert os.listdir(tmp_path / "theirs") == os.listdir(tmp_path / "ours") == [shard_name(1)]
    assert (tmp_path / "theirs" / shard_name(1)).read_bytes() == server.files[shard_name(1)]
    assert (tmp_path / "ours" / shard_name(1)).read_bytes() == server.files[shard_name(1)]
