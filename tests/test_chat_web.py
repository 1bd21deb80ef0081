"""python -m pytest tests/test_chat_web.py -q

chat_web.py, the chat page's server (run/chat_server.py), in a thread on a free port: the page is
served; a streamed reply at temperature 0 is what the engine's greedy tokens decode to, a piece an
event; a second turn primes the tokens chat_cli's would; each bad request is one line with a 4xx
and the next good one is answered; 8 chats at once each get their own reply; one more than the
bound is refused "busy" and the rest answered; a client that goes away stops its sampling. Marked
slow: `python chat_web.py --init_from=DIR --tokenizer=DIR --port=N` serves the page, and Ctrl-C
stops it with exit 0.

The model: nanochat's GPT at tests/helpers/chat_models.py's size with random weights (its replies
are bytes at random, many of them no whole character: the streamed decoding's hard case), made in
a moment; the browser's test (test_chat_web_browser.py) talks to the trained one."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from helpers import REPO
from helpers.chat_models import TOOL_CONFIG, TOOL_CONVERSATION, tiny_tokenizer

import chat_web
from archs.nanochat import NanochatGPT
from configurator import HelpRequested, UsageError, help_text
from dataio.conversations import render_for_completion
from dataio.nanochat_checkpoint import save_nanochat
from parity import nanochat_reference as ref
from run.chat_server import parse_chat, reply_parts

QUESTION = TOOL_CONVERSATION["messages"][0]["content"]  # "what is 12*7?"
TOOL_TEXT = "Let me compute: <|python_start|>12*7<|python_end|><|output_start|>84<|output_end|>"


@pytest.fixture(scope="module")
def model():
    """(tokenizer, model): random weights, nanochat's init (zero projections among them) moved off
    by noise, so that each prompt has its own greedy reply."""
    tokenizer = tiny_tokenizer()
    config = {**TOOL_CONFIG, "vocab_size": tokenizer.n_vocab}
    torch.manual_seed(0)
    state = ref.GPT(ref.Config(**config)).state_dict()
    noise = np.random.default_rng(0)
    state = {
        k: v.numpy() + noise.normal(0, 0.3, v.shape).astype(np.float32) for k, v in state.items()
    }
    return tokenizer, config, NanochatGPT.from_nanochat(config, state)


@pytest.fixture(scope="module")
def server(model):
    """A server on a free port, greedy by default; its log lines in server.lines."""
    tokenizer, _, gpt = model
    lines = []
    cfg = dict(chat_web.defaults, port=0, temperature=0.0, max_chats=8)
    server = chat_web.serve(gpt, tokenizer, cfg, log=lines.append)
    server.lines, server.engine = lines, server.chats.engine  # the tests may pace chats.engine
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    server.chats.close()


def port_of(server):
    return server.server_address[1]


def request(port, method, path, body=None, headers=None, timeout=60):
    """(status, headers, body text) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body, headers or {})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, response.headers, text


def chat(port, body, timeout=60):
    """(status, the events of a streamed reply, or the refusal's body) of POST /chat/completions."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, text = request(port, "POST", "/chat/completions", data, timeout=timeout)
    if status != 200:
        return status, text
    assert text.endswith("\n\n")
    return status, [json.loads(e.removeprefix("data: ")) for e in text[:-2].split("\n\n")]


def user(*texts):
    """A conversation of `texts`, the user's and the assistant's in turn."""
    roles = ["user", "assistant"] * len(texts)
    return [{"role": r, "content": t} for r, t in zip(roles, texts)]


def prompt_of(tokenizer, text):
    """The tokens chat_cli primes for `text` as the first message."""
    special = tokenizer.encode_special
    return [special("<|bos|>"), special("<|user_start|>"), *tokenizer.encode(text)] + [
        special("<|user_end|>"),
        special("<|assistant_start|>"),
    ]


def greedy_reply(server, prompt, max_tokens):
    """What the engine's greedy tokens after `prompt` decode to (chat_cli's --prompt's print)."""
    tokenizer = server.chats.tokenizer
    rows, _ = server.engine.generate_batch(prompt, max_tokens=max_tokens, temperature=0)
    return tokenizer.decode(rows[0][len(prompt) :])


def reply_of(events):
    return "".join(e["token"] for e in events if "token" in e)


def test_the_page_and_health(server):
    status, headers, page = request(port_of(server), "GET", "/")
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    for part in ('id="input"', 'id="send"', 'id="stop"', 'id="new-chat"', "/chat/completions"):
        assert part in page
    assert "http://" not in page and "https://" not in page  # nothing from outside
    status, _, health = request(port_of(server), "GET", "/health")
    assert status == 200
    assert json.loads(health) == {"status": "ok", "chats_in_flight": 0, "max_chats": 8}


def test_a_greedy_reply_streams_the_engines_tokens_a_piece_an_event(model, server):
    tokenizer = model[0]
    status, events = chat(port_of(server), {"messages": user(QUESTION), "max_tokens": 24})
    assert status == 200
    expected = greedy_reply(server, prompt_of(tokenizer, QUESTION), 24)
    assert reply_of(events) == expected and "\ufffd" in expected  # bytes cut mid-character
    done = events[-1]
    assert done["done"] and done["reason"] in ("stop", "length")
    # each token its event, but those that end no character (their bytes come with the next)
    pieces = [e for e in events if "token" in e]
    assert 0 < len(pieces) <= done["tokens"] and all(e["token"] for e in pieces)
    assert sum(e["token"].count("\ufffd") for e in pieces) == expected.count("\ufffd")
    assert server.lines[-1].startswith("127.0.0.1 POST /chat/completions 200 ")


def test_a_second_turn_primes_what_chat_cli_primes(model):
    """The reply's text, its tool call spelled out, read back as the call's parts: the same tokens
    as chat_cli's second turn (its test holds those to render_for_completion's)."""
    tokenizer = model[0]
    answer_parts = TOOL_CONVERSATION["messages"][1]["content"]
    shown = TOOL_TEXT + "It is 84."  # as the page shows the reply
    assert reply_parts(shown) == answer_parts
    conversation = {"messages": user(QUESTION, answer_parts, "and hello?", "")}
    expected = render_for_completion(tokenizer, conversation)
    prompt, settings = parse(tokenizer, {"messages": user(QUESTION, shown, "and hello?")})
    assert prompt == expected
    assert settings == dict(temperature=0.6, top_k=50, max_tokens=256)
    # a system message is merged into the first user message, as in finetuning's conversations
    system = [{"role": "system", "content": "Be brief."}, *user("hi")]
    assert parse(tokenizer, {"messages": system})[0] == render_for_completion(
        tokenizer, {"messages": [*system, {"role": "assistant", "content": ""}]}
    )
    # a stray marker is text; a call cut off runs to the end
    assert reply_parts("a<|python_end|>b") == [{"type": "text", "text": "a<|python_end|>b"}]
    assert reply_parts("x<|python_start|>1+") == [
        {"type": "text", "text": "x"},
        {"type": "python", "text": "1+"},
    ]


def parse(tokenizer, request):
    defaults = dict(temperature=0.6, top_k=50, max_tokens=256)
    return parse_chat(json.dumps(request).encode(), tokenizer, 64, defaults)


LONG = " ".join(["hello world"] * 40)  # well past the 64-token context
BAD = [
    (b"{not json", 400, "malformed JSON"),
    (b"\xff\xfe{", 400, "malformed JSON"),
    (b"[1, 2]", 400, "the body is a JSON object"),
    ({"messages": "hi"}, 400, "the body is a JSON object"),
    ({"messages": []}, 400, "an empty conversation"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "is from 'robot' where the user"),
    ({"messages": user("hi", "hello")[1:]}, 400, "is from 'assistant' where the user speaks"),
    ({"messages": [*user("hi"), *user("again")]}, 400, "is from 'user' where the assistant"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "a system message alone"),
    ({"messages": user("hi", "hello")}, 400, "the last message is the assistant's"),
    ({"messages": user("   ")}, 400, "the last message is empty"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, 400, "a user's content is a str"),
    ({"messages": user("a", [{"type": "image", "text": "x"}], "b")}, 400, "the part type 'image'"),
    ({"messages": user(*["hi"] * 501)}, 400, "501 messages, over the limit of 500"),
    ({"messages": user("x" * 8001)}, 400, "8001 characters, over the limit of 8000"),
    ({"messages": user(*["x" * 7000] * 5)}, 400, "35000 characters, over the limit of 32000"),
    ({"messages": user(LONG)}, 400, "longer than the model's context (64): start a new chat"),
    ({"messages": user("hi"), "temperature": 2.5}, 400, "temperature must be a number in [0.0, 2."),
    ({"messages": user("hi"), "temperature": True}, 400, "temperature must be a number"),
    ({"messages": user("hi"), "top_k": -1}, 400, "top_k must be an integer in [0, 200], got -1"),
    ({"messages": user("hi"), "top_k": 1.5}, 400, "top_k must be an integer"),
    ({"messages": user("hi"), "max_tokens": 0}, 400, "max_tokens must be an integer in [1, 4096]"),
    ({"messages": user("hi"), "max_tokens": "9"}, 400, 'max_tokens must be an integer in [1, 40'),
]  # fmt: skip


def one_line_error(text):
    assert text.endswith("\n") and text.count("\n") == 1, text
    body = json.loads(text)
    assert list(body) == ["error"]
    return body["error"]


def test_each_bad_request_is_one_line_and_the_next_is_answered(server):
    port = port_of(server)
    for body, status, message in BAD:
        got, text = chat(port, body)
        assert got == status and message in one_line_error(text), (body, text)
        assert server.lines[-1].startswith(f"127.0.0.1 POST /chat/completions {status} error: ")
        got, events = chat(port, {"messages": user("hi"), "max_tokens": 2})
        assert got == 200 and events[-1]["done"], body
    # http.server's own refusals and ours beyond the API, each one line too
    for method, path, body, headers, status, message in [
        ("GET", "/nowhere", None, {}, 404, "no page at /nowhere"),
        ("POST", "/v1/chat", b"{}", {}, 404, "no API at /v1/chat"),
        ("PUT", "/", b"", {}, 501, "Unsupported method ('PUT')"),
    ]:
        got, _, text = request(port, method, path, body, headers)
        assert got == status and message in one_line_error(text), text
    # a body without its length, or over the limit, is refused on its headers, unread
    for headers, status, message in [
        ({}, 411, "give the body's Content-Length"),
        (
            {"Content-Length": str(10**7)},
            413,
            "a body of 10000000 bytes, over the limit of 1048576",
        ),
    ]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.putrequest("POST", "/chat/completions")
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == status
        assert message in one_line_error(response.read().decode())
        conn.close()
    assert chat(port, {"messages": user("hi"), "max_tokens": 2})[0] == 200


def test_eight_chats_at_once_each_get_their_own_reply(model, server):
    """8 chats at once, each its own prompt and max_tokens: each streams what it alone would get,
    none refused, none mixed up, all within the time bound."""
    tokenizer = model[0]
    prompts = ["hello", QUESTION, "hello world", "tokenizer", "Let me", "compute that", "84", "w"]
    requests = [{"messages": user(p), "max_tokens": 6 + i} for i, p in enumerate(prompts)]
    expected = [
        greedy_reply(server, prompt_of(tokenizer, r["messages"][0]["content"]), r["max_tokens"])
        for r in requests
    ]
    assert len(set(expected)) == len(expected)  # a reply given to another chat would show
    began = time.time()
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: chat(port_of(server), r, timeout=60), requests))
    assert time.time() - began < 60
    assert [status for status, _ in answers] == [200] * len(requests)
    assert [reply_of(events) for _, events in answers] == expected
    assert json.loads(request(port_of(server), "GET", "/health")[2])["chats_in_flight"] == 0


class Paced:
    """The server's engine, its steps slowed (`delay` seconds each) or held until `gate` is set;
    the steps each generate took in `steps`."""

    def __init__(self, engine, delay=0.0, gate=None):
        self.engine, self.delay, self.gate, self.steps = engine, delay, gate, []

    def generate(self, *args, **kwargs):
        self.steps.append(0)
        n = len(self.steps) - 1
        if self.gate is not None:
            assert self.gate.wait(30)
        for step in self.engine.generate(*args, **kwargs):
            self.steps[n] += 1
            time.sleep(self.delay)
            yield step


def wait_until(condition, timeout=10):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_one_more_than_the_bound_is_busy_and_the_rest_are_answered(server, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(server.chats, "engine", Paced(server.chats.engine, gate=gate))
    monkeypatch.setattr(server.chats, "max_chats", 2)
    port = port_of(server)
    body = {"messages": user("hello"), "max_tokens": 5}
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(chat, port, body) for _ in range(2)]
        wait_until(lambda: server.chats.in_flight == 2)
        status, headers, text = request(port, "POST", "/chat/completions", json.dumps(body))
        assert status == 503 and headers["Retry-After"] == "1"
        assert one_line_error(text).startswith("busy: 2 chats in flight")
        gate.set()
        answers = [f.result(timeout=60) for f in held]
    expected = greedy_reply(server, prompt_of(server.chats.tokenizer, "hello"), 5)
    assert [(s, reply_of(e)) for s, e in answers] == [(200, expected)] * 2
    assert chat(port, body)[0] == 200  # and the next is taken


def test_each_stream_moves_while_another_is_open(server, monkeypatch):
    """One worker samples every chat in turn: a second chat's first piece comes while the first
    has most of its reply to go."""
    monkeypatch.setattr(server.chats, "engine", Paced(server.chats.engine, delay=0.02))
    port, arrivals = port_of(server), {}

    def timed(name, max_tokens):
        chat(port, {"messages": user("hello"), "max_tokens": max_tokens})
        arrivals[name] = time.time()

    first = threading.Thread(target=timed, args=("long", 40))
    first.start()
    wait_until(lambda: server.chats.engine.steps and server.chats.engine.steps[0] > 0)
    timed("short", 1)
    first.join(60)
    assert arrivals["short"] < arrivals["long"]


def test_a_client_gone_mid_reply_stops_its_sampling(server, monkeypatch):
    paced = Paced(server.chats.engine, delay=0.05)
    monkeypatch.setattr(server.chats, "engine", paced)
    port = port_of(server)
    body = json.dumps({"messages": user("hello"), "max_tokens": 60}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"data: " not in received:
            piece = sock.recv(4096)
            assert piece, received
            received += piece
    assert received.startswith(b"HTTP/1.0 200 OK")
    wait_until(lambda: server.chats.in_flight == 0, timeout=5)
    time.sleep(0.3)  # the worker's next rounds: none for it
    # 60 steps were asked for (the context holds 51): it stopped within a few of the close
    assert paced.steps[0] < 15, paced.steps
    assert server.lines[-1].endswith(")") and "client gone" in server.lines[-1]
    assert chat(port, {"messages": user("hi"), "max_tokens": 2})[0] == 200


def test_bad_settings_are_one_line_and_help_lists_them(model, server):
    taken = dict(chat_web.defaults, port=port_of(server))
    with pytest.raises(UsageError, match=f"cannot serve on 127.0.0.1:{port_of(server)}: "):
        chat_web.serve(model[2], model[0], taken)
    for argv, message in [
        (["--temperature=3"], "temperature must be in [0.0, 2.0]"),
        (["--top_k=201"], "top_k must be an integer in [0, 200]"),
        (["--max_new_tokens=0"], "max_new_tokens must be an integer in [1, 4096]"),
        (["--port=70000"], "port must be in [0, 65535]"),
        (["--max_chats=0"], "max_chats must be >= 1"),
        (["--dtype=float64"], "float64"),
    ]:
        with pytest.raises(UsageError, match=re.escape(message)):
            chat_web.settings(argv)
    with pytest.raises(HelpRequested):
        chat_web.settings(["--help"])
    shown = " ".join(help_text(chat_web.defaults).split())
    assert "--host=127.0.0.1 the address to serve on" in shown and "--port=8000" in shown


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_command_serves_the_page_and_stops_on_ctrl_c(model, tmp_path):
    tokenizer, config, gpt = model
    checkpoint = tmp_path / "base_checkpoints" / "d2"
    save_nanochat(gpt, str(checkpoint), 0, {})
    tokenizer.save(str(tmp_path / "tokenizer"))
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "chat_web.py", f"--init_from={checkpoint}",
         f"--tokenizer={tmp_path / 'tokenizer'}", f"--port={port}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while True:
            try:
                status, _, page = request(port, "GET", "/", timeout=5)
                break
            except OSError:
                assert process.poll() is None and time.time() < deadline
                time.sleep(0.2)
        assert status == 200 and 'id="input"' in page
        # sampled, not greedy: the settings a request gives, as the page's server default
        body = {"messages": user("hi"), "max_tokens": 3, "temperature": 1.0, "top_k": 5}
        status, events = chat(port, body)
        assert status == 200 and events[-1]["done"] and events[-1]["tokens"] <= 3
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert f"serving the chat on http://127.0.0.1:{port}" in stderr
    assert "GET / 200" in stderr and "POST /chat/completions 200" in stderr
    assert stderr.rstrip().endswith("stopped") and "Traceback" not in stderr
