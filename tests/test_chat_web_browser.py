"""python -m pytest tests/test_chat_web_browser.py -q -m slow

chat_web.py's page in a real browser: headless Chromium (Debian's `chromium` package; skipped
without it), driven over the DevTools protocol through its pipe (no websocket client, no package).
It loads the page from a server in a thread, types a question into the message box and presses
Enter; the reply appears piece by piece (seen part-way, then whole: the engine's greedy answer,
the tool call and its forced output included), and a screenshot of the page shows it (decoded: not
blank, the reply's box holding text). Then Stop halts a reply mid-stream (the server stops sampling
it) and New chat starts over (the next question is primed alone).

The model: tests/helpers/chat_models.py's, trained to answer "what is 12*7?" through the
calculator (a few seconds); its server's steps slowed, so that a reply streams for a while."""

import base64
import io
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers.chat_models import TOOL_CONVERSATION, expected_answer, tiny_tokenizer, tool_model

import chat_web
from archs.nanochat import NanochatGPT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium: apt-get install chromium"),
]
QUESTION = TOOL_CONVERSATION["messages"][0]["content"]  # "what is 12*7?"
STEP_S = 0.03  # each step of the server's engine: a 20-token reply streams for about 0.6 s


ONTO_3_AND_4 = """import fcntl, os, sys
ends = [fcntl.fcntl(int(fd), fcntl.F_DUPFD_CLOEXEC, 10) for fd in sys.argv[1:3]]
os.dup2(ends[0], 3)
os.dup2(ends[1], 4)
os.execv(sys.argv[3], sys.argv[3:])
"""


class Browser:
    """Headless Chromium over the DevTools protocol's pipe (--remote-debugging-pipe): JSON
    messages, each ended by a NUL byte, written to its fd 3 and read from its fd 4."""

    def __init__(self, profile, width=800, height=600):
        to_browser, self.writer = os.pipe()
        self.reader, from_browser = os.pipe()
        args = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank",
        ]  # fmt: skip
        # the pipe's ends onto 3 and 4 by a Python that then becomes chromium (a preexec_fn would
        # fork this JAX process; a shell takes only fds 0-9)
        self.process = subprocess.Popen(
            [sys.executable, "-c", ONTO_3_AND_4, str(to_browser), str(from_browser), *args],
            pass_fds=(to_browser, from_browser), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_browser)
        os.close(from_browser)
        self.buffer, self.next_id, self.session = b"", 0, None
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        attached = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)
        self.session = attached["sessionId"]
        # the page's size, pinned (a headless window's viewport is the window less its frame)
        self.call(
            "Emulation.setDeviceMetricsOverride", width=width, height=height,
            deviceScaleFactor=1, mobile=False,
        )  # fmt: skip

    def call(self, method, timeout=30, **params):
        """The result of one command (to the page once attached), events read past."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        os.write(self.writer, json.dumps(message).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            while b"\0" in self.buffer:
                raw, _, self.buffer = self.buffer.partition(b"\0")
                answer = json.loads(raw)
                if answer.get("id") == self.next_id:
                    assert "error" not in answer, (method, answer["error"])
                    return answer["result"]
            left = deadline - time.time()
            assert left > 0 and select.select([self.reader], [], [], left)[0], (
                f"{method}: no answer"
            )
            data = os.read(self.reader, 1 << 20)
            assert data, "chromium closed its pipe"
            self.buffer += data

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self.reader)
        os.close(self.writer)


class Paced:
    """The server's engine, each step `delay` seconds long; the prompt each generate was given and
    the steps it took."""

    def __init__(self, engine, delay):
        self.engine, self.delay, self.prompts, self.steps = engine, delay, [], []

    def generate(self, tokens, *args, **kwargs):
        self.prompts.append(list(tokens))
        self.steps.append(0)
        n = len(self.steps) - 1
        for step in self.engine.generate(tokens, *args, **kwargs):
            self.steps[n] += 1
            time.sleep(self.delay)
            yield step


@pytest.fixture(scope="module")
def served():
    tokenizer = tiny_tokenizer()
    model = NanochatGPT.from_nanochat(*tool_model(tokenizer))
    cfg = dict(chat_web.defaults, port=0, temperature=0.0)
    server = chat_web.serve(model, tokenizer, cfg, log=lambda line: None)
    server.chats.engine = Paced(server.chats.engine, STEP_S)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, tokenizer
    server.shutdown()
    server.server_close()
    server.chats.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    browser = Browser(tmp_path_factory.mktemp("chromium"))
    yield browser
    browser.close()


LAST_REPLY = """(() => {
  const replies = document.querySelectorAll(".message.assistant");
  const last = replies[replies.length - 1];
  return last ? {text: last.textContent, state: last.dataset.state,
                 pieces: Number(last.dataset.pieces)} : null;
})()"""


def ask(browser, text):
    """Type `text` into the message box and press Enter, as a user does."""
    browser.evaluate("document.getElementById('input').focus()")
    browser.call("Input.insertText", text=text)
    for kind in ("keyDown", "keyUp"):
        browser.call(
            "Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
            windowsVirtualKeyCode=13, nativeVirtualKeyCode=13,
        )  # fmt: skip


def watch_reply(browser, until, timeout=60):
    """Each different state of the last reply on the page, until `until(state)`."""
    seen, deadline = [], time.time() + timeout
    while not seen or not until(seen[-1]):
        assert time.time() < deadline, seen[-3:]
        now = browser.evaluate(LAST_REPLY)
        if now and (not seen or now != seen[-1]):
            seen.append(now)
        time.sleep(0.01)
    return seen


def png_pixels(png):
    """(height, width, 3) uint8 RGB of a PNG."""
    from PIL import Image  # pillow, with matplotlib's (the test group's plot extra)

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_the_page_streams_a_reply_and_shows_it(served, browser, tmp_path):
    server, tokenizer = served
    port = server.server_address[1]
    browser.call("Page.enable")
    browser.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
    watch_until = time.time() + 30
    while browser.evaluate("document.readyState") != "complete":
        assert time.time() < watch_until
        time.sleep(0.05)
    ask(browser, QUESTION)
    seen = watch_reply(browser, lambda s: s["state"] == "done")
    primed, answer, _ = expected_answer(tokenizer)
    final = seen[-1]
    # the engine's greedy answer, the tool's call and its forced output shown as nanochat shows them
    assert final["text"] == tokenizer.decode(answer)
    assert "<|python_start|>12*7<|python_end|><|output_start|>84<|output_end|>" in final["text"]
    assert final["pieces"] == len(answer)  # a piece an event, each token a whole character here
    # seen part-way: a reply that grew on the page as it streamed
    partial = [s for s in seen if s["state"] == "streaming" and 0 < len(s["text"])]
    assert partial and all(final["text"].startswith(s["text"]) for s in partial)
    assert any(len(s["text"]) < len(final["text"]) for s in partial)
    assert server.chats.engine.prompts == [primed]

    shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    (tmp_path / "page.png").write_bytes(shot)
    pixels = png_pixels(shot)
    assert pixels.shape == (600, 800, 3)
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 10  # not blank: the page's colours and its text's anti-aliasing
    box = browser.evaluate(
        "(() => { const r = document.querySelector('.message.assistant').getBoundingClientRect();"
        " return [r.left, r.top, r.right, r.bottom].map(Math.round); })()"
    )
    left, top, right, bottom = box
    assert 0 <= left < right <= 800 and 0 <= top < bottom <= 600
    inside = pixels[top + 2 : bottom - 2, left + 2 : right - 2].reshape(-1, 3)
    # the reply's box: white, with its text's dark pixels (#1f2328) on it
    assert (inside == 255).all(axis=1).mean() > 0.5
    assert (inside.max(axis=1) < 100).sum() > 50


def test_stop_halts_a_reply_and_new_chat_starts_over(served, browser):
    server, tokenizer = served
    engine = server.chats.engine
    ask(browser, "and hello?")  # a second turn: the conversation so far, and this
    watch_reply(browser, lambda s: s["state"] == "streaming" and s["pieces"] >= 2)
    browser.evaluate("document.getElementById('stop').click()")
    stopped = watch_reply(browser, lambda s: s["state"] == "stopped")[-1]
    deadline = time.time() + 5
    while server.chats.in_flight:
        assert time.time() < deadline
        time.sleep(0.02)
    steps = engine.steps[-1]
    time.sleep(0.3)
    assert engine.steps[-1] == steps  # no more sampling for it
    assert steps < 64 - len(engine.prompts[-1])  # stopped before the context filled
    assert stopped["pieces"] >= 2
    # the second turn primed the whole conversation: the first question, its reply, this one
    first = engine.prompts[0] + expected_answer(tokenizer)[1]
    assert engine.prompts[-1][: len(first)] == first

    browser.evaluate("document.getElementById('new-chat').click()")
    assert browser.evaluate("document.querySelectorAll('.message').length") == 0
    ask(browser, QUESTION)
    again = watch_reply(browser, lambda s: s["state"] == "done")[-1]
    assert engine.prompts[-1] == engine.prompts[0]  # primed alone, as the first time
    assert again["text"] == tokenizer.decode(expected_answer(tokenizer)[1])
