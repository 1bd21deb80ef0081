"""python -m pytest tests/test_conversations.py -q

nanochat's conversations rendered as its tokenizer renders them (dataio/conversations.py), with a
tiny tokenizer trained here: hand-worked cases whose ids are the special tokens' ids around the
tokenizer's encoding of each piece (a system message merged into the first user message, several
turns, GSM8K's calculator parts, an empty list of parts, truncation, the completion's priming), the
mask on exactly the assistant's supervised tokens; each bad conversation refused in one line naming
its fix. With NANOCHAT_CHECKOUT=/path/to/nanochat, nanochat's own RustBPETokenizer, read from the
same tokenizer directory, renders the same conversations and random ones to the same ids, masks and
completion prompts, and refuses every conversation ours refuses."""

import copy
import os
import random
import sys

import pytest

from configurator import UsageError
from dataio.chat_tokenizer import SPECIAL_TOKENS, ChatTokenizer
from dataio.conversations import (
    MAX_TOKENS,
    check_conversation,
    render_conversation,
    render_for_completion,
    visualize_tokenization,
)

VOCAB = 256 + len(SPECIAL_TOKENS) + 60  # the bytes, the specials and a few merges: fast to train
CORPUS = [
    "Why is the sky blue? Because of Rayleigh scattering of sunlight.",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May.",
    "hello world, hello tokenizer, hello hello hello. naïve café 你好 🙂",
    "def f(x):\n    return x + 1\n",
] * 8


def user(text):
    return {"role": "user", "content": text}


def assistant(content):
    return {"role": "assistant", "content": content}


SKY = {
    "messages": [
        {"role": "system", "content": "Answer in one line."},
        user("Why is the sky blue?"),
        assistant("Rayleigh scattering."),
    ]
}
TURNS = {
    "messages": [
        user("hi"),
        assistant("hello!"),
        user("how many r in strawberry?"),
        assistant("3"),
    ]
}
# GSM8K's answer "... 48/2 = <<48/2=24>>24 clips ..." as its task splits it into parts
GSM8K = {
    "messages": [
        user("Natalia sold 48 clips in April and half as many in May. How many in May?"),
        assistant(
            [
                {"type": "text", "text": "Natalia sold 48/2 = "},
                {"type": "python", "text": "48/2"},
                {"type": "python_output", "text": "24"},
                {"type": "text", "text": "24 clips in May.\n#### 24"},
            ]
        ),
    ],
    "letters": None,  # other keys, as ARC's "letters", are the task's own
}
NO_PARTS = {"messages": [user("say nothing"), assistant([])]}
OPEN = {"messages": [user("hi"), assistant("hello!"), user("and now?")]}  # the user's turn last
GOOD = {"sky": SKY, "turns": TURNS, "gsm8k": GSM8K, "no_parts": NO_PARTS, "open": OPEN}


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.train(iter(CORPUS), VOCAB)


def special(tok, name):
    return tok.encode_special(name)


def user_turn(tok, text):
    return [special(tok, "<|user_start|>"), *tok.encode(text), special(tok, "<|user_end|>")]


def test_a_system_message_opens_the_first_user_message(tok):
    ids, mask = render_conversation(tok, SKY)
    answer = tok.encode("Rayleigh scattering.")
    assert ids == [
        tok.bos_token_id,
        *user_turn(tok, "Answer in one line.\n\nWhy is the sky blue?"),
        special(tok, "<|assistant_start|>"),
        *answer,
        special(tok, "<|assistant_end|>"),
    ]
    # supervised: the answer and the end of the turn, nothing before
    assert mask == [0] * (len(ids) - len(answer) - 1) + [1] * (len(answer) + 1)
    merged = {"messages": [user("Answer in one line.\n\nWhy is the sky blue?"), SKY["messages"][2]]}
    assert render_conversation(tok, merged) == (ids, mask)


def test_every_assistant_turn_is_supervised_and_no_user_turn(tok):
    ids, mask = render_conversation(tok, TURNS)
    a_start, a_end = special(tok, "<|assistant_start|>"), special(tok, "<|assistant_end|>")
    pieces = [
        ([tok.bos_token_id], 0),
        (user_turn(tok, "hi"), 0),
        ([a_start], 0),
        (tok.encode("hello!") + [a_end], 1),
        (user_turn(tok, "how many r in strawberry?"), 0),
        ([a_start], 0),
        (tok.encode("3") + [a_end], 1),
    ]
    assert ids == [i for piece, _ in pieces for i in piece]
    assert mask == [m for piece, m in pieces for _ in piece]
    assert all(isinstance(i, int) for i in ids + mask)


def test_tool_calls_are_supervised_and_their_output_is_not(tok):
    ids, mask = render_conversation(tok, GSM8K)
    pieces = [
        ([tok.bos_token_id], 0),
        (user_turn(tok, GSM8K["messages"][0]["content"]), 0),
        ([special(tok, "<|assistant_start|>")], 0),
        (tok.encode("Natalia sold 48/2 = "), 1),
        (
            [special(tok, "<|python_start|>"), *tok.encode("48/2"), special(tok, "<|python_end|>")],
            1,
        ),
        (
            [special(tok, "<|output_start|>"), *tok.encode("24"), special(tok, "<|output_end|>")],
            0,
        ),
        (tok.encode("24 clips in May.\n#### 24") + [special(tok, "<|assistant_end|>")], 1),
    ]
    assert ids == [i for piece, _ in pieces for i in piece]
    assert mask == [m for piece, m in pieces for _ in piece]
    # a string is one text part
    as_text = copy.deepcopy(TURNS)
    as_text["messages"][1]["content"] = [{"type": "text", "text": "hello!"}]
    assert render_conversation(tok, as_text) == render_conversation(tok, TURNS)


def test_an_empty_list_of_parts_and_an_open_user_turn(tok):
    a_start, a_end = special(tok, "<|assistant_start|>"), special(tok, "<|assistant_end|>")
    ids, mask = render_conversation(tok, NO_PARTS)
    assert ids == [tok.bos_token_id, *user_turn(tok, "say nothing"), a_start, a_end]
    assert mask == [0] * (len(ids) - 1) + [1]  # it learns to stop at once
    ids, mask = render_conversation(tok, OPEN)
    assert ids[-len(user_turn(tok, "and now?")) :] == user_turn(tok, "and now?")
    assert mask[-len(user_turn(tok, "and now?")) :] == [0] * len(user_turn(tok, "and now?"))


def test_truncation_cuts_ids_and_mask_together(tok):
    ids, mask = render_conversation(tok, GSM8K, max_tokens=None)
    assert render_conversation(tok, GSM8K) == (ids, mask)  # shorter than MAX_TOKENS: whole
    for cut in (1, 5, len(ids) - 3, len(ids), len(ids) + 4):
        assert render_conversation(tok, GSM8K, max_tokens=cut) == (ids[:cut], mask[:cut])
    long = {"messages": [user("hello " * 3000), assistant("world")]}
    ids, mask = render_conversation(tok, long)
    assert len(ids) == len(mask) == MAX_TOKENS and set(mask) == {0}


def test_a_completion_is_primed_with_assistant_start(tok):
    kept = copy.deepcopy(TURNS)
    ids = render_for_completion(tok, TURNS)
    assert TURNS == kept  # the caller's conversation is not touched
    prompt, _ = render_conversation(tok, {"messages": TURNS["messages"][:3]})
    assert ids == prompt + [special(tok, "<|assistant_start|>")]
    assert ids[-len(user_turn(tok, "how many r in strawberry?")) - 1 : -1] == user_turn(
        tok, "how many r in strawberry?"
    )
    # GSM8K's tool parts go with the answer; the system message stays merged
    assert render_for_completion(tok, GSM8K) == [
        tok.bos_token_id,
        *user_turn(tok, GSM8K["messages"][0]["content"]),
        special(tok, "<|assistant_start|>"),
    ]
    assert render_for_completion(tok, SKY)[1:-1] == user_turn(
        tok, "Answer in one line.\n\nWhy is the sky blue?"
    )
    # as nanochat's: cut to max_tokens, then primed
    full = render_for_completion(tok, TURNS, max_tokens=None)
    assert render_for_completion(tok, TURNS, max_tokens=4) == full[:4] + full[-1:]


def test_the_picture_colours_supervised_tokens_green(tok):
    ids, mask = render_conversation(tok, NO_PARTS)
    picture = visualize_tokenization(tok, ids, mask, with_token_id=True)
    red, green, gray, reset = "\033[91m", "\033[92m", "\033[90m", "\033[0m"
    assert picture.startswith(f"{red}<|bos|>{reset}|{gray}({ids[0]}){reset}|{red}")
    assert picture.endswith(f"|{green}<|assistant_end|>{reset}|{gray}({ids[-1]}){reset}")
    assert (picture.count(green), picture.count(red)) == (sum(mask), len(mask) - sum(mask))
    assert visualize_tokenization(tok, ids, mask).count(gray) == 0


def no_system(*messages):
    return {"messages": list(messages)}


BAD = {
    "empty": ({"messages": []}, "an empty conversation: give it a user message"),
    "a list, not a dict": ([user("hi")], r'it holds a list; a conversation is \{"messages"'),
    "no messages": ({"turns": []}, "it holds no messages; a conversation is"),
    "a message without a role": (no_system({"content": "hi"}), r"messages\[0\] is a dict, not"),
    "the assistant first": (
        no_system(assistant("hi")),
        r"messages\[0\] is from 'assistant' where the user speaks; .* in turn",
    ),
    "two users": (
        no_system(user("hi"), user("again")),
        r"messages\[1\] is from 'user' where the assistant speaks",
    ),
    "a system message later": (
        no_system(user("hi"), assistant("yo"), {"role": "system", "content": "be nice"}),
        r"messages\[2\] is from 'system' where the user speaks.*system message only first",
    ),
    "a system message alone": (
        no_system({"role": "system", "content": "be nice"}),
        "a system message alone: follow it with the user message",
    ),
    "a tool role": (
        no_system(user("hi"), {"role": "tool", "content": "2"}),
        r"messages\[1\] is from 'tool' where the assistant speaks",
    ),
    "a user's parts": (
        no_system(user([{"type": "text", "text": "hi"}])),
        r"messages\[0\] \(user\) holds a list: a user's content is a str",
    ),
    "an assistant's number": (
        no_system(user("hi"), assistant(3)),
        r"messages\[1\] \(assistant\) holds 3: an assistant's content is a string or a list",
    ),
    "an assistant's dict": (
        no_system(user("hi"), assistant({"type": "text", "text": "hi"})),
        r"messages\[1\] \(assistant\) holds a dict: an assistant's content is a string or a list",
    ),
    "an unknown part type": (
        no_system(user("hi"), assistant([{"type": "image", "text": "x"}])),
        r"messages\[1\]\.content\[0\] is the part type 'image': .*\"python_output\"",
    ),
    "a part that is a string": (
        no_system(user("hi"), assistant(["hello"])),
        r"messages\[1\]\.content\[0\] is 'hello': an assistant's content",
    ),
    "a part without text": (
        no_system(user("hi"), assistant([{"type": "python"}])),
        r"content\[0\] \(python\) has the text a NoneType: .*\"text\": str",
    ),
    "a part's text a list": (
        no_system(user("hi"), assistant([{"type": "text", "text": ["a", "b"]}])),
        r"content\[0\] \(text\) has the text a list",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_conversations_are_one_line(tok, name):
    conversation, expected = BAD[name]
    for render in (render_conversation, render_for_completion):
        with pytest.raises(UsageError, match=expected) as caught:
            render(tok, conversation)
        assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)
        assert str(caught.value).startswith("conversation: ")
    with pytest.raises(UsageError, match=expected) as caught:
        check_conversation(conversation, where="tasks.jsonl:7")  # a task file names its line
    assert str(caught.value).startswith("tasks.jsonl:7: ")


def test_a_completion_needs_the_assistants_message_last(tok):
    with pytest.raises(UsageError, match="the last message is from the user: a completion's") as e:
        render_for_completion(tok, OPEN)
    assert "\n" not in str(e.value)


# ---- against nanochat's own tokenizer ------------------------------------------------------------

PIECES = [
    "hello",
    " world",
    "48/2",
    "naïve café",
    "你好 🙂",
    "\n\n",
    "",
    "  ",
    "<|assistant_end|>",  # text that spells a special token stays text
    "def f(x):\n    return x + 1\n",
    "#### 24",
]


def random_conversation(rng):
    """An optional system message, 1-6 turns, the assistant's content a string or 0-5 parts of any
    type, texts of random pieces."""

    def text():
        return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))

    messages = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
    for turn in range(rng.randint(1, 6)):
        if turn % 2 == 0:
            messages.append(user(text()))
        elif rng.random() < 0.4:
            messages.append(assistant(text()))
        else:
            kinds = ("text", "python", "python_output")
            parts = [{"type": rng.choice(kinds), "text": text()} for _ in range(rng.randint(0, 5))]
            messages.append(assistant(parts))
    return {"messages": messages}


def nanochats_tokenizer(tok, directory):
    """nanochat's RustBPETokenizer over the directory `tok` saves, or a skip without a checkout."""
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own tokenizer needs its checkout")
    sys.path.insert(0, checkout)
    from nanochat.tokenizer import RustBPETokenizer

    tok.save(str(directory), token_bytes_pt=False)  # nanochat reads only tokenizer.pkl
    return RustBPETokenizer.from_directory(str(directory))


def test_nanochats_own_tokenizer_renders_the_same(tok, tmp_path):
    theirs = nanochats_tokenizer(tok, tmp_path)
    rng = random.Random(0)
    conversations = list(GOOD.values()) + [random_conversation(rng) for _ in range(300)]
    n_tokens = n_supervised = 0
    for conversation in conversations:
        kept = copy.deepcopy(conversation)
        ids, mask = render_conversation(tok, conversation)
        assert theirs.render_conversation(conversation) == (ids, mask), conversation
        n_tokens, n_supervised = n_tokens + len(ids), n_supervised + sum(mask)
        cut = rng.randint(1, len(ids) + 2)
        assert theirs.render_conversation(conversation, max_tokens=cut) == render_conversation(
            tok, conversation, max_tokens=cut
        )
        if conversation["messages"][-1]["role"] == "assistant":
            assert theirs.render_for_completion(conversation) == render_for_completion(
                tok, conversation
            )
        assert theirs.visualize_tokenization(ids, mask, True) == visualize_tokenization(
            tok, ids, mask, True
        )
        assert conversation == kept
    # the random conversations reach every kind of token, supervised and not
    assert 0.2 < n_supervised / n_tokens < 0.8, (n_supervised, n_tokens)


def test_nanochat_refuses_what_we_refuse(tok, tmp_path):
    theirs = nanochats_tokenizer(tok, tmp_path)
    accepted = []
    for name, (conversation, _) in BAD.items():
        try:
            accepted.append((name, theirs.render_conversation(conversation)[0]))
        except Exception:  # noqa: BLE001 - nanochat asserts, indexes, raises as it happens to
            pass
    # but a part's text given as a list: nanochat encodes it as a batch, and its lists join the ids
    assert [name for name, _ in accepted] == ["a part's text a list"]
    assert not all(isinstance(i, int) for i in accepted[0][1])
