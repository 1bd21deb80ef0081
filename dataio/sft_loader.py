"""
nanochat's finetuning loader (scripts/chat_sft.py's sft_data_generator_bos_bestfit): conversations
rendered with their loss masks (dataio/conversations.py), packed into rows of T + 1 tokens by best
fit, each row starting at a conversation's BOS: the largest buffered conversation that fits whole,
and when none does the row's rest is padding (BOS, never learned), so no conversation is cropped.
Targets are -1 (ignored) wherever the mask is 0: the user's turns, BOS, the tool's output, padding.
Process p of P renders conversations p, p + P, ... and packs its own rows, as nanochat's rank p of
P does; after the last conversation the first comes again (epoch + 1).

The loader reads one micro-batch ahead, as chat_sft's loop prefetches one: after `next(accum)`
its `progress` (the fraction of the mixture consumed, or of `num_iterations` micro-batches when
given) and `last_step` are what chat_sft's loop holds when it sets that step's learning rate and
decides whether to stop. A conversation longer than a row never fits and keeps its place in the
buffer, as in nanochat. The state resumes exactly: the cursor, the counts, and which conversations
the buffer and the micro-batch read ahead hold (rendered again on resume).
"""

import os

import numpy as np

from configurator import UsageError
from dataio import storage
from dataio.chat_tokenizer import ChatTokenizer
from dataio.conversations import render_conversation

BUFFER_SIZE = 100  # conversations kept to choose from (chat_sft's buffer_size)


class ConversationLoader:
    """next(accum): (x, y), each (accum, rows, T) int32; y is -1 where nothing is learned.
    `conversations`: a sequence (len, [i]) of conversations; `render(conversation)`: its (ids,
    mask), as render_conversation gives them."""

    def __init__(
        self, conversations, render, bos, block_size, rows, rank=0, world=1, *,
        num_iterations=0, vocab_size=None, token_bytes=None,
    ):  # fmt: skip
        """num_iterations: chat_sft's, counted in micro-batches (0: one epoch); vocab_size: the
        model's, which no id may reach; token_bytes: each id's bytes (bits per byte)."""
        if not len(conversations):
            raise UsageError("the finetuning mixture holds no conversations: give it a task")
        self.conversations, self.render, self.bos = conversations, render, bos
        self.block_size, self.rows, self.world = block_size, rows, world
        self.num_iterations = num_iterations
        self.vocab_size, self.token_bytes = vocab_size, token_bytes
        self._arguments = (conversations, render, bos, block_size, rows, rank, world)
        self.cursor, self.consumed, self.epoch, self.fetched = rank, rank, 1, 0
        self.buffer = []  # [(index, ids, mask)] in nanochat's order
        self.last_step, self.progress = False, 0.0
        self._state = self._snapshot()
        self.ahead = self._micro_batch()  # chat_sft's first next() before its loop

    def _refill(self):
        while len(self.buffer) < BUFFER_SIZE:
            ids, mask = self.render(self.conversations[self.cursor])
            self.buffer.append((self.cursor, ids, mask))
            self.cursor += self.world
            if self.cursor >= len(self.conversations):
                self.cursor %= len(self.conversations)
                self.epoch += 1

    def _row(self):
        """(ids, mask) of one row of T + 1 tokens, as chat_sft packs it."""
        ids, mask, capacity = [], [], self.block_size + 1
        while len(ids) < capacity:
            self._refill()
            room = capacity - len(ids)
            best, best_len = -1, 0  # the first of the longest that fit whole
            for i, (_, conversation, _) in enumerate(self.buffer):
                if best_len < len(conversation) <= room:
                    best, best_len = i, len(conversation)
            if best < 0:  # none fits: padding, which nothing learns
                ids += [self.bos] * room
                mask += [0] * room
                break
            _, conversation, conversation_mask = self.buffer.pop(best)
            ids += conversation
            mask += conversation_mask
            self.consumed += self.world
        return ids, mask

    def _micro_batch(self):
        rows = [self._row() for _ in range(self.rows)]
        self.fetched += 1
        if 0 < self.num_iterations <= self.fetched:
            self.last_step = True
        if self.num_iterations > 0:
            self.progress = max(self.progress, self.fetched / self.num_iterations)
        else:
            self.progress = max(self.progress, self.consumed / len(self.conversations))
        if self.consumed >= len(self.conversations):
            self.last_step = True
        ids = np.array([r for r, _ in rows], dtype=np.int64)
        if self.vocab_size is not None and ids.max() >= self.vocab_size:
            raise UsageError(
                f"the tokenizer gave token id {ids.max()}, outside the model's vocabulary "
                f"(vocab_size {self.vocab_size}): finetune in the model's own tokenizer"
            )
        mask = np.array([m for _, m in rows], dtype=bool)
        targets = np.where(mask[:, 1:], ids[:, 1:], -1)
        return ids[:, :-1].astype(np.int32), targets.astype(np.int32)

    def next(self, accum):
        batches = [self.ahead] + [self._micro_batch() for _ in range(accum - 1)]
        self._state = self._snapshot()
        self.ahead = self._micro_batch()
        x, y = zip(*batches)
        return np.stack(x), np.stack(y)

    def _snapshot(self):
        counts = ("cursor", "consumed", "epoch", "fetched", "last_step", "progress")
        return {
            **{k: getattr(self, k) for k in counts},
            "buffer": [index for index, _, _ in self.buffer],
        }

    def state_dict(self):
        """Where the next step's micro-batches start: the micro-batch read ahead is read again on
        resume."""
        return dict(self._state)

    def load_state_dict(self, state):
        try:
            buffer = [(i, *self.render(self.conversations[i])) for i in state["buffer"]]
        except IndexError:
            raise UsageError(
                f"the checkpoint's finetuning position is past the mixture's "
                f"{len(self.conversations)} conversations: resume on the mixture it was saved with"
            ) from None
        for k in ("cursor", "consumed", "epoch", "fetched", "last_step", "progress"):
            setattr(self, k, state[k])
        self.buffer = buffer
        self._state = self._snapshot()
        self.ahead = self._micro_batch()

    def fresh(self, num_iterations=None):
        """A loader of the same conversations from their start (num_iterations: another's)."""
        iterations = self.num_iterations if num_iterations is None else num_iterations
        return ConversationLoader(
            *self._arguments,
            num_iterations=iterations,
            vocab_size=self.vocab_size,
            token_bytes=self.token_bytes,
        )

    def eval_batches(self, n, tag=None):
        """n batches of (rows, T) from the mixture's start, the same every time (chat_sft builds a
        fresh val loader for each evaluation)."""
        fresh = self.fresh(num_iterations=0)
        for _ in range(n):
            x, y = fresh.next(1)
            yield x[0], y[0]


def mixture(data_dir, split, **mix):
    """chat_sft's conversations for `split` ('train' | 'val') from data_dir: its `train.jsonl` and
    `val.jsonl` where it has them (CustomJSON's lines: one conversation each), else chat_sft's
    mixture of the task files there (dataio/task_folder.py: each hub dataset where `hf download`
    leaves it, or nanochat's base directory with its task_data/ cache); `mix`: sft_mixtures'
    epochs and sizes."""
    from dataio import chat_tasks, task_folder  # pyarrow: the nanochat extras

    jsonl = os.path.join(data_dir, f"{split}.jsonl")
    if os.path.exists(jsonl):
        return chat_tasks.CustomJSON(jsonl)
    return task_folder.sft_mixtures(data_dir, **mix)[split == "val"]


def for_folder(data_dir, split, block_size, rows, row_slice, vocab_size, tokenizer, sft):
    """The finetuning loader of data_dir's conversations (`mixture`), in the tokenizer of the
    directory `tokenizer` (else data_dir/tokenizer/); this process packs its rows of `row_slice`
    as nanochat's rank of as many processes does. sft: {'num_iterations' (chat_sft's, counted in
    micro-batches; 0: one epoch), 'mix' (`mixture`'s)}."""
    lo, hi, _ = (row_slice or slice(0, rows)).indices(rows)
    tok = ChatTokenizer.from_directory(tokenizer or storage.join(data_dir, "tokenizer"))
    conversations = mixture(data_dir, split, **sft["mix"])
    return ConversationLoader(
        conversations,
        lambda conversation: render_conversation(tok, conversation),
        tok.bos_token_id,
        block_size,
        hi - lo,
        rank=lo // (hi - lo),
        world=rows // (hi - lo),
        num_iterations=sft["num_iterations"] if split == "train" else 0,
        vocab_size=vocab_size,
        token_bytes=tok.token_bytes,
    )
