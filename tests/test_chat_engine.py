"""python -m pytest tests/test_chat_engine.py -q

nanochat's engine over our model (run/chat_engine.py) against the torch reference written from its
engine.py (parity/nanochat_engine_reference.py) on the same weights, float32: greedy tokens and
masks, streamed and batched, several rows, the stops on <|assistant_end|>, <|bos|>, max_tokens and a
full context, and the Python tool, on random weights (the special tokens chosen among what the model
writes) and on a tiny model trained here to call the calculator (tests/helpers/chat_models.py),
whose forced output goes back in; GPT-2 through it as compute/generate.py. Sampling: a seed's
tokens repeat, rows differ, top_k=1 is greedy. Bad input is one line. With
NANOCHAT_CHECKOUT=/path/to/nanochat, nanochat's own Engine on its own GPT: generate_batch with its
own tokenizer gives the trained model's answer, the tool's output included, and its stream on the
random weights, tool and stop in play, equals ours and the reference's greedy and the reference's
sampled (its torch.Generator)."""

import os

import numpy as np
import pytest
import torch
from flax import nnx
from helpers import one_torch_thread
from helpers.chat_models import TOOL_CONFIG, VOCAB, expected_answer, tiny_tokenizer, tool_model

from archs.nanochat import NanochatGPT
from compute.generate import generate
from configurator import UsageError
from model import GPT, GPTConfig
from parity import nanochat_reference as ref
from parity.check_nanochat import OwnCode, perturbed
from parity.common import pin_numerics
from parity.nanochat_engine_reference import Engine as ReferenceEngine
from run.chat_engine import Engine

# the trained model's shape, so both models' steps are one compilation: block_size 64 (its windows
# all long), the prompt, the answer and the context's end in few steps
RANDOM = {**TOOL_CONFIG, "vocab_size": VOCAB}
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, RANDOM["vocab_size"], 10)]
STEPS = 24
ROWS = 2  # num_samples: each count of rows compiles its own steps


@pytest.fixture(scope="module", autouse=True)
def numerics():
    pin_numerics()
    with one_torch_thread():
        yield


class Tokens:
    """nanochat's tokenizer interface over ids alone: the special tokens the test names (each
    chosen among the tokens the model writes; -1, never written, for the others); ids decode to
    their numbers written out, and a text encodes to its characters' code points modulo the
    vocabulary."""

    def __init__(self, **special):
        self.special = {f"<|{name}|>": i for name, i in special.items()}

    def encode_special(self, name):
        return self.special.get(name, -1)

    def get_bos_token_id(self):
        return self.encode_special("<|bos|>")

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [ord(c) % RANDOM["vocab_size"] for c in text]


class Tool:
    """A calculator that records its expressions and answers each with `answer`."""

    def __init__(self, answer="7*6"):
        self.answer, self.calls = answer, []

    def __call__(self, expression):
        self.calls.append(expression)
        return self.answer


def reference_model(config, state):
    reference = ref.GPT(ref.Config(**config))
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return reference.eval()


@pytest.fixture(scope="module")
def random_state():
    """nanochat's state dict from the reference's init moved by noise: nothing zero or constant."""
    torch.manual_seed(0)
    return perturbed(
        {k: v.numpy() for k, v in ref.GPT(ref.Config(**RANDOM)).state_dict().items()}, 0
    )


@pytest.fixture(scope="module")
def engines(random_state):
    """(ours, the reference's) on the same random weights. One engine of ours for the module (it
    compiles for its model); each test gives it its tokenizer and tool."""
    ours = NanochatGPT.from_nanochat(RANDOM, random_state)
    return Engine(ours, Tokens()), ReferenceEngine(reference_model(RANDOM, random_state), Tokens())


@pytest.fixture(scope="module")
def greedy(engines):
    """The first row's greedy tokens with no special token in play."""
    engine = engines[0]
    return [column[0] for column, _ in engine.generate(PROMPT, ROWS, STEPS, temperature=0)]


def both(engines, tokens, tools=(None, None), **settings):
    """(ours, the reference's): each engine's generate stream (columns, masks) and generate_batch,
    with the same tokenizer, each with its tool."""
    runs = []
    for engine, tool in zip(engines, tools):
        engine.tokenizer, engine.tool = tokens, tool or Tool()
        stream = list(engine.generate(PROMPT, ROWS, **settings))
        runs.append((stream, engine.generate_batch(PROMPT, ROWS, **settings)))
    return runs


def test_greedy_stops_on_assistant_end_and_bos_as_the_reference(engines, greedy):
    for name, step in (("assistant_end", 5), ("bos", 9)):
        stop = greedy[step]
        first = greedy.index(stop)  # the row ends at the first time it writes it
        tokens = Tokens(**{name: stop})
        ours, theirs = both(engines, tokens, max_tokens=STEPS, temperature=0)
        assert ours == theirs
        (stream, (results, masks)) = ours
        # the stream stops with the column that ends every row; the results leave it out
        assert len(stream) == first + 1 and stream[-1][0] == [stop] * ROWS
        assert results == [PROMPT + greedy[:first]] * ROWS
        assert masks == [[0] * len(PROMPT) + [1] * first] * ROWS


def test_the_tool_runs_and_its_output_is_forced_as_the_reference(engines, greedy):
    # python_start and python_end among the tokens the model writes, an expression between
    start, end = greedy[1], greedy[4]
    assert len({start, end, *greedy[2:4]}) == 4, "the seed's greedy tokens repeat: pick others"
    tokens = Tokens(python_start=start, python_end=end, output_start=3, output_end=4)
    tools = Tool(), Tool()
    ours, theirs = both(engines, tokens, tools, max_tokens=STEPS, temperature=0)
    assert ours == theirs and tools[0].calls == tools[1].calls
    assert tools[0].calls[0] == tokens.decode(greedy[2:4])  # the tokens between, decoded
    (stream, (results, masks)) = ours
    forced = [3, *tokens.encode("7*6"), 4]
    after = len(PROMPT) + 5  # the first token after <|python_end|>
    for row, mask in zip(results, masks):
        assert row[: after - 5] == PROMPT and row[after - 5 : after] == greedy[:5]
        assert row[after : after + len(forced)] == forced
        assert mask[after - 5 : after + len(forced) + 1] == [1] * 5 + [0] * len(forced) + [1]
    assert len(stream) == STEPS


def test_max_tokens_and_a_full_context(engines):
    engine = engines[0]
    engine.tokenizer = Tokens()
    results, masks = engine.generate_batch(PROMPT, ROWS, max_tokens=7, temperature=0)
    assert [len(r) for r in results] == [len(PROMPT) + 7] * ROWS and masks[0][-7:] == [1] * 7
    assert list(engine.generate(PROMPT, ROWS, max_tokens=0)) == []
    # without max_tokens, until the context is full: the last token sampled sees block_size tokens
    block = RANDOM["sequence_len"]
    stream = list(engine.generate(PROMPT, ROWS, temperature=0))
    assert len(PROMPT) + len(stream) == block + 1
    full = (PROMPT * 7)[:block]
    assert len(list(engine.generate(full, ROWS, max_tokens=5, temperature=0))) == 1


@pytest.mark.slow
def test_sampling_repeats_with_its_seed_and_top_k_one_is_greedy(engines, greedy):
    engine = engines[0]
    engine.tokenizer = Tokens()
    runs = [engine.generate_batch(PROMPT, ROWS, max_tokens=12, seed=s)[0] for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({tuple(row) for row in runs[0]}) == ROWS  # each row its own draw
    rows, _ = engine.generate_batch(PROMPT, ROWS, max_tokens=12, temperature=1.0, top_k=1, seed=3)
    assert rows == [PROMPT + greedy[:12]] * ROWS


@pytest.mark.slow
def test_any_model_it_decodes_gpt2_as_generate_does():
    """GPT-2's cache is laid out (B * heads, S, hs): the prompt's copies follow its rows too."""
    config = GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config, nnx.Rngs(0))
    prompt = PROMPT[:5]
    results, _ = Engine(model, Tokens()).generate_batch(prompt, ROWS, max_tokens=8, temperature=0)
    expected = generate(model, np.array([prompt]), 8, temperature=0)[0].tolist()
    assert results == [expected] * ROWS


@pytest.fixture(scope="module")
def tool_chat():
    """(tokenizer, nanochat's config fields, state dict, our engine) of the model trained to call
    the tool."""
    tokenizer = tiny_tokenizer()
    config, state = tool_model(tokenizer)
    return tokenizer, config, state, Engine(NanochatGPT.from_nanochat(config, state), tokenizer)


TOOL_SETTINGS = dict(num_samples=ROWS, max_tokens=40, temperature=0)


def test_the_trained_model_calls_the_calculator_and_reads_its_output(tool_chat):
    tokenizer, config, state, engine = tool_chat
    prompt, answer, answer_masks = expected_answer(tokenizer)
    results, masks = engine.generate_batch(prompt, **TOOL_SETTINGS)
    # the calculator (run/sandbox.py) computed 12*7: its 84 forced back, not sampled
    assert "<|python_start|>12*7<|python_end|><|output_start|>84<|output_end|>" in (
        tokenizer.decode(results[0])
    )
    assert results == [prompt + answer] * ROWS
    assert masks == [[0] * len(prompt) + answer_masks] * ROWS
    reference = ReferenceEngine(reference_model(config, state), tokenizer)
    assert reference.generate_batch(prompt, **TOOL_SETTINGS) == (results, masks)


def own_code():
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own Engine needs its checkout")
    return OwnCode(checkout)


def test_nanochats_own_engine_gives_the_same_answer(tool_chat, tmp_path):
    own = own_code()
    tokenizer, config, state, engine = tool_chat
    from nanochat.tokenizer import RustBPETokenizer

    tokenizer.save(str(tmp_path), token_bytes_pt=False)  # nanochat reads only tokenizer.pkl
    theirs = RustBPETokenizer.from_directory(str(tmp_path))
    prompt, answer, answer_masks = expected_answer(tokenizer)
    expected = own.engine.Engine(own.model(config, state), theirs).generate_batch(
        prompt, **TOOL_SETTINGS
    )
    assert engine.generate_batch(prompt, **TOOL_SETTINGS) == expected
    assert expected == ([prompt + answer] * ROWS, [[0] * len(prompt) + answer_masks] * ROWS)


def test_nanochats_own_engine_streams_as_the_reference(engines, random_state, greedy, monkeypatch):
    """Its stream on random weights, the tool and a stop in play: greedy equal to ours and the
    reference's; sampled (its torch.Generator) equal to the reference's, which samples as its."""
    own = own_code()
    tokens = Tokens(
        python_start=greedy[1], python_end=greedy[4], output_start=3, output_end=4,
        assistant_end=greedy[12],
    )  # fmt: skip
    theirs = own.engine.Engine(own.model(RANDOM, random_state), tokens)
    calls = []
    for settings in (dict(temperature=0.0), dict(temperature=1.0, top_k=50, seed=1)):
        tools = [Tool() for _ in range(3)]
        calls.append(tools[0].calls)
        monkeypatch.setattr(own.engine, "use_calculator", tools[0])
        expected = list(theirs.generate(PROMPT, ROWS, max_tokens=STEPS, **settings))
        sides = engines if settings["temperature"] == 0 else engines[1:]
        for engine, tool in zip(sides, tools[1:]):
            engine.tokenizer, engine.tool = tokens, tool
            assert list(engine.generate(PROMPT, ROWS, max_tokens=STEPS, **settings)) == expected
            assert tool.calls == tools[0].calls
    assert calls[0]  # greedy, the tool ran


@pytest.mark.parametrize(
    "tokens, settings, message",
    [
        (PROMPT * 7, {}, "a prompt of 70 tokens is longer than the model's context (64)"),
        ([], {}, "an empty prompt: give at least one token"),
        (PROMPT, {"num_samples": 0}, "num_samples must be an integer >= 1, got 0"),
        (PROMPT, {"max_tokens": -1}, "max_tokens must be an integer >= 0 or None, got -1"),
        (PROMPT, {"temperature": -1.0}, "temperature must be >= 0"),
        ([5, VOCAB], {}, f"prompt token ids must be in [0, {VOCAB})"),
        ("hello", {}, "the prompt is a list of token ids"),
    ],
    ids=["too long", "empty", "no samples", "negative max_tokens", "temperature", "vocab", "text"],
)
def test_bad_input_is_one_line(engines, tokens, settings, message):
    with pytest.raises(UsageError) as error:
        next(engines[0].generate(tokens, **settings))
    assert message in str(error.value) and "\n" not in str(error.value)
