"""data/chat/prepare.py: the chat tasks downloaded as nanochat's load_hub_dataset downloads them
(the hub's listing of a split's parquet shards, then each shard, the manifest last), tested against
a server on loopback; --toy's offline rows read by chat_sft's mixture.

    python -m pytest tests/test_chat_prepare.py -q
"""

import http.server
import io
import json
import os
import threading
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import prepare_script

from configurator import RunStopped
from dataio import parquet_shards, task_folder


def parquet_bytes(rows):
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


class Hub(http.server.ThreadingHTTPServer):
    """The hub's listing API and its parquet files on loopback. fail_first: path -> 503s first."""

    def __init__(self, splits):
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.files, self.fail_first, self.requests = {}, {}, []
        for dataset, subset, split in splits:
            names = [f"/files/{dataset}/{subset}/{split}/{i}.parquet" for i in range(2)]
            for i, name in enumerate(names):
                self.files[name] = parquet_bytes([{"question": f"{split} {i}", "n": i}])
            listing = f"/api/{dataset}/parquet/{subset}/{split}"
            self.files[listing] = json.dumps([self.url + n for n in names]).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        hub = self.server
        hub.requests.append(self.path)
        if hub.fail_first.get(self.path, 0) > 0:
            hub.fail_first[self.path] -= 1
            return self.send_error(503)
        if self.path not in hub.files:
            return self.send_error(404)
        body = hub.files[self.path]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def prepare():
    return prepare_script("chat")


@pytest.fixture
def hub(prepare, monkeypatch):
    monkeypatch.setattr(parquet_shards, "time", SimpleNamespace(sleep=lambda s: None))
    server = Hub(prepare.SPLITS)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_each_split_lands_whole_in_nanochats_cache_layout(prepare, hub, tmp_path):
    first = "/files/openai/gsm8k/main/train/1.parquet"
    hub.fail_first[first] = 1  # a failure, then the retry
    assert prepare.main([f"--dir={tmp_path}", f"--api={hub.url}/api"]) == 0
    for dataset, subset, split in prepare.SPLITS:
        folder = prepare.split_folder(str(tmp_path), dataset, subset, split)
        with open(os.path.join(folder, "manifest.json")) as f:
            assert json.load(f) == ["00000.parquet", "00001.parquet"]
        name = f"/files/{dataset}/{subset}/{split}/1.parquet"
        assert open(os.path.join(folder, "00001.parquet"), "rb").read() == hub.files[name]
    assert hub.requests.count(first) == 2
    before = len(hub.requests)
    assert prepare.main([f"--dir={tmp_path}", f"--api={hub.url}/api"]) == 0
    assert len(hub.requests) == before  # every split there already: nothing fetched


def test_a_split_that_fails_leaves_no_manifest_and_the_run_says_so(prepare, hub, tmp_path):
    shard = "/files/cais/mmlu/all/test/0.parquet"
    hub.fail_first[shard] = 99
    with pytest.raises(RunStopped, match=r"1 failed to download \(cais/mmlu all/test\)"):
        prepare.main([f"--dir={tmp_path}", f"--api={hub.url}/api", "--attempts=2"])
    folder = prepare.split_folder(str(tmp_path), "cais/mmlu", "all", "test")
    assert not os.path.exists(os.path.join(folder, "manifest.json"))
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]
    hub.fail_first[shard] = 0  # the rerun fetches what is missing
    assert prepare.main([f"--dir={tmp_path}", f"--api={hub.url}/api"]) == 0


def test_toy_rows_are_what_chat_sfts_mixture_reads(prepare, tmp_path):
    assert prepare.main([f"--dir={tmp_path}", "--toy"]) == 0
    mix = {"identity_epochs": 0, "simple_spelling": 0, "spelling_bee": 0}
    train, val = task_folder.sft_mixtures(str(tmp_path), mmlu_epochs=1, gsm8k_epochs=1, **mix)
    assert len(train) == sum(prepare.TOY_ROWS.values()) and len(val) == 8 + 5200 + 420
    parts = [m["content"] for c in train for m in c["messages"] if isinstance(m["content"], list)]
    assert any(part["type"] == "python" for content in parts for part in content)
