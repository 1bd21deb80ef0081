"""
nanoGPT's configuration contract, without exec-ing into a script's globals:

    python train.py config/override_file.py --batch_size=32

A config file is python of plain assignments to known keys; then each `--key=value` is parsed with
`literal_eval` (a bare word is a string) and must have the default's type. `configure` returns the
new settings and touches nothing else, so a bad setting fails before any side effect.

Errors: every script checks its input by raising `UsageError`, and runs its main() through
`exit_on_bad_input`, which turns that (and only that) into one line and exit 2; any other exception
keeps its traceback (exit 1).

Help: `-h` or `--help` anywhere in argv makes `configure` raise `HelpRequested`, which
`exit_on_bad_input` prints (exit 0, nothing written): the script's purpose, then every setting with
its default and its meaning, read from the comments beside the settings dict in its own source, so
the help never needs a second list.
"""

import ast
import atexit
import contextlib
import difflib
import importlib.util
import io
import os
import signal
import sys
import textwrap
import threading
import tokenize
from ast import literal_eval


class UsageError(ValueError):
    """Bad input (a setting, a file, a checkpoint): the fix is the user's, and one line says it. A
    ValueError, so that library callers that catch ValueError keep working."""


class InputNotFound(UsageError, FileNotFoundError):
    """A file or directory the input names is missing (still a FileNotFoundError for library
    callers)."""


class ConfigError(UsageError):
    pass


class HelpRequested(Exception):
    """-h or --help in a script's argv: `configure` raises it with the settings' `defaults`, before
    anything is read, and `exit_on_bad_input` prints `help_text(defaults)` and exits 0."""

    def __init__(self, defaults):
        super().__init__("help requested")
        self.defaults = defaults


class RunStopped(RuntimeError):
    """A run that stopped on purpose, for a reason one line states (it diverged, a save failed):
    exit 1. `writers_left`: threads that write may never end (a save's, retrying a storage that is
    gone or refuses it): the process exits without waiting for them."""

    def __init__(self, message, writers_left=False):
        super().__init__(message)
        self.writers_left = writers_left


# pyproject.toml's optional groups, by the modules scripts import from them (docs/install.md)
EXTRAS = {
    "parity": ("torch", "transformers"),
    "eval": ("lm_eval", "torch", "transformers"),
    "data": ("datasets",),
    "plot": ("matplotlib",),
    "gcs": ("gcsfs",),
    "nanochat": ("rustbpe", "pyarrow"),
}


class MissingExtras(UsageError):
    """An optional group is not installed: one line naming the command that installs it."""

    def __init__(self, group, module):
        super().__init__(
            f"{os.path.basename(sys.argv[0])} needs the {group} extras (no module named "
            f"{module!r}): pip install -c constraints.txt -e '.[{group}]'"
        )

    @classmethod
    def of(cls, error, group=None):
        """The MissingExtras an ImportError stands for (a module of a group's, named by it or by its
        cause: fsspec wraps gcsfs's), or None; `group`: the group to name, where the script's own
        group brings the module."""
        while isinstance(error, ImportError):
            module = (error.name or "").partition(".")[0]
            owner = next((g for g, modules in EXTRAS.items() if module in modules), None)
            if owner:
                return cls(group or owner, module)
            error = error.__cause__
        return None


def require_extras(group):
    """Before a script's work: its optional group is installed, or one line says how to install
    it."""
    for module in EXTRAS[group]:
        if importlib.util.find_spec(module) is None:
            raise MissingExtras(group, module)


def exit_without_extras(error, group=None):
    """At a script's top-level imports of an optional group's: one line and exit 2, or `error`
    raised again."""
    missing = MissingExtras.of(error, group)
    if missing is None:
        raise error
    print(f"error: {missing}", file=sys.stderr, flush=True)
    sys.exit(2)


def exit_on_bad_input(main):
    """Run a CLI's main(): -h/--help prints the help on stdout and exits 0 (HelpRequested); a
    UsageError becomes one line on stderr and exit 2, a RunStopped one line and exit 1; an import of
    a module of an optional group that is not installed one line and exit 2; anything else is a real
    error and keeps its traceback."""
    try:
        sys.exit(main())
    except HelpRequested as e:
        print(help_text(e.defaults), flush=True)
        sys.exit(0)
    except ImportError as e:
        exit_without_extras(e)
    except (UsageError, RunStopped) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        # that line is the whole report: a failed orbax restore or save leaves threads and
        # coroutines whose errors would reach stderr as the process ends; stderr goes quiet then
        atexit.register(os.dup2, os.open(os.devnull, os.O_WRONLY), 2)
        if getattr(e, "writers_left", False):  # sys.exit would wait for them: a hang no signal ends
            sys.stdout.flush()
            os._exit(1)
        sys.exit(2 if isinstance(e, UsageError) else 1)


def exit_on_interrupt(message, signals=(signal.SIGINT,)):
    """Until the returned function is called: Ctrl-C (or another of `signals`) ends the process at
    once with `message` in one line and exit 128 + the signal's number. Python runs a signal handler
    only between bytecodes of the main thread, which a compilation holds for seconds, and a
    KeyboardInterrupt raised through JAX's threads can crash the interpreter at exit; so the C-level
    handler's wakeup byte is read by a thread of its own, and the process ends with os._exit
    (nothing of it needs saving yet)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    armed = threading.Event()
    armed.set()
    # the Python handler (main thread) and the watcher thread both see the signal: the first to
    # take this prints and exits, the other returns (on a busy machine both reached the print)
    first = threading.Lock()

    def stop(signum):
        if armed.is_set() and first.acquire(blocking=False):
            print(f"error: {message}", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def watch():
        while True:
            data = os.read(read_fd, 1)
            if data and data[0] in signals:  # the fd gets every signal that has a Python handler
                stop(data[0])

    previous = {s: signal.signal(s, lambda signum, frame: stop(signum)) for s in signals}
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=watch, name="interrupt", daemon=True).start()

    def disarm():
        armed.clear()
        signal.set_wakeup_fd(-1)
        for s, handler in previous.items():
            signal.signal(s, handler)

    return disarm


@contextlib.contextmanager
def stderr_into(file):
    """The process's stderr (file descriptor 2: C++ and threads included) written to `file`
    meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


# -- --help: the settings, read from the source that defines them
# the formatter's line length (pyproject.toml): a comment line wraps there
LINE = 100


def help_text(defaults):
    """The help of a script that configures `defaults`: its purpose (the first paragraph of the
    running script's docstring), how settings are given, then each setting as `--key=default` with
    its meaning, under the headings its source groups them by."""
    main = sys.modules.get("__main__")
    module, name = defining_module(defaults)
    doc = getattr(main, "__doc__", None) or getattr(module, "__doc__", None) or ""
    spec = getattr(main, "__spec__", None)  # set when run as python -m MODULE
    script = f"-m {spec.name}" if spec is not None else os.path.basename(sys.argv[0])
    lines = [f"usage: python {script} [CONFIG_FILE.py ...] [--key=value ...]", ""]
    if doc.strip():
        lines += [doc.strip().split("\n\n")[0], ""]
    how = (
        "Config files (Python assignments to these keys) and --key=value overrides apply in argv "
        "order; a value is a Python literal or a bare word (a string). The settings, with their "
        "defaults:"
    )
    lines += [*textwrap.wrap(how, LINE), ""]
    comments = setting_comments(read_source(module), name) if module else {}
    shown = {key: f"--{key}={shown_value(value)}" for key, value in defaults.items()}
    width = min(max(map(len, shown.values()), default=0), 32)
    for key in defaults:
        headings, meaning = comments.get(key, ([], ""))
        for heading in headings:
            lines += [""] * bool(lines[-1]) + textwrap.wrap(heading, LINE)
        first = f"  {shown[key].ljust(width)}  "
        lines += textwrap.wrap(
            meaning, LINE, initial_indent=first, subsequent_indent=" " * len(first)
        )
        if not meaning:
            lines.append(first.rstrip())
    return "\n".join(lines)


def defining_module(defaults):
    """(module, name) of the loaded module whose source assigns `defaults` (this very dict) at its
    top: run/settings.py for train.py's DEFAULTS, which train.py imports too; (None, None) if
    none."""
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is defaults and dict_node(read_source(module), name) is not None:
                return module, name
    return None, None


def read_source(module):
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py") or not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def dict_node(source, name):
    """The `dict(key=value, ...)` or `{"key": value, ...}` assigned to `name` at the top of
    `source`, or None."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            value = node.value
            if isinstance(value, ast.Dict) or (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "dict"
            ):
                return value
    return None


def setting_comments(source, name):
    """{key: (headings, meaning)} from the comments inside the dict `name` of `source`. A key's
    meaning is its trailing comment, or else the paragraph of comment lines right above it; the
    other comment paragraphs above a key (all of them, where it has a trailing comment) are headings
    (`# I/O`, `# model`). A comment line ends its paragraph where the next line's first word would
    have fitted on it: the comments are wrapped at LINE columns."""
    node = dict_node(source, name)
    if node is None:
        return {}
    if isinstance(node, ast.Dict):
        pairs = zip(node.keys, node.values)
        keys = [(k.value, k.lineno, v.end_lineno) for k, v in pairs if isinstance(k, ast.Constant)]
    else:
        keys = [(k.arg, k.lineno, k.value.end_lineno) for k in node.keywords if k.arg]
    alone, trailing = {}, {}  # line number -> (line's width, comment text)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            own_line = not tok.line[: tok.start[1]].strip()
            text = tok.string.lstrip("#").strip()
            (alone if own_line else trailing)[tok.start[0]] = (len(tok.line.rstrip()), text)
    out = {}
    for key, first, last in keys:
        above = first
        while above - 1 in alone:
            above -= 1
        paragraphs = []
        for n in range(above, first):
            text = alone[n][1]
            if paragraphs and not ends_paragraph(alone[n - 1], text):
                paragraphs[-1] += " " + text
            elif text:
                paragraphs.append(text)
        own = next((trailing[n][1] for n in range(first, last + 1) if n in trailing), None)
        if own is None and paragraphs:
            own = paragraphs.pop()
        out[key] = (paragraphs, own or "")
    return out


def ends_paragraph(line, next_text):
    """Whether a comment line (width, text) ends a paragraph, given the next line's text."""
    width, text = line
    words = next_text.split()
    return not text or not words or width + 1 + len(words[0]) <= LINE


def shown_value(value):
    """A default as one types it: a plain word bare (--dataset=openwebtext), anything else as
    literal_eval reads it ('', '\\n', 0.0006, None)."""
    if isinstance(value, str) and value and value.isprintable() and " " not in value:
        try:
            literal_eval(value)
        except (ValueError, SyntaxError, TypeError):
            return value
    return repr(value)


def _checked(key, value, defaults, source, nullable=()):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown config key '{key}' in {source}{hint}")
    default = defaults[key]
    if default is None or (value is None and key in nullable):
        return value
    if type(default) is float and type(value) is int:  # --learning_rate=1 means 1.0
        return float(value)
    # an 'auto' made explicit: --scan_layers=True, --loss_chunk=0
    if default == "auto" and type(value) in (bool, int):
        return value
    if type(value) is not type(default):
        raise ConfigError(
            f"{key} must be {type(default).__name__} (default {default!r}), "
            f"got {type(value).__name__} {value!r} in {source}"
        )
    return value


def configure(defaults: dict, argv: list[str], nullable=()) -> dict:
    """defaults + config files + --key=value overrides, in argv order -> a new dict. None is a value
    only for the settings whose default is None and those in `nullable` (documented: sample.py's
    top_k=None, all tokens). -h or --help anywhere: HelpRequested, before any file is read."""
    if "-h" in argv or "--help" in argv:
        raise HelpRequested(defaults)
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file not found: {arg}")
            namespace = {}
            with open(arg) as f:
                source = f.read()
            try:
                code = compile(source, arg, "exec")
            except SyntaxError as e:
                raise ConfigError(
                    f"{arg}:{e.lineno}: {e.msg} (a config file is python assignments)"
                ) from None
            try:
                exec(code, namespace)
            except Exception as e:  # the file's own error: NameError, ZeroDivisionError, ...
                raise ConfigError(f"{arg}: {type(e).__name__}: {e}") from None
            for key, value in namespace.items():
                # private helpers (_x), imports and functions are not settings
                if key.startswith("_") or callable(value) or type(value).__name__ == "module":
                    continue
                config[key] = _checked(key, value, defaults, arg, nullable)
        else:
            key, sep, raw = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"expected --key=value, got '{arg}'")
            try:
                value = literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string: --dataset=shakespeare_char
            config[key] = _checked(key, value, defaults, arg, nullable)
    return config


def command_line_keys(argv: list[str]) -> set:
    """The settings given as --key=value in `argv` (typed by the user, not read from a config
    file)."""
    return {arg[2:].partition("=")[0] for arg in argv if arg.startswith("--")}
