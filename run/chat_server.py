"""
The chat page's server (chat_web.py; nanochat's removed scripts/chat_web.py, on the standard
library): GET / the page (run/chat_page.html), GET /health, and POST /chat/completions, which takes
the whole conversation {"messages": [{"role", "content"}, ...], "temperature"?, "top_k"?,
"max_tokens"?} and streams the reply as server-sent events: `data: {"token": text}` per decoded
piece, as the engine samples it, then `data: {"done": true, "reason": "stop" | "length",
"tokens": n}`.

The conversation is rendered as chat_cli renders its own (dataio/conversations.py: <|bos|>, each
user message between <|user_start|> and <|user_end|>, each reply after <|assistant_start|> and
ended by <|assistant_end|>), then <|assistant_start|>. A reply's text comes back as the page shows
it, a tool call spelled <|python_start|>12*7<|python_end|><|output_start|>84<|output_end|>: those
names are read back as the call's parts, so the next turn primes the tokens chat_cli's would.

One worker thread makes every model call (one device): it takes each chat in flight one token in
turn, so every stream moves while several are open. At most `max_chats` are in flight; one more is
refused (503 "busy", Retry-After: 1) rather than queued. A request that breaks a rule is refused in
one line, a JSON {"error": line} with a 4xx, and the server goes on; a client that goes away
mid-reply has its chat stop being sampled within a token or POLL_S.
"""

import codecs
import json
import queue
import random
import re
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from configurator import UsageError
from dataio.conversations import check_conversation, render_conversation
from run.chat_engine import ASSISTANT_END, OUTPUT_END, OUTPUT_START, PYTHON_END, PYTHON_START

PAGE = Path(__file__).with_name("chat_page.html")
# nanochat's chat_web limits (its "abuse prevention"), and a cap on the body that holds them
MAX_MESSAGES = 500
MAX_MESSAGE_CHARS = 8000
MAX_CONVERSATION_CHARS = 32000
MAX_BODY_BYTES = 1 << 20  # 32000 characters as JSON's \uXXXX escapes are 192 KB: well within
TEMPERATURE = (0.0, 2.0)
TOP_K = (0, 200)  # 0: no top-k (the whole vocabulary)
MAX_TOKENS = (1, 4096)  # a reply also ends where the context is full
POLL_S = 0.25  # a handler waiting for its next token looks at its client this often
SOCKET_TIMEOUT_S = 60  # a client that sends nothing (or reads nothing) for this long is dropped
# a reply's tool call as the page shows it -> the assistant's parts (dataio/conversations.py's)
MARKERS = {PYTHON_START: "python", OUTPUT_START: "python_output"}
ENDS = {PYTHON_END: "python", OUTPUT_END: "python_output"}
MARKER = re.compile("(" + "|".join(re.escape(m) for m in [*MARKERS, *ENDS]) + ")")


class Refused(UsageError):
    """A request the server will not answer: one line, and its HTTP status."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def reply_parts(text):
    """A reply's text as the page shows it -> [{"type", "text"}] parts: the text between
    <|python_start|> and <|python_end|> a "python" call, between <|output_start|> and
    <|output_end|> its "python_output", the rest "text". A call cut off (no end marker) runs to the
    end of the reply."""
    parts, kind = [], "text"
    for piece in MARKER.split(text):
        if piece in MARKERS and kind == "text":
            kind = MARKERS[piece]
        elif piece in ENDS and kind == ENDS[piece]:
            kind = "text"
        elif piece:
            if parts and parts[-1]["type"] == kind:
                parts[-1]["text"] += piece  # a stray marker is text, as it was typed
            else:
                parts.append({"type": kind, "text": piece})
    return parts or [{"type": "text", "text": ""}]


def with_reply_parts(message):
    """An assistant's message whose content is text, with its reply_parts; any other as it is."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return message
    content = message.get("content")
    return {**message, "content": reply_parts(content)} if isinstance(content, str) else message


def characters(message):
    """The characters of a checked message's content (an assistant's: its parts' texts)."""
    content = message["content"]
    return len(content) if isinstance(content, str) else sum(len(p["text"]) for p in content)


def number(request, key, low, high, default, kind):
    """request[key] (absent or null: the default) checked to be a `kind` in [low, high]."""
    value = request.get(key)
    if value is None:
        return default
    ok = isinstance(value, kind) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        what = "an integer" if kind is int else "a number"
        raise Refused(400, f"{key} must be {what} in [{low}, {high}], got {json.dumps(value)}")
    return value


def parse_chat(body, tokenizer, block_size, defaults):
    """A POST /chat/completions body -> (the prompt's token ids, the engine's settings), or Refused
    naming what to fix. `defaults`: temperature, top_k, max_tokens when the request gives none."""
    try:
        request = json.loads(body)
    except ValueError as e:  # JSONDecodeError, or bytes that are no UTF-8
        raise Refused(400, f"malformed JSON: {e}") from None
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
        raise Refused(400, 'the body is a JSON object {"messages": [{"role", "content"}, ...]}')
    messages = request["messages"]
    if len(messages) > MAX_MESSAGES:
        raise Refused(400, f"{len(messages)} messages, over the limit of {MAX_MESSAGES}")
    messages = [with_reply_parts(m) for m in messages]
    try:
        checked = check_conversation({"messages": messages}, where="request")
    except UsageError as e:
        raise Refused(400, str(e)) from None
    lengths = [characters(m) for m in messages]
    for i, n in enumerate(lengths):
        if n > MAX_MESSAGE_CHARS:
            raise Refused(
                400, f"messages[{i}] is {n} characters, over the limit of {MAX_MESSAGE_CHARS}"
            )
    if sum(lengths) > MAX_CONVERSATION_CHARS:
        raise Refused(
            400,
            f"the conversation is {sum(lengths)} characters, over the limit of "
            f"{MAX_CONVERSATION_CHARS}: start a new chat",
        )
    if checked[-1][0] != "user":
        raise Refused(
            400, "the last message is the assistant's: end with the user's, to be answered"
        )
    if not messages[-1]["content"].strip():
        raise Refused(400, "the last message is empty: say something")
    settings = dict(
        temperature=float(
            number(request, "temperature", *TEMPERATURE, defaults["temperature"], (int, float))
        ),
        top_k=number(request, "top_k", *TOP_K, defaults["top_k"], int) or None,
        max_tokens=number(request, "max_tokens", *MAX_TOKENS, defaults["max_tokens"], int),
    )
    ids, _ = render_conversation(tokenizer, {"messages": messages}, max_tokens=None)
    prompt = ids + [tokenizer.encode_special("<|assistant_start|>")]
    if len(prompt) > block_size:
        raise Refused(
            400,
            f"the conversation is {len(prompt)} tokens, longer than the model's context "
            f"({block_size}): start a new chat, or shorten the message",
        )
    return prompt, settings


@dataclass
class Chat:
    """One reply in flight: the engine's steps, and what the worker hands its handler: a token id,
    then the reason it ended ("stop" or "length") or an exception."""

    steps: object  # Engine.generate's generator
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    sampled: int = 0  # tokens taken so far (the worker's count)


class Chats:
    """The model's one worker thread and the bound on chats in flight. `engine`: run.chat_engine's
    Engine (or anything with its generate)."""

    def __init__(self, engine, tokenizer, max_chats):
        self.engine, self.tokenizer, self.max_chats = engine, tokenizer, max_chats
        self.stops = {tokenizer.encode_special(ASSISTANT_END), tokenizer.get_bos_token_id()}
        self.inbox = queue.Queue()  # new chats, for the worker; None: stop
        self.in_flight = 0  # admitted and not yet answered to the end (their handlers count)
        self.lock = threading.Lock()
        self.worker = threading.Thread(target=self.work, name="model", daemon=True)
        self.worker.start()

    def admit(self):
        """A place among the chats in flight, or Refused (busy)."""
        with self.lock:
            if self.in_flight >= self.max_chats:
                raise Refused(
                    503,
                    f"busy: {self.in_flight} chats in flight, the most this server takes at "
                    "once: try again in a moment",
                )
            self.in_flight += 1

    def release(self):
        with self.lock:
            self.in_flight -= 1

    def start(self, prompt, settings):
        """A Chat for the worker to sample (the caller holds a place, admit())."""
        seed = random.randrange(2**31)  # each reply its own draws, as nanochat's server
        chat = Chat(self.engine.generate(prompt, num_samples=1, seed=seed, **settings))
        self.inbox.put(chat)
        return chat

    def work(self):
        """Each chat in flight one step in turn, new ones joining between rounds."""
        chats = []
        while True:
            try:
                new = [self.inbox.get(block=not chats)]
                while True:
                    new.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if None in new:  # the server stops: each reply in flight ends with a line saying so
                for chat in chats + new:
                    if chat is not None:
                        chat.out.put(RuntimeError("the server stopped"))
                return
            chats += new
            chats = [chat for chat in chats if self.step(chat)]

    def step(self, chat):
        """One token of `chat` into its queue -> whether it goes on."""
        if chat.cancelled.is_set():
            chat.steps.close()  # its client is gone: no more sampling for it
            return False
        try:
            column, _ = next(chat.steps)
        except StopIteration:  # max_tokens, or the context is full
            chat.out.put("length")
            return False
        except Exception as e:  # the handler reports it in one line; the worker goes on
            chat.out.put(e)
            return False
        chat.sampled += 1
        token = column[0]
        if token in self.stops:
            chat.out.put("stop")
            chat.steps.close()
            return False
        chat.out.put(token)
        return True

    def close(self):
        """The worker stopped (the chats in flight told so)."""
        self.inbox.put(None)
        self.worker.join(timeout=10)


def client_gone(sock):
    """Whether the client closed its end: it sends nothing after its request, so a readable socket
    that reads empty (or fails) is a closed one."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class ChatServer(ThreadingHTTPServer):
    """http.server's threads, a handler thread per connection, over one Chats."""

    daemon_threads = True
    request_queue_size = 64  # connections the kernel holds while the server accepts

    def __init__(self, address, chats, defaults, block_size, log=None):
        super().__init__(address, ChatHandler)
        self.chats, self.defaults, self.block_size = chats, defaults, block_size
        self.page = PAGE.read_bytes()
        self.log_lock = threading.Lock()
        self.log = log or self.log_to_stderr

    def log_to_stderr(self, line):
        with self.log_lock:
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", file=sys.stderr, flush=True)


class ChatHandler(BaseHTTPRequestHandler):
    """One connection: a request, answered; the reply streamed, or refused in one line."""

    timeout = SOCKET_TIMEOUT_S
    server_version = "nanogpt-jax-chat"

    def do_GET(self):
        if self.path == "/" or self.path.startswith("/?"):
            self.log_request_line(200, f"the page, {len(self.server.page)} bytes")
            self.send_body(200, self.server.page, "text/html; charset=utf-8")
        elif self.path == "/health":
            chats = self.server.chats
            health = dict(status="ok", chats_in_flight=chats.in_flight, max_chats=chats.max_chats)
            self.log_request_line(200, json.dumps(health))
            self.send_json(200, health)
        else:
            self.send_error(404, f"no page at {self.path}: GET / (the page), GET /health")

    def do_POST(self):
        if self.path != "/chat/completions":
            return self.send_error(404, f"no API at {self.path}: POST /chat/completions")
        began, server = time.time(), self.server
        try:
            body = self.read_body()
            prompt, settings = parse_chat(
                body, server.chats.tokenizer, server.block_size, server.defaults
            )
            server.chats.admit()
        except Refused as e:
            return self.send_error(e.status, str(e))
        try:
            chat = server.chats.start(prompt, settings)
            sent, reason = self.stream(chat)
        finally:
            server.chats.release()
        self.log_request_line(
            200,
            f"{len(prompt)} prompt tokens -> {chat.sampled} sampled, {sent} bytes, {reason} "
            f"({time.time() - began:.2f}s)",
        )

    def read_body(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise Refused(411, "give the body's Content-Length")
        if int(length) > MAX_BODY_BYTES:
            raise Refused(413, f"a body of {length} bytes, over the limit of {MAX_BODY_BYTES}")
        return self.rfile.read(int(length))

    def stream(self, chat):
        """The reply as server-sent events, each piece as it comes -> (bytes sent, how it ended:
        "stop", "length", "client gone" or an error's line)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        # whole characters only: a character's bytes may come in several tokens (as chat_cli)
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        piece_of = self.server.chats.tokenizer.enc.decode_single_token_bytes
        sent = 0
        try:
            while True:
                try:
                    item = chat.out.get(timeout=POLL_S)
                except queue.Empty:
                    item = None
                if client_gone(self.connection):
                    chat.cancelled.set()
                    return sent, "client gone"
                if item is None:
                    continue
                if isinstance(item, int):  # a special token (the tool's) shows as its name
                    event = {"token": text.decode(piece_of(item))}
                    if not event["token"]:
                        continue
                elif isinstance(item, Exception):
                    event = {"error": str(item).splitlines()[0] if str(item) else repr(item)}
                else:
                    tail = text.decode(b"", final=True)
                    if tail:
                        sent += self.send_event({"token": tail})
                    event = {"done": True, "reason": item, "tokens": chat.sampled}
                sent += self.send_event(event)
                if "token" not in event:
                    return sent, event.get("reason") or f"error: {event['error']}"
        except OSError:  # BrokenPipe, ConnectionReset, a timeout: the client is gone
            chat.cancelled.set()
            return sent, "client gone"

    def send_event(self, event):
        data = f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        self.wfile.write(data)
        self.wfile.flush()
        return len(data)

    def send_body(self, status, body, content_type, headers=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status, obj, headers=None):
        self.send_body(status, (json.dumps(obj) + "\n").encode(), "application/json", headers)

    def send_error(self, code, message=None, explain=None):
        """Every refusal (ours, and http.server's own: a bad request line, an unknown method) as
        one line, {"error": line}; the connection then closes."""
        line = (message or HTTPStatus(code).phrase).splitlines()[0]
        self.close_connection = True
        self.log_request_line(code, f"error: {line}")  # logged first: the client may read on
        retry = {"Retry-After": "1"} if code == 503 else {}
        try:
            self.send_json(code, {"error": line}, retry)
        except OSError:
            pass

    def log_request_line(self, status, what):
        """One line a request (nanochat's server logged each conversation; this one its size),
        written before a whole answer is sent: a client that has it finds the line there."""
        method = getattr(self, "command", None) or "-"
        path = getattr(self, "path", None) or "-"
        self.server.log(f"{self.client_address[0]} {method} {path} {status} {what}")

    def log_message(self, format, *args):  # http.server's own lines: ours are log_request_line's
        pass
