"""
Chat with a nanochat model in the terminal: nanochat's scripts/chat_cli.py over our engine
(run/chat_engine.py), the Python tool included.

    # nanochat's finetuned checkpoint (its tokenizer/ two folders up, as in its base directory)
    python chat_cli.py --init_from=$HOME/.cache/nanochat/chatsft_checkpoints/d20
    # our own finetuning run
    python chat_cli.py --init_from=resume --out_dir=out-chat-sft
    # one answer, greedy, then exit (nanochat's -p PROMPT -t 0)
    python chat_cli.py --init_from=DIR --tokenizer=DIR --prompt='Why is the sky blue?' \\
        --temperature=0

Each turn adds <|user_start|> message <|user_end|> <|assistant_start|> to the conversation (which
starts at <|bos|>) and streams the reply as the engine samples it; a call of the Python tool and
its forced output show as nanochat shows them, <|python_start|>12*7<|python_end|>
<|output_start|>84<|output_end|>. The reply, ended by <|assistant_end|> (not printed), joins the
conversation. Type 'clear' to start over, 'quit' or 'exit' (or Ctrl-C, Ctrl-D) to leave.
Settings: --key=value (configurator.py); the start-up summary goes to stderr.
"""

import codecs
import signal
import sys

from compute.generate import check_sampling
from configurator import UsageError, configure, exit_on_bad_input
from run.chat_engine import ASSISTANT_END, Engine, start_chat_model
from run.settings import resolve_dtype

defaults = dict(
    # a nanochat checkpoint directory (nanochat's, or export.py --format=nanochat's), or 'resume'
    # (our run in out_dir)
    init_from="resume",
    out_dir="out",  # ignored unless init_from is 'resume'
    # nanochat's tokenizer directory (tokenizer.pkl); '': the checkpoint's (beside it or up to two
    # folders up, nanochat's base directory)
    tokenizer="",
    prompt="",  # one answer to this message, then exit (nanochat's -p); '': the interactive chat
    max_new_tokens=256,  # tokens a reply at most (nanochat's 256); fewer where the context fills
    temperature=0.6,  # 0: greedy (argmax); nanochat's default 0.6
    top_k=50,  # sample among the top_k most likely tokens (0: all)
    seed=42,  # each reply's sampling seed, as nanochat's engine (jax.random: not its tokens)
    dtype="auto",  # 'float32' | 'bfloat16' | 'auto' (bfloat16 on GPU/TPU, float32 on CPU)
)
BANNER = (
    "\nnanochat in the terminal\n" + "-" * 50 + "\nType 'quit' or 'exit' to end the conversation"
    "\nType 'clear' to start a new conversation\n" + "-" * 50
)


def check_settings(cfg):
    """Every bad setting fails here, with one line, before a model is loaded."""
    if not (isinstance(cfg["max_new_tokens"], int) and cfg["max_new_tokens"] >= 1):
        raise UsageError(f"max_new_tokens must be an integer >= 1, got {cfg['max_new_tokens']}")
    check_sampling(cfg["temperature"], cfg["top_k"] or None, None)
    resolve_dtype(cfg["dtype"], "cpu")


class Chat:
    """The conversation's tokens and the engine that answers them: nanochat's chat_cli loop."""

    def __init__(self, model, tokenizer, cfg, out=None):
        self.engine, self.tokenizer = Engine(model, tokenizer), tokenizer
        self.out = out or sys.stdout  # the terminal (sys.stdout as it is when the chat starts)
        self.block_size = model.config.block_size
        special = tokenizer.encode_special
        self.user_start, self.user_end = special("<|user_start|>"), special("<|user_end|>")
        self.assistant_start = special("<|assistant_start|>")
        self.assistant_end = special(ASSISTANT_END)
        self.stops = {self.assistant_end, tokenizer.get_bos_token_id()}
        self.settings = dict(
            num_samples=1,
            max_tokens=cfg["max_new_tokens"],
            temperature=float(cfg["temperature"]),
            top_k=cfg["top_k"] or None,
            seed=cfg["seed"],
        )
        self.interrupted = False  # Ctrl-C while a reply streams: it stops after this token
        self.reading = False  # waiting at the prompt for a line
        self.clear()

    def clear(self):
        self.tokens = [self.tokenizer.get_bos_token_id()]

    def reply(self, message, lead=""):
        """Stream the answer to `message`, after `lead`, and keep both in the conversation. A turn
        that would not fit the context is a UsageError (one line), the conversation left as it
        was."""
        turn = [self.user_start, *self.tokenizer.encode(message), self.user_end]
        prompt = self.tokens + turn + [self.assistant_start]
        if len(prompt) > self.block_size:
            raise UsageError(
                f"this message makes the conversation {len(prompt)} tokens, longer than the "
                f"model's context ({self.block_size}): shorten it, or type 'clear' to start over"
            )
        self.out.write(lead)
        # whole characters only: a character's bytes may come in several tokens
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        answer = []
        for column, _ in self.engine.generate(prompt, **self.settings):
            token = column[0]
            answer.append(token)
            if token in self.stops:
                break
            # a special token (the tool's delimiters) prints as its name, as nanochat's decode
            piece = self.tokenizer.enc.decode_single_token_bytes(token)
            self.out.write(text.decode(piece))
            self.out.flush()
            if self.interrupted:
                break
        self.out.write(text.decode(b"", final=True) + "\n")
        self.out.flush()
        # the reply ends with <|assistant_end|>, even one cut by max_new_tokens or the context
        if answer[-1:] != [self.assistant_end]:
            answer.append(self.assistant_end)
        self.tokens = prompt + answer
        return answer


def converse(chat, read=input, write=print):
    """The interactive loop: each line a message or a command, until quit, exit, Ctrl-C or
    Ctrl-D."""
    while not chat.interrupted:
        chat.reading = True
        try:
            message = read("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            write()
            break
        finally:
            chat.reading = False
        if message.lower() in ("quit", "exit"):
            break
        if message.lower() == "clear":
            chat.clear()
            write("Conversation cleared.")
            continue
        if not message:
            continue
        try:
            chat.reply(message, lead="\nAssistant: ")
        except UsageError as e:  # too long for the context: the chat goes on
            write(f"error: {e}", flush=True)
    write("Goodbye!", flush=True)
    return 0


def stop_on_interrupt(chat):
    """Ctrl-C at the prompt ends the chat at once; while a reply streams, once its current token is
    printed: no KeyboardInterrupt runs through JAX's threads (configurator.exit_on_interrupt)."""

    def on_interrupt(signum, frame):
        if chat.reading:
            raise KeyboardInterrupt  # input() is plain Python: it stops where it is
        chat.interrupted = True

    signal.signal(signal.SIGINT, on_interrupt)


def settings(argv):
    """The settings of a command line, checked. A message is text as typed, never a Python literal:
    --prompt=42 asks about 42."""
    prompts = [a.partition("=")[2] for a in argv if a.startswith("--prompt=")]
    cfg = configure(defaults, [a for a in argv if not a.startswith("--prompt=")])
    cfg["prompt"] = prompts[-1] if prompts else cfg["prompt"]
    check_settings(cfg)
    return cfg


def main(argv=None):
    cfg = settings(sys.argv[1:] if argv is None else argv)
    model, tokenizer = start_chat_model(cfg)
    chat = Chat(model, tokenizer, cfg)
    stop_on_interrupt(chat)
    if cfg["prompt"]:
        chat.reply(cfg["prompt"])
        return 0
    if sys.stdin.isatty():
        import readline  # noqa: F401  (input() gets line editing and history)
    print(BANNER)
    return converse(chat)


if __name__ == "__main__":
    exit_on_bad_input(main)
