"""
nanochat's pretraining loader (its tokenizing_distributed_data_loader_with_state_bos_bestfit): the
documents of parquet shards, tokenized on threads with BOS in front, packed into rows of T + 1
tokens by best fit: each row starts with a document's BOS, takes the largest buffered document that
still fits whole, and when none does, fills its rest with the start of the shortest one (the rest
of that document is dropped). No padding. Process p of P reads row groups p, p + P, ... of each
shard and packs its own rows, as nanochat's rank p of P does, so one process reads the same rows as
nanochat's one rank; the last shard is the validation split.

The state resumes exactly (nanochat's skips to the next row group): where the next batch of
documents starts, and which documents the buffer holds, re-read and re-tokenized on resume.
"""

from collections import defaultdict

import numpy as np

from configurator import UsageError
from dataio import parquet_shards, storage
from dataio.chat_tokenizer import ChatTokenizer

BUFFER_SIZE = 1000  # documents kept to choose from (nanochat's buffer_size)
TOKENIZER_BATCH = 128  # documents tokenized at once (its tokenizer_batch_size)
TOKENIZER_THREADS = 4  # ...side by side on this many threads (its tokenizer_threads)


class DocumentStream:
    """The documents of `paths` in nanochat's order: for each shard, its row groups rank, rank +
    world, ...; in each, its texts in batches of TOKENIZER_BATCH; after the last shard, the first
    again (epoch + 1). A position is (epoch, shard, row group, first document of the batch).
    `read(path, row_group)`: the row group's texts; `row_groups(path)`: how many it has."""

    def __init__(self, paths, read, row_groups, rank=0, world=1):
        self.paths, self.read, self.row_groups = list(paths), read, row_groups
        self.rank, self.world = rank, world
        self.counts = [row_groups(p) for p in self.paths]
        if not any(rank < n for n in self.counts):
            raise UsageError(
                f"{len(self.paths)} shard(s) with {sum(self.counts)} row groups give process "
                f"{rank} of {world} nothing to read: add shards, or run on fewer processes"
            )
        self._cached = (None, None)  # the row group read last and its texts

    def texts(self, shard, group):
        if self._cached[0] != (shard, group):
            self._cached = ((shard, group), self.read(self.paths[shard], group))
        return self._cached[1]

    def batches(self, position):
        """(texts, their ids (shard, group, index)) from `position` on, forever, and the position
        after each."""
        epoch, shard, group, start = position
        while True:
            while shard < len(self.paths):
                while group < self.counts[shard]:
                    texts = self.texts(shard, group)
                    while start < len(texts):
                        end = min(start + TOKENIZER_BATCH, len(texts))
                        ids = [(shard, group, i) for i in range(start, end)]
                        after = (epoch, shard, group, end)
                        yield texts[start:end], ids, after
                        start = end
                    group, start = group + self.world, 0
                shard, group = shard + 1, self.rank
            epoch, shard, group = epoch + 1, 0, self.rank

    def start(self):
        return (1, 0, self.rank, 0)


def parquet_stream(paths, rank=0, world=1):
    """A DocumentStream over parquet shards (local or URLs: dataio/parquet_shards.py reads them)."""
    files = {}

    def parquet(path):
        if path not in files:
            files[path] = parquet_shards.open_parquet(path)
        return files[path]

    return DocumentStream(
        paths,
        lambda path, group: parquet_shards.read_texts(parquet(path), group, path),
        lambda path: parquet(path).num_row_groups,
        rank,
        world,
    )


class BestFitLoader:
    """next(accum): (x, y), each (accum, rows, T) int32, this process's rows (nanochat's next() of
    its loader `accum` times). `encode(texts)`: each text's token ids with BOS first (on threads:
    dataio/chat_tokenizer.py)."""

    def __init__(self, stream, encode, block_size, rows, vocab_size=None, token_bytes=None):
        self.stream, self.encode = stream, encode
        self.token_bytes = token_bytes  # each id's bytes: the eval's bits per byte
        self.block_size, self.rows, self.vocab_size = block_size, rows, vocab_size
        self.position = stream.start()  # where the next batch of documents starts
        self.buffer = []  # [(id, tokens)] in nanochat's order
        self._batches = None

    def _refill(self):
        if self._batches is None:
            self._batches = self.stream.batches(self.position)
        texts, ids, self.position = next(self._batches)
        for doc_id, tokens in zip(ids, self.encode(texts)):
            self.buffer.append((doc_id, tokens))

    def _row(self):
        """One row of T + 1 tokens, as nanochat packs it."""
        row, capacity = [], self.block_size + 1
        while len(row) < capacity:
            while len(self.buffer) < BUFFER_SIZE:
                self._refill()
            room = capacity - len(row)
            best, best_len = -1, 0  # the first of the longest that fit whole
            for i, (_, tokens) in enumerate(self.buffer):
                if best_len < len(tokens) <= room:
                    best, best_len = i, len(tokens)
            if best < 0:  # none fits: the first of the shortest, cropped to the room left
                best = min(range(len(self.buffer)), key=lambda i: len(self.buffer[i][1]))
            row.extend(self.buffer.pop(best)[1][:room])
        return row

    def next(self, accum):
        rows = np.array([self._row() for _ in range(accum * self.rows)], dtype=np.int64)
        if self.vocab_size is not None and rows.max() >= self.vocab_size:
            raise UsageError(
                f"the tokenizer gave token id {rows.max()}, outside the model's vocabulary "
                f"(vocab_size {self.vocab_size}): train with the tokenizer's vocab_size"
            )
        rows = rows.astype(np.int32).reshape(accum, self.rows, -1)
        return rows[..., :-1], rows[..., 1:]

    def state_dict(self):
        return {
            "position": list(map(int, self.position)),
            "buffer": [list(doc_id) for doc_id, _ in self.buffer],
        }

    def load_state_dict(self, state):
        """The loader as it was: the documents of its buffer read again from their shards."""
        epoch, shard, group, start = map(int, state["position"])
        ids = [tuple(map(int, doc_id)) for doc_id in state["buffer"]]
        by_group = defaultdict(list)
        for k, (s, g, i) in enumerate(ids):
            by_group[s, g].append((k, i))
        buffer = [None] * len(ids)
        try:
            if not 0 <= shard <= len(self.stream.paths):
                raise IndexError
            for (s, g), members in by_group.items():
                if not (0 <= s < len(self.stream.paths) and 0 <= g < self.stream.counts[s]):
                    raise IndexError
                texts = self.stream.texts(s, g)
                tokens = self.encode([texts[i] for _, i in members])
                for (k, i), doc in zip(members, tokens):
                    buffer[k] = ((s, g, i), doc)
        except IndexError:
            raise UsageError(
                f"the checkpoint's data position is not in the {len(self.stream.paths)} shards "
                "here: resume on the shards it was saved with"
            ) from None
        self.buffer, self.position, self._batches = buffer, (epoch, shard, group, start), None

    def eval_batches(self, n, tag=None):
        """n batches of (rows, T) from the split's start, the same every time (nanochat builds a
        fresh val loader for each evaluation)."""
        fresh = BestFitLoader(self.stream, self.encode, self.block_size, self.rows, self.vocab_size)
        for _ in range(n):
            x, y = fresh.next(1)
            yield x[0], y[0]


def for_folder(
    data_dir, parquet, split, block_size, rows, row_slice=None, vocab_size=None, tokenizer=""
):
    """The loader of a nanochat data folder: `parquet`, its shards/*.parquet (the last the val
    split), in the tokenizer of the directory `tokenizer`, else data_dir/tokenizer/; this process
    packs its rows of `row_slice` as nanochat's rank of as many processes does."""
    lo, hi, _ = (row_slice or slice(0, rows)).indices(rows)
    tokenizer = ChatTokenizer.from_directory(tokenizer or storage.join(data_dir, "tokenizer"))
    shards = parquet_shards.split_shards(parquet, split)
    stream = parquet_stream(shards, rank=lo // (hi - lo), world=rows // (hi - lo))

    def encode(texts):
        return tokenizer.encode(
            texts, prepend=tokenizer.bos_token_id, num_threads=TOKENIZER_THREADS
        )

    return BestFitLoader(stream, encode, block_size, hi - lo, vocab_size, tokenizer.token_bytes)
