"""
nanoGPT's configuration contract, without exec-ing into a script's globals:

    python train.py config/override_file.py --batch_size=32

A config file is python of plain assignments to known keys; then each `--key=value` is parsed with
`literal_eval` (a bare word is a string) and must have the default's type. `configure` returns the
new settings and touches nothing else, so a bad setting fails before any side effect.

Errors: every script checks its input by raising `UsageError`, and runs its main() through
`exit_on_bad_input`, which turns that (and only that) into one line and exit 2; any other exception
keeps its traceback (exit 1).
"""

import atexit
import contextlib
import difflib
import importlib.util
import os
import signal
import sys
import threading
from ast import literal_eval


class UsageError(ValueError):
    """Bad input (a setting, a file, a checkpoint): the fix is the user's, and one line says it. A
    ValueError, so that library callers that catch ValueError keep working."""


class InputNotFound(UsageError, FileNotFoundError):
    """A file or directory the input names is missing (still a FileNotFoundError for library
    callers)."""


class ConfigError(UsageError):
    pass


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
    """Run a CLI's main(): a UsageError becomes one line on stderr and exit 2, a RunStopped one line
    and exit 1; an import of a module of an optional group that is not installed one line and exit
    2; anything else is a real error and keeps its traceback."""
    try:
        sys.exit(main())
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

    def stop(signum):
        if armed.is_set():
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
    top_k=None, all tokens)."""
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
