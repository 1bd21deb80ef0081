"""
The data loaders. Each step reads one *global* batch of token windows, (accum, rows, T) with rows =
batch_size * device_count, and each process materializes only its own rows. The global batch depends on
(seed, position) alone, never on how many processes or devices there are, so 1 device, 8 devices and
2 hosts x 4 devices train on the same tokens.

- BinLoader (nanoGPT): random windows from a uint16 `{split}.bin`.
- ShardLoader (build-nanogpt): sequential over sorted uint16 `*{split}*.npy` shards.
Both read through TokenFile (pread, no memory map). Their state (`state_dict()`) goes into the checkpoint so
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


def prepare_hint(data_dir):
    name = os.path.basename(os.path.normpath(data_dir))
    if "fineweb" in name:
        return "python fineweb.py"
    return f"python {os.path.join(data_dir, 'prepare.py')}"


def stopped(path, what):
    """What a run says when a data file goes wrong under it: one line, with the fix."""
    return RunStopped(f"{path} {what}: the run stopped; restore the file and resume with --init_from=resume")


class TokenFile:
    """The tokens of a `.bin` (raw uint16) or a `.npy` (after its header), read with pread on a descriptor opened
    once. No memory map: a mapped file that shrinks kills the process with SIGBUS and no message. Here a file
    that changed since it was opened (its size or mtime, checked by `check`, once per batch) or a read that comes
    back short stops the run with one line (RunStopped). A file deleted, or replaced by a rename, after it was
    opened is no fault: the descriptor still reads the data the run started with."""

    def __init__(self, path, npy=False):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        stat = os.fstat(self.fd)
        self._opened = (stat.st_size, stat.st_mtime_ns)
        if npy:
            self.offset, self.dtype, self.count = self._npy_layout(stat.st_size)
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
                self._file = TokenFile(path, npy=True)
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


def make_loader(data_dir, split, block_size, rows, seed, row_slice=None, shuffle_shards=False, vocab_size=None):
    """The loader for what `data_dir` holds: `{split}.bin` (nanoGPT) or `*{split}*.npy` shards (build-nanogpt).
    vocab_size: the model's, which no token id may reach."""
    bin_path = os.path.join(data_dir, f"{split}.bin")
    if os.path.exists(bin_path):
        return BinLoader(bin_path, block_size, rows, seed, row_slice, vocab_size)
    shards = sorted(glob.glob(os.path.join(data_dir, f"*{split}*.npy")))
    if shards:
        return ShardLoader(shards, block_size, rows, seed, row_slice, shuffle_shards and split == "train", vocab_size)
    raise InputNotFound(f"no {split}.bin or *{split}*.npy shards in {data_dir}: run `{prepare_hint(data_dir)}` first")


def data_meta(data_dir):
    """(vocab_size, vocab) of the data's characters (nanoGPT's char-level datasets write a meta.pkl; a meta.json is
    read first), read by tokenizer.read_vocab, which runs nothing: vocab_size and the characters, which each
    checkpoint saves as what decodes its tokens; (0, 'gpt2') where there is neither: GPT-2's BPE."""
    path = vocab_file(data_dir)
    return read_vocab(path) if path else (0, "gpt2")


def data_dir_for(dataset):
    return dataset if os.path.isdir(dataset) and not os.path.isdir(os.path.join("data", dataset)) \
        else os.path.join("data", dataset)


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
