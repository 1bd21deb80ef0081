"""python -m pytest tests/test_sandbox.py -q

run/sandbox.py, tried as a hostile completion would try it: an infinite loop, a fork bomb, 10 GB,
os.remove of a file outside its directory, a socket to a port this test listens on, an environment
secret of this process, a write outside, a shell. Each is stopped or refused, the caller gets one
line, and this process is unharmed (its environment, its working directory, its files). Then the
same again past execution.py's Python guard (posix, _socket), each where the layer that holds it is
on this machine (skipped, naming the layers it has, where not). The calculator against hand-worked
values; with NANOCHAT_CHECKOUT=DIR, it and run_python against nanochat's own use_calculator and
execute_code.
"""

import ast
import os
import signal
import socket
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

from run.sandbox import calculator, run_python, sandbox_layers

SECRET = "s3cr3t-only-the-parent-knows"
KEPT = "the parent's file"
LIMIT_S = 3  # each hostile case's wall-clock limit (the refused ones end in a fraction of it)


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """A directory outside the sandbox, world-writable so that only the sandbox keeps it out, with a
    file of this process in it; this process's secret in its environment. Afterwards: this process
    is unharmed."""
    folder = tmp_path / "outside"
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "keep.txt").write_text(KEPT)
    monkeypatch.setenv("SANDBOX_TEST_SECRET", SECRET)
    env, cwd = environment(), os.getcwd()
    yield folder
    assert environment() == env
    assert os.getcwd() == cwd
    assert (folder / "keep.txt").read_text() == KEPT
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


def environment():
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's own


def assert_refused(result, says=""):
    """Stopped, with one line saying why (containing `says`), and nothing secret in its output."""
    assert not result.success, result
    assert result.error and "\n" not in result.error, result.error
    assert says in result.error, result.error
    assert SECRET not in result.stdout + result.stderr


def require(*layers):
    """Skip unless this machine gives at least one of the layers that would hold the case."""
    have = sandbox_layers()
    if not set(layers) & set(have):
        pytest.skip(f"none of {layers} on this machine (its sandbox layers: {list(have)})")


def test_an_ordinary_program_runs():
    result = run_python("print(1+1)")
    assert (result.success, result.stdout, result.stderr, result.error) == (True, "2\n", "", None)


def test_what_an_ordinary_program_needs_still_works():
    """Threads, asyncio's loop (a socketpair), files in its own directory, the standard library's
    extension modules, the local time."""
    program = """\
import asyncio, hashlib, threading, time
async def three():
    return 3
thread = threading.Thread(target=print, args=("thread",))
thread.start()
thread.join()
with open("made.txt", "w") as f:
    f.write(hashlib.sha256(b"x").hexdigest()[:8])
print(asyncio.run(three()), open("made.txt").read(), time.localtime().tm_year > 2000)
"""
    result = run_python(program)
    assert (result.stdout, result.error) == ("thread\n3 2d711642 True\n", None)


def test_an_infinite_loop_is_killed_at_its_time_limit(outside):
    start = time.monotonic()
    result = run_python("while True:\n    pass", time_limit_s=1)
    assert_refused(result, "timed out after 1 s")
    assert result.timed_out and time.monotonic() - start < 1 + 2


def test_a_fork_bomb_is_refused(outside):
    result = run_python("import os\nwhile True:\n    os.fork()", time_limit_s=LIMIT_S)
    assert_refused(result, "PermissionError: os.fork is disabled in the sandbox")


def test_10_gb_hit_the_memory_limit(outside):
    result = run_python("x = bytearray(10 * 1024**3)", time_limit_s=LIMIT_S)
    assert_refused(result, "memory limit of 256 MiB exceeded: MemoryError")
    assert result.memory_exceeded and not result.timed_out


def test_os_remove_of_a_file_outside_is_refused(outside):
    result = run_python(
        f"import os\nos.remove({str(outside / 'keep.txt')!r})", time_limit_s=LIMIT_S
    )
    assert_refused(result, "os.remove is disabled")


@contextmanager
def listening():
    """A TCP port on 127.0.0.1 this test listens on; afterwards, no connection has arrived."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing waiting to be accepted
            server.accept()


def test_a_socket_to_a_listening_port_is_refused(outside):
    with listening() as port:
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        result = run_python(program, time_limit_s=LIMIT_S)
    assert_refused(result, "socket.socket is disabled in the sandbox")


def test_the_parents_environment_secret_is_not_there(outside):
    result = run_python("import os\nprint(os.environ['SANDBOX_TEST_SECRET'])")
    assert_refused(result, "KeyError: 'SANDBOX_TEST_SECRET'")


def test_a_shell_is_refused(outside):
    program = f"import subprocess\nsubprocess.run('touch {outside}/made', shell=True)"
    assert_refused(run_python(program, time_limit_s=LIMIT_S), "subprocess.Popen is disabled")


def test_no_stdin():
    assert_refused(run_python("input()"), "EOFError")


def test_output_stops_at_the_file_size_limit():
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 100_000)"
    result = run_python(program, time_limit_s=LIMIT_S, file_size_limit_bytes=2**20)
    assert_refused(result, "File too large")
    assert 0 < len(result.stdout) <= 2**20 and not result.timed_out


def test_a_program_that_kills_itself_is_one_line(outside):
    result = run_python("import os, signal\nos.abort()", time_limit_s=LIMIT_S)
    assert_refused(result, f"killed by signal {signal.SIGABRT.value}")
    result = run_python("import posix\nposix.kill(posix.getpid(), 40)", time_limit_s=LIMIT_S)
    assert_refused(result, "killed by signal 40 (Real-time signal")  # one the enum does not name


def test_its_directory_is_its_own_and_removed_afterwards():
    program = "import posix\nopen('made.txt', 'w').write('x')\nprint(posix.getcwd())"
    result = run_python(program)
    assert result.success, result.error
    workdir = Path(result.stdout.strip())
    assert workdir.name == "work" and not workdir.parent.exists()


# -- past execution.py's guard: what only the kernel's layers hold
# --------------------------------------------------------------------------------------------------


def test_a_write_outside_is_refused(outside):
    require("landlock-fs")
    program = f"open({str(outside / 'made.txt')!r}, 'w').write('x')"
    assert_refused(run_python(program, time_limit_s=LIMIT_S), "Permission denied")


def test_a_read_outside_is_refused(outside):
    require("landlock-fs")
    program = f"print(open({str(outside / 'keep.txt')!r}).read())"
    result = run_python(program, time_limit_s=LIMIT_S)
    assert_refused(result, "Permission denied")
    assert KEPT not in result.stdout


def test_posix_unlink_outside_is_refused(outside):
    require("landlock-fs")
    program = f"import posix\nposix.unlink({str(outside / 'keep.txt')!r})"
    assert_refused(run_python(program, time_limit_s=LIMIT_S), "Permission denied")


def test_the_parents_environ_in_proc_is_refused(outside):
    require("landlock-fs")
    program = "import posix\nprint(open(f'/proc/{posix.getppid()}/environ').read())"
    assert_refused(run_python(program, time_limit_s=LIMIT_S), "Permission denied")


def test_a_fork_bomb_through_posix_is_refused(outside):
    require("seccomp")
    result = run_python("import posix\nwhile True:\n    posix.fork()", time_limit_s=LIMIT_S)
    assert_refused(result, "Operation not permitted")


def test_a_shell_through_posix_is_refused(outside):
    require("seccomp")
    program = f"import posix\nposix.execv('/bin/sh', ['sh', '-c', 'touch {outside}/made'])"
    assert_refused(run_python(program, time_limit_s=LIMIT_S), "Operation not permitted")


def test_a_raw_socket_to_a_listening_port_is_refused(outside):
    require("namespaces", "landlock-net", "seccomp")
    with listening() as port:
        program = f"import _socket\n_socket.socket(2, 1).connect(('127.0.0.1', {port}))"
        assert_refused(run_python(program, time_limit_s=LIMIT_S))


def test_a_unix_socket_to_a_daemon_is_refused(tmp_path):
    """A daemon listening on a path (docker's, systemd's): Landlock does not hold its connect."""
    require("seccomp")
    path = str(tmp_path / "daemon.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen()
        program = f"import _socket\n_socket.socket(_socket.AF_UNIX).connect({path!r})"
        assert_refused(run_python(program, time_limit_s=LIMIT_S), "Operation not permitted")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()


def test_a_signal_to_the_parent_is_refused(outside):
    require("landlock-scope")
    program = "import posix\nposix.kill(posix.getppid(), 0)"  # 0: only asks whether it may
    assert_refused(run_python(program, time_limit_s=LIMIT_S), "Operation not permitted")


# -- the calculator
# --------------------------------------------------------------------------------------------------

# (expression, the text nanochat's engine forces for it or None), worked by hand from
# use_calculator's rules: commas dropped; arithmetic characters without **; otherwise letters,
# quotes, parentheses, dots, underscores and spaces only, a .count( and no refused word
CALCULATIONS = [
    ("1+1", "2"),
    ("2 * 3.5", "7.0"),
    ("1,000 + 24", "1024"),
    ("10/4", "2.5"),
    ("7 // 2", "3"),
    ("(3 + 4) * 2", "14"),
    ("0.1 + 0.2", "0.30000000000000004"),
    ("-5 - -3", "-2"),
    ("()", "()"),  # all arithmetic characters: the empty tuple
    ("...", "Ellipsis"),  # and the ellipsis
    ("2**10", None),  # power refused
    ("1/0", None),  # ZeroDivisionError
    ("1 +", None),  # SyntaxError
    ("5 % 2", None),  # % is neither kind's character
    ("1e3", None),  # a letter: the .count() kind, without its .count(
    ("'strawberry'.count('r')", "3"),
    ('"banana".count("a")', "3"),
    ("'aXa'.count('a') and 'yes'", "yes"),
    ("'b'.count('a') or 1j", "1j"),
    ("'abc'.upper()", None),
    ("len('abc')", None),
    ("'a'.count('a') + 1", None),  # + is not the .count() kind's
    ("__import__('os').count('x')", None),  # __
    ("open('f').count('a')", None),  # open
    ("x.count('a')", None),  # NameError
]


@pytest.fixture(scope="module")
def calculated():
    return [calculator(expression) for expression, _ in CALCULATIONS]


def test_the_calculator_gives_the_hand_worked_values(calculated):
    assert calculated == [expected for _, expected in CALCULATIONS]


def nanochat_checkout():
    checkout = os.environ.get("NANOCHAT_CHECKOUT")
    if not checkout:
        pytest.skip("NANOCHAT_CHECKOUT is not set: no nanochat checkout to compare against")
    return Path(checkout)


def test_the_calculator_equals_nanochats_use_calculator(calculated):
    """nanochat's own use_calculator, read from its engine.py without the rest (no torch): its three
    functions, exec'd."""
    path = nanochat_checkout() / "nanochat" / "engine.py"
    wanted = {"timeout", "eval_with_timeout", "use_calculator"}
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted, f"{path} no longer defines {wanted}"
    scope = {"signal": signal, "warnings": warnings, "contextmanager": contextmanager}
    exec(compile(ast.Module(body, type_ignores=[]), str(path), "exec"), scope)
    theirs = [scope["use_calculator"](expression) for expression, _ in CALCULATIONS]
    assert calculated == [None if value is None else str(value) for value in theirs]


# programs whose success, output and memory verdict ours must share with execution.py's
PROGRAMS = [
    "print(1+1)",
    "def add(a, b):\n    return a + b\n\n\ndef check(f):\n    assert f(2, 3) == 5\n\n\ncheck(add)",
    "def add(a, b):\n    return a - b\n\n\ndef check(f):\n    assert f(2, 3) == 5\n\n\ncheck(add)",
    "def f(:\n    pass",
    "import math, itertools, collections\nprint(math.gcd(12, 18), list(itertools.pairwise('abc')))",
    "import sys\nprint('done')\nsys.exit(0)",
    "import sys\nsys.exit(3)",
    "exit(0)",  # exit is disabled: no completion passes by leaving early
    "import numpy",  # numpy sets an environment variable, and putenv is disabled
    "import os\nos.remove('x')",
    "x = bytearray(10 * 1024**3)",
]


def test_run_python_judges_programs_as_nanochats_execute_code():
    path = nanochat_checkout() / "nanochat" / "execution.py"
    scope = {"__name__": "nanochat_execution"}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    for program in PROGRAMS:
        ours, theirs = run_python(program), scope["execute_code"](program)
        assert (ours.success, ours.stdout, ours.memory_exceeded) == (
            theirs.success,
            theirs.stdout,
            theirs.memory_exceeded,
        ), program
