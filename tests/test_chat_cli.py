"""chat_cli.py, the terminal chat: its --prompt answer is the engine's greedy tokens decoded; in a
real terminal (tmux) a message is answered on the screen, a second turn primes the whole
conversation, and Ctrl-C ends it with exit 0 and no traceback; a message too long for the context is
one line and the chat goes on; bad settings are one line. With NANOCHAT_CHECKOUT set, nanochat's own
`python -m scripts.chat_cli -i base -p ... -t 0` on the same checkpoint prints the same reply.

The model: tests/helpers/chat_models.py's, trained until its greedy answer to "what is 12*7?" is a
call of the Python tool, its output forced and read, saved as nanochat's base checkpoint
(base_checkpoints/d2 beside tokenizer/, nanochat's base directory)."""

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO
from helpers.chat_models import TOOL_CONVERSATION, expected_answer, tiny_tokenizer, tool_model

import chat_cli
from archs.nanochat import NanochatGPT
from configurator import UsageError
from dataio.conversations import render_for_completion
from dataio.nanochat_checkpoint import save_nanochat
from run.chat_engine import Engine

QUESTION = TOOL_CONVERSATION["messages"][0]["content"]  # "what is 12*7?"
TOOL_TEXT = "<|python_start|>12*7<|python_end|><|output_start|>84<|output_end|>"
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(nanochat's base directory, the tokenizer, our model of its checkpoint)."""
    root = tmp_path_factory.mktemp("nanochat_base")
    tokenizer = tiny_tokenizer()
    config, state = tool_model(tokenizer)
    model = NanochatGPT.from_nanochat(config, state)
    save_nanochat(model, str(root / "base_checkpoints" / "d2"), 0, {})
    tokenizer.save(str(root / "tokenizer"))
    return root, tokenizer, model


def checkpoint(base):
    return str(base[0] / "base_checkpoints" / "d2")


def greedy_reply(base, primed):
    """What the engine's greedy tokens after `primed` decode to, the stop token left out."""
    _, tokenizer, model = base
    rows, _ = Engine(model, tokenizer).generate_batch(primed, max_tokens=256, temperature=0)
    return tokenizer.decode(rows[0][len(primed) :])


def completion(tokenizer, *messages):
    """The tokens a turn primes: the conversation so far, rendered as chat_sft renders it."""
    roles = ["user", "assistant"] * len(messages)
    messages = [{"role": r, "content": m} for r, m in zip(roles, messages)]
    last = {"role": "assistant", "content": ""}  # render_for_completion drops it
    return render_for_completion(tokenizer, {"messages": messages + [last]})


@pytest.mark.slow
def test_prompt_prints_the_engines_greedy_answer(base, capsys):
    _, tokenizer, _ = base
    argv = [f"--init_from={checkpoint(base)}", f"--prompt={QUESTION}", "--temperature=0"]
    assert chat_cli.main(argv) == 0
    primed, answer, _ = expected_answer(tokenizer)
    expected = greedy_reply(base, primed)
    # the model answers through the tool, its output forced, as it was trained to
    assert expected == tokenizer.decode(answer) and TOOL_TEXT in expected
    assert capsys.readouterr().out == expected + "\n"


def test_a_prompt_is_text_as_typed():
    """--prompt=42 asks about 42 (configure would read it as the int 42 and refuse it)."""
    for text in ("42", "True", "[1, 2]", "a=b", ""):
        assert chat_cli.settings([f"--prompt={text}", "--top_k=3"])["prompt"] == text
    assert chat_cli.settings(["--prompt=1", "--prompt=2"])["prompt"] == "2"  # the last one wins


class Lines:
    """input() of a user who types `lines`, then Ctrl-D."""

    def __init__(self, *lines):
        self.lines = list(lines)

    def __call__(self, prompt):
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)


def test_too_long_is_one_line_and_clear_starts_over(base, capsys):
    _, tokenizer, model = base
    cfg = dict(chat_cli.defaults, temperature=0)
    chat = chat_cli.Chat(model, tokenizer, cfg)
    long = " ".join(["hello world"] * 40)  # well past the 64-token context
    assert chat_cli.converse(chat, Lines(QUESTION, long, QUESTION, "clear", "quit", QUESTION)) == 0
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "longer than the model's context (64)" in errors[0]
    assert "type 'clear'" in errors[0]
    # the first answer, then (the long message dropped, the conversation as it was) the second,
    # primed with the first; then 'clear' and 'quit': the question after them is never read
    assert out.count(TOOL_TEXT) == 2 and "Conversation cleared." in out
    assert out.rstrip().endswith("Goodbye!")
    assert chat.tokens == [tokenizer.get_bos_token_id()]


class Interrupting(io.StringIO):
    """The terminal of a user who presses Ctrl-C as the reply's first token prints."""

    def write(self, text):
        if text and "Assistant" not in text and not self.getvalue().endswith("\n"):
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def test_ctrl_c_while_a_reply_streams_ends_the_chat(base, capsys):
    _, tokenizer, model = base
    out = Interrupting()
    chat = chat_cli.Chat(model, tokenizer, dict(chat_cli.defaults, temperature=0), out=out)
    previous = signal.getsignal(signal.SIGINT)
    try:
        chat_cli.stop_on_interrupt(chat)
        assert chat_cli.converse(chat, Lines(QUESTION, QUESTION)) == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    # the reply stopped within a token or two of the first (the handler runs between bytecodes),
    # its tokens kept with <|assistant_end|>; the second message is never read
    reply = out.getvalue()
    assert reply.startswith("\nAssistant: L") and TOOL_TEXT not in reply
    assert chat.tokens[-1] == tokenizer.encode_special("<|assistant_end|>")
    assert capsys.readouterr().out.endswith("Goodbye!\n")


def tmux(*args):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_for(session, text, count=1, timeout=60):
    """The screen once `text` is on it `count` times."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        screen = tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", session)
        if screen.count(text) >= count:
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never came on the screen {count} times:\n{screen}")


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="no tmux: the terminal test types into one"
)
def test_in_a_real_terminal(base, tmp_path):
    """Typed into tmux: two turns, then Ctrl-C. The tokens each turn primes are logged by a wrapper
    around the engine's generate (the process is chat_cli's main, the wrapper only records)."""
    _, tokenizer, _ = base
    log = tmp_path / "primed.jsonl"
    wrapper = tmp_path / "logged_chat.py"
    wrapper.write_text(
        f"import json, sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "import chat_cli\nfrom configurator import exit_on_bad_input\nfrom run import chat_engine\n"
        "generate = chat_engine.Engine.generate\n"
        "def logged(self, tokens, *args, **kwargs):\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(json.dumps(list(tokens)) + '\\n')\n"
        "    yield from generate(self, tokens, *args, **kwargs)\n"
        "chat_engine.Engine.generate = logged\nexit_on_bad_input(chat_cli.main)\n"
    )
    session, second = f"chat_cli_{os.getpid()}", "and hello?"
    command = (
        f"cd {REPO} && JAX_PLATFORMS=cpu {sys.executable} {wrapper} --init_from={checkpoint(base)} "
        f"--temperature=0 2>/dev/null; echo EXIT=$?; sleep 60"
    )
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", command)
    try:
        wait_for(session, "User:")
        tmux("send-keys", "-t", session, QUESTION, "Enter")
        wait_for(session, "User:", 2)  # the reply is whole once the next prompt is there
        tmux("send-keys", "-t", session, second, "Enter")
        wait_for(session, "User:", 3)
        tmux("send-keys", "-t", session, "C-c")
        screen = wait_for(session, "EXIT=")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    replies = re.findall(r"Assistant: (.*)", screen)
    primed = [json.loads(line) for line in log.read_text().splitlines()]
    first_answer = expected_answer(tokenizer)[1]
    # each turn primes the whole conversation: the second holds the first reply and its tool call
    answer_parts = TOOL_CONVERSATION["messages"][1]["content"]
    assert primed == [
        completion(tokenizer, QUESTION),
        completion(tokenizer, QUESTION, answer_parts, second),
    ]
    assert replies == [greedy_reply(base, p) for p in primed]
    assert replies[0] == tokenizer.decode(first_answer)
    assert "Goodbye!" in screen and "EXIT=0" in screen and "Traceback" not in screen


@pytest.mark.parametrize(
    "setting, message",
    [
        ("--temperature=-1", "temperature"),
        ("--max_new_tokens=0", "max_new_tokens must be an integer >= 1"),
        ("--top_k=-2", "top_k"),
        ("--init_from=/no/such/checkpoint", "/no/such/checkpoint"),
    ],
)
def test_bad_input_is_one_line(setting, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        chat_cli.main([setting, "--prompt=hi"])


def test_a_checkpoint_without_its_tokenizer_is_one_line(base, tmp_path):
    alone = tmp_path / "d2"
    shutil.copytree(checkpoint(base), alone)
    with pytest.raises(UsageError, match="no tokenizer/tokenizer.pkl is in"):
        chat_cli.main([f"--init_from={alone}", "--prompt=hi"])


def test_nanochats_own_chat_cli_prints_the_same_reply(base, tmp_path):
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: nanochat's own chat_cli needs its checkout")
    root = base[0]
    ours = subprocess.run(
        [sys.executable, "chat_cli.py", f"--init_from={checkpoint(base)}",
         f"--tokenizer={root / 'tokenizer'}", f"--prompt={QUESTION}", "--temperature=0"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(root), NANOCHAT_DTYPE="float32")
    env |= {"TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": checkout}
    theirs = subprocess.run(
        [sys.executable, "-m", "scripts.chat_cli", "-i", "base", "-p", QUESTION, "-t", "0"],
        cwd=checkout, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    # nanochat prints every token the engine yields, the stop token too; ours leaves it out
    reply = theirs.stdout.split("Assistant: ", 1)[1].rstrip("\n")
    assert reply.endswith("<|assistant_end|>")
    assert ours.stdout == reply.removesuffix("<|assistant_end|>") + "\n"
    assert TOOL_TEXT in ours.stdout
