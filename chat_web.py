"""
Chat with a nanochat model in a browser: a small page and its API (nanochat's removed
scripts/chat_web.py, on Python's own http.server), served on 127.0.0.1 by default.

    python chat_web.py --init_from=$HOME/.cache/nanochat/chatsft_checkpoints/d20
    python chat_web.py --init_from=DIR --tokenizer=DIR --port=8000   # then open http://127.0.0.1:8000
    python chat_web.py --init_from=resume --out_dir=out-chat-sft --host=0.0.0.0   # to share it

GET / is the page: a message box, the reply as it streams, Stop and New chat; it keeps the
conversation and sends it whole each turn. POST /chat/completions {"messages": [...],
"temperature"?, "top_k"?, "max_tokens"?} streams the reply as server-sent events (run/chat_server.py
says what it refuses); GET /health. One line is logged per request; Ctrl-C stops the server
(exit 0). Settings: --key=value (configurator.py); the start-up summary goes to stderr.
"""

import signal
import sys
import threading

from configurator import UsageError, configure, exit_on_bad_input, exit_on_interrupt
from run import chat_server
from run.chat_engine import Engine, start_chat_model
from run.settings import resolve_dtype

defaults = dict(
    # a nanochat checkpoint directory (nanochat's, or export.py --format=nanochat's), or 'resume'
    # (our run in out_dir)
    init_from="resume",
    out_dir="out",  # ignored unless init_from is 'resume'
    # nanochat's tokenizer directory (tokenizer.pkl); '': the checkpoint's (beside it or up to two
    # folders up, nanochat's base directory)
    tokenizer="",
    host="127.0.0.1",  # the address to serve on: 0.0.0.0 shares the page with the network
    port=8000,  # the port to serve on (0: any free one, printed)
    max_chats=8,  # replies in flight at once (one device samples them in turn); one more is "busy"
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
    # a request's defaults, where it gives none (nanochat's server's: 0.8, 50, 512)
    temperature=0.8,  # 0: greedy (argmax)
    top_k=50,  # sample among the top_k most likely tokens (0: all)
    max_new_tokens=512,  # tokens a reply at most; fewer where the context fills
)


def settings(argv):
    """The settings of a command line, checked, before a model is loaded."""
    cfg = configure(defaults, argv)
    low, high = chat_server.TEMPERATURE
    if not low <= cfg["temperature"] <= high:
        raise UsageError(f"temperature must be in [{low}, {high}], got {cfg['temperature']}")
    for key, (low, high) in (
        ("top_k", chat_server.TOP_K),
        ("max_new_tokens", chat_server.MAX_TOKENS),
    ):
        if not low <= cfg[key] <= high:
            raise UsageError(f"{key} must be an integer in [{low}, {high}], got {cfg[key]}")
    if not 0 <= cfg["port"] <= 65535:
        raise UsageError(f"port must be in [0, 65535], got {cfg['port']}")
    if cfg["max_chats"] < 1:
        raise UsageError(f"max_chats must be >= 1, got {cfg['max_chats']}")
    resolve_dtype(cfg["dtype"], "cpu")
    return cfg


def serve(model, tokenizer, cfg, log=None):
    """The server (not yet serving: call its serve_forever) over a new engine on `model`."""
    chats = chat_server.Chats(Engine(model, tokenizer), tokenizer, cfg["max_chats"])
    request_defaults = dict(
        temperature=cfg["temperature"], top_k=cfg["top_k"], max_tokens=cfg["max_new_tokens"]
    )
    try:
        return chat_server.ChatServer(
            (cfg["host"], cfg["port"]), chats, request_defaults, model.config.block_size, log
        )
    except OSError as e:  # the port taken, an address not this machine's
        chats.close()
        raise UsageError(f"cannot serve on {cfg['host']}:{cfg['port']}: {e.strerror}") from None


def main(argv=None):
    cfg = settings(sys.argv[1:] if argv is None else argv)
    disarm = exit_on_interrupt("stopped while the model loaded")  # one line, no traceback
    model, tokenizer = start_chat_model(cfg)
    server = serve(model, tokenizer, cfg)
    disarm()
    host, port = server.server_address[:2]
    print(
        f"serving the chat on http://{host}:{port} (Ctrl-C stops it)", file=sys.stderr, flush=True
    )
    # Ctrl-C (or SIGTERM) sets this; the server runs in a thread, so no KeyboardInterrupt runs
    # through a handler or JAX's threads
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    while not stop.wait(1.0):
        pass
    server.shutdown()
    server.server_close()
    server.chats.close()
    print("stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    exit_on_bad_input(main)
