"""
The data loaders. Each step reads one *global* batch of token windows, (accum, rows, T) with rows =
batch_size * device_count, and each process materializes only its own rows. The global batch depends on
(seed, position) alone, never on how many processes or devices there are, so 1 device, 8 devices and
2 hosts x 4 devices train on the same tokens.

- BinLoader (nanoGPT): random windows from a uint16 `{split}.bin`.
- ShardLoader (build-nanogpt): sequential over sorted uint16 `*{split}*.npy` shards.
- BinShardLoader (llm.c, modded-nanogpt's speedrun): sequential over sorted `*_{split}_*.bin` shards (a 256-int32
  header, then uint16 tokens), as the record's DistributedDataLoader reads them.
All read through TokenFile (pread, no memory map). Their state (`state_dict()`) goes into the checkpoint so
that resume neither skips nor repeats data. Prefetcher reads the training batches on a background thread, ahead
of the step.
"""

import glob
import os
import queue
import threading
import weakref

import numpy as np

from configurator import InputNotFound, RunStopped, UsageError
from tokenizer import read_vocab, vocab_file


def check_ids(tokens, vocab_size, where):
    """Ids the model has no embedding for would turn into NaN (jnp.take fills), far from their cause."""
    if vocab_size is not None and tokens.size and tokens.max() >= vocab_size:
        raise UsageError(f"{where} holds token id {tokens.max()}, outside the model's vocabulary (vocab_size "
                         f"{vocab_size}): set --vocab_size, or prepare the data with the model's tokenizer")


LLMC_MAGIC, LLMC_VERSION = 20240520, 1  # llm.c's write_datafile; version 1: uint16 tokens
LLMC_HEADER = 256 * 4  # bytes: 256 int32 (magic, version, token count, then zeros)
RECORD_PREPARE = os.path.join("data", "fineweb10B", "prepare.py")  # the record's cached FineWeb10B shards


def prepare_hint(data_dir, bin_shards=False):
    """The command that writes data_dir's tokens: its own prepare.py where it has one (data/fineweb10B/ does)."""
    script = os.path.join(data_dir, "prepare.py")
    if not os.path.exists(script):
        if bin_shards:
            return f"python {RECORD_PREPARE}"
        if "fineweb" in os.path.basename(os.path.normpath(data_dir)):
            return "python fineweb.py"
    return f"python {script}"


def llmc_fault(header, size):
    """What is wrong with an llm.c `.bin` shard of `size` bytes that begins with `header` (bytes); None if nothing.
    The record asserts the magic and the version, and that the tokens it reads are the count the header declares."""
    if len(header) < LLMC_HEADER:
        return f"holds {size} bytes, fewer than the {LLMC_HEADER}-byte header of an llm.c token shard"
    magic, version, count = np.frombuffer(header[:12], "<i4").tolist()
    if magic != LLMC_MAGIC:
        return f"has magic number {magic}, not llm.c's {LLMC_MAGIC}: not an llm.c token shard"
    if version != LLMC_VERSION:
        return f"has version {version}: only version {LLMC_VERSION} (uint16 tokens) is read"
    body = size - LLMC_HEADER
    if body % 2:
        return f"holds {body} bytes after its header, not whole uint16 tokens"
    if body // 2 != count:
        return (f"is truncated (it holds {body // 2} of the {count} tokens its header declares)" if body // 2 < count
                else f"holds {body // 2} tokens, more than the {count} its header declares")
    return None


def llmc_count(path):
    """The token count of an llm.c `.bin` shard, its header and size checked first (the record's _peek_data_shard
    and _load_data_shard's asserts): a UsageError naming the file otherwise."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header, size = os.pread(fd, LLMC_HEADER, 0), os.fstat(fd).st_size
    finally:
        os.close(fd)
    what = llmc_fault(header, size)
    if what:
        raise UsageError(f"{path} {what}: rerun `{prepare_hint(os.path.dirname(path), bin_shards=True)}`")
    return int(np.frombuffer(header[:12], "<i4")[2])


def stopped(path, what):
    """What a run says when a data file goes wrong under it: one line, with the fix."""
    return RunStopped(f"{path} {what}: the run stopped; restore the file and resume with --init_from=resume")


class TokenFile:
    """The tokens of a `.bin` (layout "raw": uint16, nanoGPT), a `.npy` ("npy": after its header) or an llm.c `.bin`
    shard ("llmc": uint16 after a 256-int32 header), read with pread on a descriptor opened once. No memory map: a
    mapped file that shrinks kills the process with SIGBUS and no message. Here a file that changed since it was
    opened (its size or mtime, checked by `check`, once per batch) or a read that comes back short stops the run with
    one line (RunStopped). A file deleted, or replaced by a rename, after it was opened is no fault: the descriptor
    still reads the data the run started with."""

    def __init__(self, path, layout="raw"):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        stat = os.fstat(self.fd)
        self._opened = (stat.st_size, stat.st_mtime_ns)
        if layout == "npy":
            self.offset, self.dtype, self.count = self._npy_layout(stat.st_size)
        elif layout == "llmc":
            what = llmc_fault(os.pread(self.fd, LLMC_HEADER, 0), stat.st_size)
            if what:
                raise stopped(path, what)
            self.offset, self.dtype, self.count = LLMC_HEADER, np.dtype(np.uint16), (stat.st_size - LLMC_HEADER) // 2
        else:
            self.offset, self.dtype, self.count = 0, np.dtype(np.uint16), stat.st_size // 2

    def _npy_layout(self, size):
        """(data offset, dtype, token count) from the header; np.load's checks, worded as RunStopped."""
        readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        with open(self.fd, "rb", closefd=False) as f:
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
            raise stopped(self.path, f"is truncated (it holds {(size - offset) // dtype.itemsize} of the "
                                     f"{shape[0]} tokens its header declares)")
        return offset, dtype, shape[0]

    def _changed(self, size):
        now, was = ((max(0, s - self.offset) // self.dtype.itemsize) for s in (size, self._opened[0]))
        what = f"now {now} tokens, was {was}" if now != was else "rewritten in place"
        return stopped(self.path, f"changed while the run read it ({what})")

    def check(self):
        """Once per batch (one fstat): RunStopped if the size or mtime is not what it was at the open."""
        stat = os.fstat(self.fd)
        if (stat.st_size, stat.st_mtime_ns) != self._opened:
            raise self._changed(stat.st_size)

    def read(self, starts, n):
        """(len(starts), n) tokens: n from each start (a list of ints), one pread each."""
        fd, offset, itemsize, pread = self.fd, self.offset, self.dtype.itemsize, os.pread  # locals: once per window
        buf = b"".join([pread(fd, n * itemsize, offset + start * itemsize) for start in starts])
        if len(buf) != len(starts) * n * itemsize:  # the file shrank since check()
            raise self._changed(os.fstat(self.fd).st_size)
        return np.frombuffer(buf, self.dtype).reshape(len(starts), n)


class BinLoader:
    """nanoGPT's random windows; the windows of step `it` come from a generator seeded with (seed, it)."""

    def __init__(self, path, block_size, rows, seed, row_slice=None, vocab_size=None):
        size = os.path.getsize(path)
        if size == 0 or size % 2:
            what = "is empty" if size == 0 else f"holds {size} bytes, not whole uint16 tokens"
            raise UsageError(f"{path} {what}: rerun `{prepare_hint(os.path.dirname(path))}`")
        self.path = path
        self.file = TokenFile(path)
        if self.file.count <= block_size + 1:
            raise UsageError(f"{path} holds {self.file.count} tokens: too few for block_size {block_size}")
        self.block_size, self.rows, self.seed = block_size, rows, seed
        self.row_slice = row_slice or slice(0, rows)
        self.vocab_size = vocab_size  # the model's: ids at or above it are an error (check_ids)
        self.step = 0

    def _windows(self, starts):
        tokens = self.file.read(starts.ravel().tolist(), self.block_size + 1)
        tokens = tokens.reshape(*starts.shape, self.block_size + 1).astype(np.int32)  # (..., T+1)
        check_ids(tokens, self.vocab_size, self.path)
        return tokens[..., :-1], tokens[..., 1:]

    def batch(self, key, accum):
        """(x, y), each (accum, this process's rows, T) int32, for an arbitrary integer key tuple."""
        self.file.check()
        rng = np.random.default_rng([self.seed, *key])
        starts = rng.integers(0, self.file.count - self.block_size - 1, (accum, self.rows))
        return self._windows(starts[:, self.row_slice])

    def next(self, accum):
        x, y = self.batch((0, self.step), accum)
        self.step += 1
        return x, y

    def eval_batches(self, n, tag):
        """n batches of (rows, T) for estimate_loss; the same for the same tag (the iteration number)."""
        for k in range(n):
            x, y = self.batch((1, tag, k), 1)
            yield x[0], y[0]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


class ShardLoader:
    """build-nanogpt's DataLoaderLite: consecutive windows over the shards in sorted order, wrapping around.
    Position = (shard, offset) of the global batch; process p reads the rows its devices hold.
    With shuffle_shards, each epoch visits the shards in an order seeded by (seed, epoch)."""

    def __init__(self, paths, block_size, rows, seed, row_slice=None, shuffle_shards=False, vocab_size=None):
        self.paths = sorted(paths)
        self.vocab_size = vocab_size  # the model's: ids at or above it are an error (check_ids)
        self.block_size, self.rows, self.seed = block_size, rows, seed
        self.row_slice = row_slice or slice(0, rows)
        self.shuffle_shards = shuffle_shards
        self.position = (0, 0, 0)  # (epoch, shard, offset)
        self._file = None  # the TokenFile of the shard read last

    def _shard(self, epoch, shard):
        """The shard's TokenFile. Shards open as the run reaches them: one deleted or broken by then stops the run
        (RunStopped)."""
        order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.paths)) if self.shuffle_shards
                 else range(len(self.paths)))
        path = self.paths[order[shard]]
        if self._file is None or self._file.path != path:
            try:
                self._file = TokenFile(path, layout="npy")
            except FileNotFoundError:
                raise stopped(path, "is gone (deleted after the run listed the shards)") from None
        return self._file

    def _read(self, position, n):
        """n tokens from position, crossing shard ends (and epochs); returns (tokens, position after)."""
        epoch, shard, offset = position
        parts = []
        while n > 0:
            file = self._shard(epoch, shard)
            part = file.read([offset], min(n, file.count - offset))[0]
            parts.append(part)
            n, offset = n - len(part), offset + len(part)
            if offset == file.count:
                shard, offset = shard + 1, 0
                if shard == len(self.paths):
                    epoch, shard = epoch + 1, 0
        return np.concatenate(parts, dtype=np.int32), (epoch, shard, offset)

    def next(self, accum):
        if self._file is not None:
            self._file.check()  # the shard read last, where this batch begins (a shard it opens is fresh)
        n = accum * self.rows * self.block_size
        tokens, after = self._read(self.position, n)
        last, _ = self._read(after, 1)  # the last target is the next batch's first input
        self.position = after
        buf = np.concatenate([tokens, last])
        check_ids(buf, self.vocab_size, os.path.dirname(self.paths[0]))
        x = buf[:-1].reshape(accum, self.rows, self.block_size)[:, self.row_slice]
        y = buf[1:].reshape(accum, self.rows, self.block_size)[:, self.row_slice]
        return x, y

    def eval_batches(self, n, tag=None):
        """build-nanogpt's val: the same first n batches every time."""
        state = self.state_dict()
        self.position = (0, 0, 0)
        try:
            for _ in range(n):
                x, y = self.next(1)
                yield x[0], y[0]
        finally:
            self.load_state_dict(state)

    def state_dict(self):
        return dict(zip(("epoch", "shard", "offset"), map(int, self.position)))

    def load_state_dict(self, state):
        self.position = (int(state["epoch"]), int(state["shard"]), int(state["offset"]))


class BinShardLoader:
    """modded-nanogpt's DistributedDataLoader (record 5) over llm.c `.bin` shards in sorted order. One micro-batch is
    one of the record's next_batch() over all its processes: the next rows*T + 1 tokens of the shard (x: the first
    rows*T as (rows, T), y: shifted by one), after which the position advances rows*T, and moves to the next
    shard's start (dropping this one's tail) when the next batch and its one extra token would not fit; after the
    last shard, the first again. Position = (shard, offset) of the global batch; process p reads only its rows.
    (The record's rank r tests its own position, r*B*T further on, for that move: where a shard's tail after its last
    batch is under (W-1)*B*T + 1 tokens, its ranks r > 0 leave the shard one batch before rank 0. We follow rank 0:
    the record exactly on one process, and on W wherever the tails are long enough.)"""

    def __init__(self, paths, block_size, rows, row_slice=None, vocab_size=None):
        self.paths = sorted(paths)
        self.counts = [llmc_count(p) for p in self.paths]  # every header checked up front, as the record does
        self.block_size, self.rows = block_size, rows
        need = rows * block_size + 1
        for path, count in zip(self.paths, self.counts):
            if count < need:  # the record: assert shard_ntok >= num_processes * B * T + 1
                raise UsageError(f"{path} holds {count} tokens, fewer than one batch of {rows} rows x {block_size} "
                                 f"+ 1 = {need}: lower batch_size or block_size")
        lo, hi, stride = (row_slice or slice(0, rows)).indices(rows)
        assert stride == 1 and hi > lo, f"a process reads one contiguous range of rows, not {row_slice}"
        self.lo, self.hi = lo, hi
        self.vocab_size = vocab_size  # the model's: ids at or above it are an error (check_ids)
        self.position = (0, 0)  # (shard, offset)
        self._file = None  # the TokenFile of the shard read last

    def _shard(self, shard):
        """The shard's TokenFile, opened as the run reaches it and checked once per batch after that: a shard
        deleted, broken or changed since the run listed it stops the run (RunStopped)."""
        path = self.paths[shard]
        if self._file is not None and self._file.path == path:
            self._file.check()
            return self._file
        try:
            file = TokenFile(path, layout="llmc")
        except FileNotFoundError:
            raise stopped(path, "is gone (deleted after the run listed the shards)") from None
        if file.count != self.counts[shard]:
            raise stopped(path, f"changed since the run listed the shards (now {file.count} tokens, was "
                                f"{self.counts[shard]})")
        self._file = file
        return file

    def _batch(self, position):
        """This process's (x, y), each (its rows, T) int32, of the global batch at `position`; the position after."""
        shard, offset = position
        T, span = self.block_size, self.rows * self.block_size
        # rows lo..hi and the one token after them (the next process's first, or the batch's extra one)
        buf = self._shard(shard).read([offset + self.lo * T], (self.hi - self.lo) * T + 1)[0].astype(np.int32)
        check_ids(buf, self.vocab_size, self.paths[shard])
        offset += span
        if offset + span + 1 > self.counts[shard]:  # the record's advance(): the shard's tail is dropped
            shard, offset = (shard + 1) % len(self.paths), 0
        return buf[:-1].reshape(-1, T), buf[1:].reshape(-1, T), (shard, offset)

    def next(self, accum):
        """(x, y), each (accum, this process's rows, T) int32: `accum` consecutive global batches."""
        xs, ys, position = [], [], self.position
        for _ in range(accum):
            x, y, position = self._batch(position)
            xs.append(x)
            ys.append(y)
        self.position = position
        return np.stack(xs), np.stack(ys)

    def eval_batches(self, n, tag=None):
        """The record's validation: n batches from the start of the shards, the same every time."""
        position = (0, 0)
        for _ in range(n):
            x, y, position = self._batch(position)
            yield x, y

    def state_dict(self):
        return dict(zip(("shard", "offset"), map(int, self.position)))

    def load_state_dict(self, state):
        shard, offset = int(state["shard"]), int(state["offset"])
        if not (0 <= shard < len(self.paths) and 0 <= offset
                and offset + self.rows * self.block_size + 1 <= self.counts[shard]):
            raise UsageError(f"the checkpoint's data position (shard {shard}, offset {offset}) is past the end of "
                             f"the {len(self.paths)} shards in {os.path.dirname(self.paths[0])} at {self.rows} rows "
                             f"x {self.block_size}: resume on the data and batch size it was saved with")
        self.position = (shard, offset)


def val_batches_for(val_tokens, rows, block_size):
    """The record's val_steps: how many eval batches of rows x block_size tokens make val_tokens (10,485,760 in
    record 5: 20 batches of 8 GPUs x 64 x 1024); 0 for val_tokens 0 (off: eval_iters batches)."""
    per = rows * block_size
    if val_tokens < 0 or val_tokens % per:
        fit = max(1, round(val_tokens / per)) * per
        raise UsageError(f"val_tokens={val_tokens} is not a multiple of one eval batch, {rows} rows x {block_size} "
                         f"= {per} tokens: set --val_tokens={fit}, or 0 to evaluate eval_iters batches")
    return val_tokens // per


def make_loader(data_dir, split, block_size, rows, seed, row_slice=None, shuffle_shards=False, vocab_size=None):
    """The loader for what `data_dir` holds: `{split}.bin` (nanoGPT), llm.c `*_{split}_*.bin` shards (modded-nanogpt)
    or `*{split}*.npy` shards (build-nanogpt). vocab_size: the model's, which no token id may reach."""
    bin_path = os.path.join(data_dir, f"{split}.bin")
    if os.path.exists(bin_path):
        return BinLoader(bin_path, block_size, rows, seed, row_slice, vocab_size)
    bin_shards = sorted(glob.glob(os.path.join(data_dir, f"*_{split}_*.bin")))
    if bin_shards:
        if shuffle_shards and split == "train":
            raise UsageError(f"shuffle_shards is for .npy shards: the .bin shards in {data_dir} are read in order, "
                             "as modded-nanogpt reads them; drop --shuffle_shards")
        return BinShardLoader(bin_shards, block_size, rows, row_slice, vocab_size)
    shards = sorted(glob.glob(os.path.join(data_dir, f"*{split}*.npy")))
    if shards:
        return ShardLoader(shards, block_size, rows, seed, row_slice, shuffle_shards and split == "train", vocab_size)
    raise InputNotFound(f"no {split}.bin or {split} shards (*_{split}_*.bin, *{split}*.npy) in {data_dir}: run "
                        f"`{prepare_hint(data_dir)}` first")


def data_meta(data_dir):
    """(vocab_size, vocab) of the data's characters (nanoGPT's char-level datasets write a meta.pkl; a meta.json is
    read first), read by tokenizer.read_vocab, which runs nothing: vocab_size and the characters, which each
    checkpoint saves as what decodes its tokens; (0, 'gpt2') where there is neither: GPT-2's BPE."""
    path = vocab_file(data_dir)
    return read_vocab(path) if path else (0, "gpt2")


def data_dir_for(dataset):
    """A dataset's folder: data/<dataset> here, else the path `dataset`, else data/<dataset> of the project (a run
    started from another directory); data/<dataset> here when none exists, for the error that follows."""
    here = os.path.join("data", dataset)
    for candidate in (here, dataset, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", dataset)):
        if os.path.isdir(candidate):
            return candidate
    return here


class Prefetcher:
    """The training batches, read and put on the devices by a background thread `depth` batches ahead of the
    step, so that the devices never wait for the host's reads and copies. `put` makes a device array of one
    process-local (accum, rows, T) array. Each batch carries the loader's state after it: `state` is that of
    the last batch taken, what a checkpoint saves, so a resume continues after it, whatever was read ahead.
    An error while reading (a bad token id, a data file that changed: RunStopped) is raised, itself, by the next()
    that would have returned its batch; the thread prints nothing."""

    def __init__(self, loader, accum, put, depth=2):
        self.loader, self.accum, self.put = loader, accum, put
        self.state = loader.state_dict()
        self._queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="prefetch", daemon=True)
        self._thread.start()

    def _fill(self):
        try:
            while not self._closed.is_set():
                x, y = self.loader.next(self.accum)
                self._offer((self.put(x), self.put(y), self.loader.state_dict()))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._offer(e)

    def _offer(self, item):
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self):
        """(x, y) of the next step, on the devices."""
        item = self._queue.get()
        if isinstance(item, Exception):
            self.close()
            raise item
        x, y, self.state = item
        return x, y

    def close(self):
        self._closed.set()
        self._thread.join()
