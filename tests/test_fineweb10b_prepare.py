"""python -m pytest tests/test_fineweb10b_prepare.py -q

data/fineweb10B/prepare.py, the record's llm.c `.bin` shards: it links them from --local (a copy
across filesystems), skips the complete ones and fetches a broken one again, refuses a missing or
bad local shard in one line, downloads the record's files from the HF hub, and says what to do
offline (the loader of these shards: test_bin_shards.py)."""

import os

import numpy as np
import pytest
from helpers import exit_line, prepare_script, write_shards

from dataio.dataloader import BinShardLoader, make_loader
from parity.check_speedrun import write_datafile


@pytest.fixture(scope="module")
def prepare():
    return prepare_script("fineweb10B")


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

    code, line = exit_line(
        lambda: prepare.main(["--num_chunks=4", f"--local={src}", f"--out_dir={out}"]), capsys
    )
    assert (code, line) == (2, f"error: --local {src} holds no fineweb_train_000004.bin")
    write_datafile(src / "fineweb_train_000003.bin", [1, 2], version=7)
    code, line = exit_line(
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
    code, line = exit_line(
        lambda: prepare.main(["--num_chunks=2", f"--out_dir={tmp_path}"]), capsys
    )
    assert (code, line) == (
        2,
        "error: could not download fineweb_train_000002.bin from the HF hub dataset "
        "kjj0/fineweb10B-gpt2 (LocalEntryNotFoundError); offline? link the shards from a local "
        "directory with --local DIR",
    )
