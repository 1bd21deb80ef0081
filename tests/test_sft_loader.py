"""nanochat's finetuning loader (dataio/sft_loader.py): rows packed by best fit with padding, the
loss mask as targets of -1, the progress and the last step chat_sft's loop reads, an exact resume;
with NANOCHAT_CHECKOUT, the same micro-batches, progress and last step as chat_sft.py's own
sft_data_generator_bos_bestfit (its definition run from its source: the script trains at import).

    python -m pytest tests/test_sft_loader.py -q
"""

import os
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from configurator import UsageError
from dataio.chat_tokenizer import ChatTokenizer
from dataio.conversations import render_conversation
from dataio.sft_loader import ConversationLoader
from parity import chat_sft_code
from tests.helpers import REPO

BOS = 0


def fake_render(lengths):
    """Conversation i rendered as BOS then its index (len - 1 times), the mask 1 after BOS."""
    return lambda i: ([BOS] + [i] * (lengths[i] - 1), [0] + [1] * (lengths[i] - 1))


def loader(lengths, block_size, rows=2, **kw):
    return ConversationLoader(
        list(range(len(lengths))), fake_render(lengths), BOS, block_size, rows, **kw
    )


def test_the_longest_conversation_that_fits_then_the_next_and_no_cropping():
    # rows of 8 tokens: conversation 2 (6 tokens), then the 2 left take conversation 3
    x, y = loader({0: 5, 1: 3, 2: 6, 3: 2}, block_size=7).next(1)
    row = [BOS, 2, 2, 2, 2, 2, BOS, 3]
    np.testing.assert_array_equal(x[0], [row[:-1]] * 2)
    np.testing.assert_array_equal(y[0], [[2, 2, 2, 2, 2, -1, 3]] * 2)  # BOS is never learned


def test_where_nothing_fits_the_row_is_padding_that_nothing_learns():
    x, y = loader({0: 5, 1: 5}, block_size=7).next(1)
    np.testing.assert_array_equal(x[0, 0], [BOS, 0, 0, 0, 0, BOS, BOS])
    np.testing.assert_array_equal(y[0, 0], [0, 0, 0, 0, -1, -1, -1])


def test_progress_and_the_last_step_follow_the_micro_batch_read_ahead():
    """chat_sft counts consumed conversations (or micro-batches, with --num-iterations) through
    the micro-batch its loop has already fetched for the next step."""
    lengths = {i: 4 for i in range(40)}  # two to a row of 8: 4 a micro-batch of 2 rows
    data = loader(lengths, block_size=7)
    assert data.progress == 4 / 40 and not data.last_step
    data.next(2)  # 2 micro-batches, and 1 read ahead: 12 consumed
    assert data.progress == 12 / 40
    for _ in range(3):
        data.next(2)
    assert data.progress == 36 / 40 and not data.last_step
    data.next(2)
    assert data.progress == 44 / 40 and data.last_step  # as chat_sft's, past 1 at the end
    by_count = loader(lengths, block_size=7, num_iterations=5)
    by_count.next(2)
    assert by_count.progress == 3 / 5 and not by_count.last_step
    by_count.next(2)
    assert by_count.last_step


def test_a_resumed_loader_continues_as_the_one_that_ran_on():
    rng = random.Random(0)
    lengths = {i: rng.randint(2, 12) for i in range(300)}
    ran_on = loader(lengths, block_size=15, rows=3)
    for _ in range(4):
        ran_on.next(2)
    state = ran_on.state_dict()
    resumed = loader(lengths, block_size=15, rows=3)
    resumed.load_state_dict(state)
    for _ in range(30):  # past an epoch
        for a, b in zip(ran_on.next(2), resumed.next(2)):
            np.testing.assert_array_equal(a, b)
        assert (ran_on.progress, ran_on.last_step) == (resumed.progress, resumed.last_step)


def test_bad_mixtures_and_states_are_one_line():
    with pytest.raises(UsageError, match="holds no conversations"):
        loader({}, block_size=7)
    state = loader({i: 4 for i in range(300)}, block_size=7).state_dict()
    with pytest.raises(UsageError, match="past the mixture's 10 conversations"):
        loader({i: 4 for i in range(10)}, block_size=7).load_state_dict(state | {"buffer": [200]})


# ---- against nanochat's own chat_sft.py


WORDS = "the king said to his lord that all the world is a stage and we are but players".split()


def random_conversations(n, seed=0):
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10)))

    def turn(i):
        if i % 2 == 0:
            return {"role": "user", "content": text()}
        if rng.random() < 0.5:
            return {"role": "assistant", "content": text()}
        kinds = ("text", "python", "python_output")
        parts = [{"type": rng.choice(kinds), "text": text()} for _ in range(rng.randint(1, 3))]
        return {"role": "assistant", "content": parts}

    return [{"messages": [turn(i) for i in range(rng.randint(2, 5))]} for _ in range(n)]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("num_iterations", [0, 9])
def test_nanochats_own_generator_gives_the_same_batches(tmp_path, rank, num_iterations):
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: chat_sft.py's loader needs its checkout")
    sys.path.insert(0, checkout)
    from nanochat.tokenizer import RustBPETokenizer

    with open(os.path.join(REPO, "data", "shakespeare_char", "input.txt")) as f:
        ChatTokenizer.train(iter(f.read()[:100_000].split("\n\n")), 400).save(
            str(tmp_path), token_bytes_pt=False
        )
    ours_tok, theirs_tok = (
        ChatTokenizer.from_directory(str(tmp_path)),
        RustBPETokenizer.from_directory(str(tmp_path)),
    )
    conversations = random_conversations(120)
    rows, block_size, accum, steps = 3, 127, 2, 12
    args = SimpleNamespace(
        device_batch_size=rows, max_seq_len=block_size, num_iterations=num_iterations
    )
    theirs, scope = chat_sft_code.loader(checkout, theirs_tok, conversations, args, rank, 2)
    ours = ConversationLoader(
        conversations,
        lambda c: render_conversation(ours_tok, c),
        ours_tok.bos_token_id,
        block_size,
        rows,
        rank=rank,
        world=2,
        num_iterations=num_iterations,
    )
    x, y = next(theirs)  # chat_sft's loop: one fetched before it starts, then one ahead
    progress = 0
    for _ in range(steps):
        ours_x, ours_y = ours.next(accum)
        for micro in range(accum):
            np.testing.assert_array_equal(ours_x[micro], x.numpy())
            np.testing.assert_array_equal(ours_y[micro], y.numpy())
            x, y = next(theirs)
            progress = max(progress, scope["approx_progress"])
        assert (ours.progress, ours.last_step) == (progress, scope["last_step"])
    assert ours.last_step  # the run reached its end within the steps compared
