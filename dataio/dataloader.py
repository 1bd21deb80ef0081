"""
The data loaders. Each step reads one *global* batch of token windows, (accum, rows, T) with rows =
batch_size * device_count, and each process materializes only its own rows. The global batch depends
on (seed, position) alone, never on how many processes or devices there are, so 1 device, 8 devices
and 2 hosts x 4 devices train on the same tokens.

- BinLoader (nanoGPT): random windows from a uint16 `{split}.bin`.
- ShardLoader (build-nanogpt): sequential over sorted uint16 `*{split}*.npy` shards.
- BinShardLoader (llm.c, modded-nanogpt's speedrun): sequential over sorted `*_{split}_*.bin` shards
  (a 256-int32 header, then uint16 tokens), as the record's DistributedDataLoader reads them.
- BestFitLoader (nanochat, dataio/bestfit_loader.py): documents of `shards/*.parquet` tokenized on
  threads by `tokenizer/`, packed BOS-first by best fit; each process packs its own rows.
- ConversationLoader (nanochat's finetuning, dataio/sft_loader.py): conversations rendered with
  their loss masks, packed by best fit with padding.
Where a dataset's folder is and what vocabulary it speaks: dataio/data_folder.py.
The data folder is local or a URL (gs://bucket/folder, any fsspec URL); every file is read through
token_files (pread, or ranged reads at a URL; no memory map, no download). Each loader's state
(`state_dict()`) goes into the checkpoint so that resume neither skips nor repeats data. The thread
that reads the training batches ahead of the step is dataio/prefetch.py's.
"""

import itertools

import numpy as np

from configurator import InputNotFound, UsageError
from dataio import bestfit_loader, sft_loader, storage
from dataio.data_folder import TOKENIZER_FILE, data_dir_for, data_meta
from dataio.token_files import (
    LLMC_HEADER,
    LLMC_MAGIC,
    LLMC_VERSION,
    llmc_counts,
    llmc_fault,
    prepare_hint,
    stopped,
    token_file,
)

# the token files' names and the data folder's functions, here where scripts and tests have always
# found them (dataio/token_files.py and dataio/data_folder.py hold them)
__all__ = [
    "LLMC_HEADER",
    "LLMC_MAGIC",
    "LLMC_VERSION",
    "llmc_fault",
    "check_ids",
    "BinLoader",
    "ShardLoader",
    "BinShardLoader",
    "val_batches_for",
    "make_loader",
    "data_meta",
    "data_dir_for",
    "TOKENIZER_FILE",
]


def check_ids(tokens, vocab_size, where):
    """Ids the model has no embedding for would turn into NaN (jnp.take fills), far from their
    cause."""
    if vocab_size is not None and tokens.size and tokens.max() >= vocab_size:
        raise UsageError(
            f"{where} holds token id {tokens.max()}, outside the model's vocabulary (vocab_size "
            f"{vocab_size}): set --vocab_size, or prepare the data with the model's tokenizer"
        )


class BinLoader:
    """nanoGPT's random windows; the windows of step `it` come from a generator seeded with (seed,
    it)."""

    def __init__(self, path, block_size, rows, seed, row_slice=None, vocab_size=None):
        size = storage.size(path)
        if size == 0 or size % 2:
            what = "is empty" if size == 0 else f"holds {size} bytes, not whole uint16 tokens"
            raise UsageError(f"{path} {what}: rerun `{prepare_hint(storage.dirname(path))}`")
        self.path = path
        self.file = token_file(path)
        if self.file.count <= block_size + 1:
            raise UsageError(
                f"{path} holds {self.file.count} tokens: too few for block_size {block_size}"
            )
        self.block_size, self.rows, self.seed = block_size, rows, seed
        self.row_slice = row_slice or slice(0, rows)
        self.vocab_size = vocab_size  # the model's: ids at or above it are an error (check_ids)
        self.step = 0

    def batches(self, keys, accum):
        """(x, y), each (len(keys), accum, this process's rows, T) int32: a batch for each integer
        key tuple, their windows read together (at a URL, one set of concurrent requests)."""
        self.file.check()
        starts = np.stack(
            [
                np.random.default_rng([self.seed, *key]).integers(
                    0, self.file.count - self.block_size - 1, (accum, self.rows)
                )
                for key in keys
            ]
        )[..., self.row_slice]
        tokens = self.file.read(starts.ravel().tolist(), self.block_size + 1)
        tokens = tokens.reshape(*starts.shape, self.block_size + 1).astype(np.int32)  # (..., T+1)
        check_ids(tokens, self.vocab_size, self.path)
        return tokens[..., :-1], tokens[..., 1:]

    def next(self, accum):
        x, y = self.batches([(0, self.step)], accum)
        self.step += 1
        return x[0], y[0]

    def eval_batches(self, n, tag):
        """n batches of (rows, T) for estimate_loss; the same for the same tag (the iteration
        number)."""
        x, y = self.batches([(1, tag, k) for k in range(n)], 1)
        for k in range(n):
            yield x[k, 0], y[k, 0]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


class ShardLoader:
    """build-nanogpt's DataLoaderLite: consecutive windows over the shards in sorted order, wrapping
    around. Position = (shard, offset) of the global batch; process p reads the rows its devices
    hold. With shuffle_shards, each epoch visits the shards in an order seeded by (seed, epoch)."""

    def __init__(
        self, paths, block_size, rows, seed, row_slice=None, shuffle_shards=False, vocab_size=None
    ):
        self.paths = sorted(paths)
        self.vocab_size = vocab_size  # the model's: ids at or above it are an error (check_ids)
        self.block_size, self.rows, self.seed = block_size, rows, seed
        self.row_slice = row_slice or slice(0, rows)
        self.shuffle_shards = shuffle_shards
        self.position = (0, 0, 0)  # (epoch, shard, offset)
        self._file = None  # the TokenFile of the shard read last

    def _shard(self, epoch, shard):
        """The shard's TokenFile. Shards open as the run reaches them: one deleted or broken by then
        stops the run (RunStopped)."""
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(len(self.paths))
            if self.shuffle_shards
            else range(len(self.paths))
        )
        path = self.paths[order[shard]]
        if self._file is None or self._file.path != path:
            try:
                self._file = token_file(path, layout="npy")
            except FileNotFoundError:
                raise stopped(path, "is gone (deleted after the run listed the shards)") from None
        return self._file

    def _read(self, position, n):
        """n + 1 tokens from position, crossing shard ends (and epochs): a batch and its last
        target, the next batch's first input, in one read of each shard; returns (tokens, the
        position after the n)."""
        epoch, shard, offset = position
        parts, left = [], n + 1
        while True:
            file = self._shard(epoch, shard)
            parts.append(file.read([offset], min(left, file.count - offset))[0])
            if len(parts[-1]) == left:  # the last part: the extra token is its last
                return np.concatenate(parts, dtype=np.int32), (epoch, shard, offset + left - 1)
            left, shard, offset = left - len(parts[-1]), shard + 1, 0  # the shard read to its end
            if shard == len(self.paths):
                epoch, shard = epoch + 1, 0

    def next(self, accum):
        if self._file is not None:
            # the shard read last, where this batch begins (a shard it opens is fresh)
            self._file.check()
        buf, self.position = self._read(self.position, accum * self.rows * self.block_size)
        check_ids(buf, self.vocab_size, storage.dirname(self.paths[0]))
        x = buf[:-1].reshape(accum, self.rows, self.block_size)[:, self.row_slice]
        y = buf[1:].reshape(accum, self.rows, self.block_size)[:, self.row_slice]
        return x, y

    def eval_batches(self, n, tag=None):
        """build-nanogpt's val: the same first n batches every time (read as one)."""
        state = self.state_dict()
        self.position = (0, 0, 0)
        try:
            x, y = self.next(n)
        finally:
            self.load_state_dict(state)
        for k in range(n):
            yield x[k], y[k]

    def state_dict(self):
        return dict(zip(("epoch", "shard", "offset"), map(int, self.position)))

    def load_state_dict(self, state):
        self.position = (int(state["epoch"]), int(state["shard"]), int(state["offset"]))


class BinShardLoader:
    """modded-nanogpt's DistributedDataLoader (record 5) over llm.c `.bin` shards in sorted order.
    One micro-batch is one of the record's next_batch() over all its processes: the next rows*T + 1
    tokens of the shard (x: the first rows*T as (rows, T), y: shifted by one), after which the
    position advances rows*T, and moves to the next shard's start (dropping this one's tail) when
    the next batch and its one extra token would not fit; after the last shard, the first again.
    Position = (shard, offset) of the global batch; process p reads only its rows. (The record's
    rank r tests its own position, r*B*T further on, for that move: where a shard's tail after its
    last batch is under (W-1)*B*T + 1 tokens, its ranks r > 0 leave the shard one batch before rank
    0. We follow rank 0: the record exactly on one process, and on W wherever the tails are long
    enough.)"""

    def __init__(self, paths, block_size, rows, row_slice=None, vocab_size=None):
        self.paths = sorted(paths)
        self.counts = llmc_counts(self.paths)  # every header checked up front, as the record does
        self.block_size, self.rows = block_size, rows
        need = rows * block_size + 1
        for path, count in zip(self.paths, self.counts):
            if count < need:  # the record: assert shard_ntok >= num_processes * B * T + 1
                raise UsageError(
                    f"{path} holds {count} tokens, fewer than one batch of {rows} rows x "
                    f"{block_size} + 1 = {need}: lower batch_size or block_size"
                )
        lo, hi, stride = (row_slice or slice(0, rows)).indices(rows)
        assert stride == 1 and hi > lo, (
            f"a process reads one contiguous range of rows, not {row_slice}"
        )
        self.lo, self.hi = lo, hi
        self.vocab_size = vocab_size  # the model's: ids at or above it are an error (check_ids)
        self.position = (0, 0)  # (shard, offset)
        self._file = None  # the TokenFile of the shard read last

    def _shard(self, shard):
        """The shard's TokenFile, opened as the run reaches it and checked once per batch after
        that: a shard deleted, broken or changed since the run listed it stops the run
        (RunStopped)."""
        path = self.paths[shard]
        if self._file is not None and self._file.path == path:
            self._file.check()
            return self._file
        try:
            file = token_file(path, layout="llmc")
        except FileNotFoundError:
            raise stopped(path, "is gone (deleted after the run listed the shards)") from None
        if file.count != self.counts[shard]:
            raise stopped(
                path,
                f"changed since the run listed the shards (now {file.count} tokens, was "
                f"{self.counts[shard]})",
            )
        self._file = file
        return file

    def _advance(self, position):
        """The position after the global batch at `position`: the record's advance() drops a shard's
        tail."""
        shard, offset = position
        offset += self.rows * self.block_size
        if offset + self.rows * self.block_size + 1 > self.counts[shard]:
            shard, offset = (shard + 1) % len(self.paths), 0
        return shard, offset

    def _batches(self, position, k):
        """This process's (x, y), each (k, its rows, T) int32, of the k global batches from
        `position`, those in one shard in one read of it; the position after."""
        T, positions, parts = self.block_size, [], []
        for _ in range(k):
            positions.append(position)
            position = self._advance(position)
        for shard, run in itertools.groupby(positions, key=lambda p: p[0]):
            # rows lo..hi of each batch and the one token after them (the next process's first, or
            # the extra one)
            buf = self._shard(shard).read(
                [offset + self.lo * T for _, offset in run], (self.hi - self.lo) * T + 1
            )
            parts.append(buf.astype(np.int32))
            check_ids(parts[-1], self.vocab_size, self.paths[shard])
        buf = np.concatenate(parts)  # (k, its rows * T + 1)
        return buf[:, :-1].reshape(k, -1, T), buf[:, 1:].reshape(k, -1, T), position

    def next(self, accum):
        """(x, y), each (accum, this process's rows, T) int32: `accum` consecutive global
        batches."""
        x, y, self.position = self._batches(self.position, accum)
        return x, y

    def eval_batches(self, n, tag=None):
        """The record's validation: n batches from the start of the shards, the same every time
        (read as one)."""
        x, y, _ = self._batches((0, 0), n)
        for k in range(n):
            yield x[k], y[k]

    def state_dict(self):
        return dict(zip(("shard", "offset"), map(int, self.position)))

    def _holds(self, shard, offset):
        """Whether a saved position can be this loader's: a batch fits there."""
        return offset + self.rows * self.block_size + 1 <= self.counts[shard]

    def load_state_dict(self, state):
        shard, offset = int(state["shard"]), int(state["offset"])
        if not (0 <= shard < len(self.paths) and 0 <= offset and self._holds(shard, offset)):
            raise UsageError(
                f"the checkpoint's data position (shard {shard}, offset {offset}) is past the end "
                f"of the {len(self.paths)} shards in {storage.dirname(self.paths[0])} at "
                f"{self.rows} rows x {self.block_size}: resume on the data and batch size it was "
                "saved with"
            )
        self.position = (shard, offset)


class Record20ShardLoader(BinShardLoader):
    """Record 20's distributed_data_generator over the same shards: a step's accum micro-batches
    are one contiguous span of accum * rows * T tokens, the record's batch_size (its ranks' shares
    side by side, each cut into sequences: our rows), so its shard moves a whole step at a time and
    before the step, when the span and its one extra token would reach the shard's end (>=: a tail
    that would just fit is dropped too, where record 5's loader reads it)."""

    def next(self, accum):
        shard, offset = self.position
        span = accum * self.rows * self.block_size
        if offset + span + 1 >= self.counts[shard]:
            shard, offset = (shard + 1) % len(self.paths), 0
        x, y, _ = self._batches((shard, offset), accum)  # the span fits: no move inside it
        self.position = (shard, offset + span)
        return x, y

    def _holds(self, shard, offset):
        return offset <= self.counts[shard]  # the shard moves at the next step, not after this one


def val_batches_for(val_tokens, rows, block_size):
    """The record's val_steps: how many eval batches of rows x block_size tokens make val_tokens
    (10,485,760 in record 5: 20 batches of 8 GPUs x 64 x 1024); 0 for val_tokens 0 (off: eval_iters
    batches)."""
    per = rows * block_size
    if val_tokens < 0 or val_tokens % per:
        fit = max(1, round(val_tokens / per)) * per
        raise UsageError(
            f"val_tokens={val_tokens} is not a multiple of one eval batch, {rows} rows x "
            f"{block_size} = {per} tokens: set --val_tokens={fit}, or 0 to evaluate eval_iters "
            "batches"
        )
    return val_tokens // per


def shards_in(data_dir, pattern):
    """The files of data_dir that match, sorted; none in a bucket that does not exist (what gcsfs
    says of it)."""
    try:
        return storage.glob(storage.join(data_dir, pattern))
    except FileNotFoundError:
        return []


def make_loader(
    data_dir,
    split,
    block_size,
    rows,
    seed,
    row_slice=None,
    shuffle_shards=False,
    vocab_size=None,
    record20=False,
    tokenizer="",
    sft=None,
):
    """The loader for what `data_dir` (a folder, or a URL: gs://bucket/folder) holds: `{split}.bin`
    (nanoGPT), llm.c `*_{split}_*.bin` shards (modded-nanogpt; record20: its record 20's steps),
    `shards/*.parquet` and `tokenizer/` (nanochat; `tokenizer`: another tokenizer directory) or
    `*{split}*.npy` shards (build-nanogpt); with `sft` (sft_loader.for_folder's), the conversations
    nanochat finetunes on. vocab_size: the model's, which no token id may reach."""
    if sft is not None:  # nanochat's finetuning: its conversations (dataio/sft_loader.py)
        return sft_loader.for_folder(
            data_dir, split, block_size, rows, row_slice, vocab_size, tokenizer, sft
        )
    bin_path = storage.join(data_dir, f"{split}.bin")
    if storage.exists(bin_path):
        return BinLoader(bin_path, block_size, rows, seed, row_slice, vocab_size)
    bin_shards = shards_in(data_dir, f"*_{split}_*.bin")
    if bin_shards:
        if shuffle_shards and split == "train":
            raise UsageError(
                f"shuffle_shards is for .npy shards: the .bin shards in {data_dir} are read in "
                "order, as modded-nanogpt reads them; drop --shuffle_shards"
            )
        loader = Record20ShardLoader if record20 else BinShardLoader
        return loader(bin_shards, block_size, rows, row_slice, vocab_size)
    # ours (data/nanochat/shards/) or nanochat's own folder as it is (base_data_climbmix/)
    parquet = shards_in(storage.join(data_dir, "shards"), "*.parquet") or shards_in(
        data_dir, "*.parquet"
    )
    if parquet:
        return bestfit_loader.for_folder(
            data_dir, parquet, split, block_size, rows, row_slice, vocab_size, tokenizer
        )
    shards = shards_in(data_dir, f"*{split}*.npy")
    if shards:
        return ShardLoader(
            shards,
            block_size,
            rows,
            seed,
            row_slice,
            shuffle_shards and split == "train",
            vocab_size,
        )
    todo = (
        f"write them with `{prepare_hint(data_dir)}`, then copy them there (gcloud storage cp)"
        if storage.is_url(data_dir)
        else f"run `{prepare_hint(data_dir)}` first"
    )
    raise InputNotFound(
        f"no {split}.bin or {split} shards (*_{split}_*.bin, *{split}*.npy) in {data_dir}: {todo}"
    )
