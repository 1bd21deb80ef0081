"""
The token files' formats, read locally or by ranged reads from a URL (gs://bucket/folder, any fsspec
URL): nanoGPT's raw uint16 `.bin`, build-nanogpt's `.npy` shards and llm.c's `.bin` shards (a
256-int32 header, then uint16 tokens). A loader asks a TokenFile for windows of tokens; `token_file`
opens the one that reads where the file is. Neither kind maps the file nor downloads it whole, and
both stop the run with one line naming the file (RunStopped) when it changes under the run.
"""

import io
import os
import weakref
from bisect import bisect_right

import numpy as np

from configurator import RunStopped, UsageError
from dataio import storage

LLMC_MAGIC, LLMC_VERSION = 20240520, 1  # llm.c's write_datafile; version 1: uint16 tokens
LLMC_HEADER = 256 * 4  # bytes: 256 int32 (magic, version, token count, then zeros)
# the record's cached FineWeb10B shards
RECORD_PREPARE = os.path.join("data", "fineweb10B", "prepare.py")
# bytes read for a .npy header, in one read where it fits (np.save writes 128 for 1-D arrays)
NPY_PEEK = 4096
# Windows of a URL's file closer than this are read as one range: a request's latency (tens of ms on
# Cloud Storage) costs more than the gap's bytes
MERGE_GAP = 256 * 1024
# a raw train.bin/val.bin at a URL up to this size is read whole once (nanoGPT's shakespeare_char: 2
# MB): its random windows would otherwise cost requests every batch, on a CPU run whose step is a
# few ms
WHOLE_BELOW = 64 * 2**20


def prepare_hint(data_dir, bin_shards=False):
    """The command that writes data_dir's tokens: its own prepare.py where it has one
    (data/fineweb10B/ does). A URL folder is not asked (its tokens are written locally, then copied
    there): the hint is by its name."""
    url = storage.is_url(data_dir)
    name = (
        data_dir.rstrip("/").rsplit("/", 1)[-1]
        if url
        else os.path.basename(os.path.normpath(data_dir))
    )
    script = (
        os.path.join("data", name, "prepare.py") if url else os.path.join(data_dir, "prepare.py")
    )
    if url or not os.path.exists(script):
        if bin_shards:
            return f"python {RECORD_PREPARE}"
        if "fineweb" in name:
            return "python fineweb.py"
    return f"python {script}"


def llmc_fault(header, size):
    """What is wrong with an llm.c `.bin` shard of `size` bytes that begins with `header` (bytes);
    None if nothing. The record asserts the magic and the version, and that the tokens it reads are
    the count the header declares."""
    if len(header) < LLMC_HEADER:
        return (
            f"holds {size} bytes, fewer than the {LLMC_HEADER}-byte header of an llm.c token shard"
        )
    magic, version, count = np.frombuffer(header[:12], "<i4").tolist()
    if magic != LLMC_MAGIC:
        return f"has magic number {magic}, not llm.c's {LLMC_MAGIC}: not an llm.c token shard"
    if version != LLMC_VERSION:
        return f"has version {version}: only version {LLMC_VERSION} (uint16 tokens) is read"
    body = size - LLMC_HEADER
    if body % 2:
        return f"holds {body} bytes after its header, not whole uint16 tokens"
    if body // 2 != count:
        return (
            f"is truncated (it holds {body // 2} of the {count} tokens its header declares)"
            if body // 2 < count
            else f"holds {body // 2} tokens, more than the {count} its header declares"
        )
    return None


def llmc_counts(paths):
    """The token counts of llm.c `.bin` shards, each header and size checked first (the record's
    _peek_data_shard and _load_data_shard's asserts): a UsageError naming the file otherwise. From a
    URL the headers come in one batch of concurrent ranged reads, the sizes from the listing that
    found the shards."""
    sizes = [storage.size(p) for p in paths]
    headers = (
        storage.read_ranges(paths, [0] * len(paths), [min(s, LLMC_HEADER) for s in sizes])
        if paths
        else []
    )
    for path, header, size in zip(paths, headers, sizes):
        what = llmc_fault(header, size)
        if what:
            raise UsageError(
                f"{path} {what}: rerun `{prepare_hint(storage.dirname(path), bin_shards=True)}`"
            )
    return [int(np.frombuffer(h[:12], "<i4")[2]) for h in headers]


def stopped(path, what):
    """What a run says when a data file goes wrong under it: one line, with the fix."""
    return RunStopped(
        f"{path} {what}: the run stopped; restore the file and resume with --init_from=resume"
    )


def token_file(path, layout="raw"):
    """The tokens of the file at `path`, local or a URL; layout "raw", "npy" or "llmc"
    (TokenFile)."""
    return (URLTokenFile if storage.is_url(path) else TokenFile)(path, layout)


class TokenFile:
    """The tokens of a `.bin` (layout "raw": uint16, nanoGPT), a `.npy` ("npy": after its header) or
    an llm.c `.bin` shard ("llmc": uint16 after a 256-int32 header), read with pread on a descriptor
    opened once. No memory map: a mapped file that shrinks kills the process with SIGBUS and no
    message. Here a file that changed since it was opened (its size or mtime, checked by `check`,
    once per batch) or a read that comes back short stops the run with one line (RunStopped). A file
    deleted, or replaced by a rename, after it was opened is no fault: the descriptor still reads
    the data the run started with."""

    def __init__(self, path, layout="raw"):
        self.path = path
        self._open()
        # (size, version): an mtime here, an object's generation at a URL
        self._opened = self._stat()
        size = self._opened[0]
        if layout == "npy":
            self.offset, self.dtype, self.count = self._npy_layout(size)
        elif layout == "llmc":
            what = llmc_fault(self._pread(0, LLMC_HEADER), size)
            if what:
                raise stopped(path, what)
            self.offset, self.dtype, self.count = (
                LLMC_HEADER,
                np.dtype(np.uint16),
                (size - LLMC_HEADER) // 2,
            )
        else:
            self.offset, self.dtype, self.count = 0, np.dtype(np.uint16), size // 2

    def _open(self):
        self.fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def _stat(self):
        stat = os.fstat(self.fd)
        return stat.st_size, stat.st_mtime_ns

    def _pread(self, start, n):
        return os.pread(self.fd, n, start)

    def _npy_layout(self, size):
        """(data offset, dtype, token count) from the header; np.load's checks, worded as
        RunStopped."""
        head = self._pread(0, NPY_PEEK)
        if head[:6] == b"\x93NUMPY" and len(head) >= 12:  # a longer header: read it whole
            # bytes of the header's length: 2 in format 1.0, 4 after
            width = 2 if head[6] == 1 else 4
            need = 8 + width + int.from_bytes(head[8 : 8 + width], "little")
            head = self._pread(0, need) if need > len(head) else head
        readers = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }
        f = io.BytesIO(head)
        try:
            version = np.lib.format.read_magic(f)
            if version not in readers:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, _, dtype = readers[version](f)
        except ValueError as e:
            raise stopped(self.path, f"has a bad .npy header ({str(e).splitlines()[0]})") from None
        offset = f.tell()
        if len(shape) != 1 or dtype.kind not in "iu":
            raise stopped(self.path, f"holds a {dtype} array of shape {shape}, not 1-D token ids")
        if size < offset + shape[0] * dtype.itemsize:
            raise stopped(
                self.path,
                f"is truncated (it holds {(size - offset) // dtype.itemsize} of the "
                f"{shape[0]} tokens its header declares)",
            )
        return offset, dtype, shape[0]

    def _changed(self, size):
        now, was = (
            (max(0, s - self.offset) // self.dtype.itemsize) for s in (size, self._opened[0])
        )
        what = f"now {now} tokens, was {was}" if now != was else "rewritten in place"
        return stopped(self.path, f"changed while the run read it ({what})")

    def check(self):
        """Once per batch (one fstat): RunStopped if the size or mtime is not what it was at the
        open."""
        stat = os.fstat(self.fd)
        if (stat.st_size, stat.st_mtime_ns) != self._opened:
            raise self._changed(stat.st_size)

    def read(self, starts, n):
        """(len(starts), n) tokens: n from each start (a list of ints), one pread each."""
        # locals: once per window
        fd, offset, itemsize, pread = self.fd, self.offset, self.dtype.itemsize, os.pread
        buf = b"".join([pread(fd, n * itemsize, offset + start * itemsize) for start in starts])
        if len(buf) != len(starts) * n * itemsize:  # the file shrank since check()
            raise self._changed(os.fstat(self.fd).st_size)
        return np.frombuffer(buf, self.dtype).reshape(len(starts), n)


class URLTokenFile(TokenFile):
    """A TokenFile at a URL, by ranged reads: a batch's windows in one set of concurrent requests
    (those less than MERGE_GAP apart as one range), then one metadata request that checks the object
    is still the one opened (its size and generation: Cloud Storage gives every write of an object a
    new one), so every token a read returns is the opened object's. An object store keeps no
    descriptor open: one deleted or rewritten under the run stops it (RunStopped) at the read that
    meets it. A small raw file (WHOLE_BELOW) is read whole once instead, and keeps giving the data
    the run started with, as a local file renamed over does."""

    def __init__(self, path, layout="raw"):
        self.whole = None  # the object's bytes, when small and raw (WHOLE_BELOW)
        super().__init__(path, layout)
        if layout == "raw" and self._opened[0] <= WHOLE_BELOW:
            whole = storage.read_bytes(path)
            self._verify()  # what was read whole is the object opened
            self.whole = whole

    def _open(self):
        pass  # nothing held: each read names the object

    def _stat(self):
        return storage.stat(self.path)

    def _pread(self, start, n):
        end = min(start + n, self._opened[0])
        return storage.read_bytes(self.path, start, end) if end > start else b""

    def check(self):
        """Nothing to do before a batch: each read checks the object after it (_verify)."""

    def _verify(self):
        """RunStopped unless the object is the one opened, as it was."""
        try:
            now = storage.stat(self.path)
        except FileNotFoundError:
            raise stopped(self.path, "is gone (deleted while the run read it)") from None
        if now != self._opened:
            raise self._changed(now[0])

    def read(self, starts, n):
        """(len(starts), n) tokens: n from each start (a list of ints); bit for bit what TokenFile
        reads."""
        out = np.empty((len(starts), n), self.dtype)
        if not starts or not n:
            return out
        width, itemsize = n * self.dtype.itemsize, self.dtype.itemsize
        firsts = [self.offset + start * itemsize for start in starts]  # each window's first byte
        # held whole since it was opened: the data the run started with, no request
        if self.whole is not None:
            if max(firsts) + width > len(self.whole):
                raise stopped(self.path, f"has no {n} tokens from token {max(starts)}")
            for i, b in enumerate(firsts):
                out[i] = np.frombuffer(self.whole, self.dtype, n, b)
            return out
        spans = []  # [first byte, end) of each range read
        for b in sorted(set(firsts)):
            if spans and b <= spans[-1][1] + MERGE_GAP:
                spans[-1][1] = b + width
            else:
                spans.append([b, b + width])
        try:
            blobs = storage.read_ranges(
                [self.path] * len(spans), [s for s, _ in spans], [e for _, e in spans]
            )
        except (UsageError, RunStopped):
            raise
        # the object gone, or shorter than a range asks (Cloud Storage's 416): which, in one line
        except Exception:
            self._verify()
            raise
        self._verify()
        # unchanged, yet a range came back short
        if any(len(blob) != e - s for blob, (s, e) in zip(blobs, spans)):
            raise stopped(self.path, "came back short from the store, though unchanged")
        span_firsts = [s for s, _ in spans]
        for i, b in enumerate(firsts):
            k = bisect_right(span_firsts, b) - 1
            out[i] = np.frombuffer(blobs[k], self.dtype, n, b - span_firsts[k])
        return out
