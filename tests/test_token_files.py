"""python -m pytest tests/test_token_files.py -q

token_files at its edges, for every format: .npy headers of any length (format 3 refused, a file
cut to its bare header under the run), and a file at a URL (fsspec's memory:// store here;
test_gcs_data.py has Cloud Storage's) giving the local file's tokens by ranged reads of its windows
only; a window past its end, a short answer from the store, a file that is no .npy: one line
each."""

import os

import numpy as np
import pytest
from helpers import FIX

from configurator import RunStopped
from dataio import storage, token_files
from dataio.dataloader import ShardLoader
from dataio.token_files import token_file
from parity.check_speedrun import write_datafile


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
