"""
Code a model writes, run where it can do little harm: a Python program in a separate, fresh
interpreter (`run_python`), as nanochat's execution.py runs HumanEval's completions, and the
calculator nanochat's engine gives the model (`calculator`), evaluated there too.

The parent gives the child a wall-clock limit (its whole process group killed at the end), no
stdin, an environment of four plain variables (nothing of the parent's), a temporary working
directory removed afterwards, and stdout / stderr in files outside it. The child, before it runs
the program, takes what the kernel here allows, each layer tried and reported in the result's
`layers`: resource limits (address space, file size, CPU), its own network and IPC namespaces, no
capabilities, Landlock (writes only beneath its directory, reads only of the Python installation
and the system's libraries, no TCP, no signals out), a seccomp filter (no exec, no fork, no
sockets); then, as execution.py does, the destructive functions of os, shutil and subprocess are
disabled. What it does not stop is in docs/chat.md ("The sandbox"). `python -m run.sandbox` prints
the layers this machine gives.

This file is also the child's program: the parent runs its text with `python -I -c`, and the
`--child` branch at the bottom takes the layers and runs the program, so it imports only the
standard library.
"""

import builtins
import ctypes
import faulthandler
import json
import math
import os
import resource
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache

TIME_LIMIT_S = 5.0  # execution.py's defaults: 5 s, 256 MiB
MEMORY_LIMIT_BYTES = 256 * 1024**2
FILE_SIZE_LIMIT_BYTES = 16 * 1024**2  # any file the program writes, its stdout and stderr included
CALCULATOR_TIME_LIMIT_S = 3  # the engine's eval_with_timeout: signal.alarm(3)
LAYERS = {  # what each layer the child takes stops, for `python -m run.sandbox` and the docs
    "namespaces": "its own network namespace (a loopback that is down) and System V IPC's",
    "nocaps": "every capability dropped, bounding set included (root, or owner of a new userns)",
    "landlock-fs": "writes only beneath its directory; reads only the Python install, /usr, /lib*",
    "landlock-net": "no TCP bind or connect",
    "landlock-scope": "no signals to, no abstract unix sockets of, processes outside it",
    "seccomp": "no execve, no fork (threads only), no socket (socketpair only), ptrace, io_uring",
}


@dataclass(frozen=True)
class SandboxResult:
    """What a program did: success is exit status 0 within the limits; error is one line saying why
    it failed (None when it succeeded); layers are the LAYERS the child took before running it."""

    success: bool
    stdout: str
    stderr: str
    error: str | None = None
    timed_out: bool = False
    memory_exceeded: bool = False
    layers: tuple[str, ...] = ()


def run_python(
    source,
    time_limit_s=TIME_LIMIT_S,
    memory_limit_bytes=MEMORY_LIMIT_BYTES,
    file_size_limit_bytes=FILE_SIZE_LIMIT_BYTES,
):
    """Run Python source in a sandboxed child process and return its SandboxResult."""
    with tempfile.TemporaryDirectory(prefix="sandbox-") as base:
        # the child's own directory, and beside it (out of its reach) its program and its output
        workdir = os.path.join(base, "work")
        os.mkdir(workdir, 0o700)
        with open(os.path.join(base, "program.py"), "w", encoding="utf-8") as program:
            program.write(source)
        report_read, report_write = os.pipe()
        settings = dict(
            workdir=workdir,
            program=program.name,
            report_fd=report_write,
            time_limit_s=time_limit_s,
            memory_limit_bytes=memory_limit_bytes,
            file_size_limit_bytes=file_size_limit_bytes,
            # without site (-S): the packages, not the .pth files' code (this project's finder)
            site_packages=site.getsitepackages(),
        )
        env = dict(PATH="/usr/bin:/bin", HOME=workdir, TMPDIR=workdir, OMP_NUM_THREADS="1")
        with (
            os.fdopen(report_read, "rb") as report,
            open(os.path.join(base, "stdout"), "w+b") as out,
            open(os.path.join(base, "stderr"), "w+b") as err,
        ):
            try:
                child = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-X", "utf8", "-c", _child_source()]
                    + ["--child", json.dumps(settings)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=workdir,
                    env=env,
                    pass_fds=(report_write,),
                    start_new_session=True,  # its own process group: a timeout kills them all
                )
            finally:
                os.close(report_write)
            timed_out = not _exited_within(child.pid, time_limit_s)
            # whatever it started, where fork was not refused; killed before the child is reaped,
            # so that its pid, the group's id, cannot have gone to another process meanwhile
            os.killpg(child.pid, signal.SIGKILL)
            returncode = child.wait()
            layers = json.loads(report.read() or b"[]")
            stdout, stderr = (_read_capped(f, file_size_limit_bytes) for f in (out, err))
    return _judged(returncode, stdout, stderr, layers, timed_out, time_limit_s, memory_limit_bytes)


def _exited_within(pid, seconds):
    """Whether the child exited within seconds, left unreaped (waitid's WNOWAIT)."""
    deadline = time.monotonic() + seconds
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _read_capped(f, limit):
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace")


def _judged(returncode, stdout, stderr, layers, timed_out, time_limit_s, memory_limit_bytes):
    """The result, with one line saying why when it failed: the limit it hit, the signal that killed
    it, or the last line of its traceback ("PermissionError: ..."), as execution.py reports."""
    lines = stderr.strip().splitlines()
    last_line = lines[-1].strip() if lines else ""
    memory_exceeded = not timed_out and last_line.startswith("MemoryError")
    if timed_out:
        error = f"timed out after {time_limit_s:g} s (its process group killed)"
    elif memory_exceeded:
        error = f"memory limit of {memory_limit_bytes / 1024**2:g} MiB exceeded: {last_line}"
    elif returncode < 0:
        error = f"killed by signal {-returncode} ({signal.strsignal(-returncode)})"
    elif returncode > 0:
        error = last_line or f"exited with status {returncode}"
    else:
        error = None
    return SandboxResult(
        error is None, stdout, stderr, error, timed_out, memory_exceeded, tuple(layers)
    )


@cache
def _child_source():
    with open(__file__) as f:
        return f.read()


@cache
def sandbox_layers():
    """The layers a child takes on this machine, measured by running an empty program."""
    return run_python("pass").layers


# -- the calculator: nanochat's engine's use_calculator, evaluated in the sandbox
# --------------------------------------------------------------------------------------------------

ARITHMETIC_CHARACTERS = set("0123456789*+-/.() ")
# the other expressions it evaluates: string literals and their .count(), nothing else
COUNT_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")
REFUSED_WORDS = (
    "__ import exec eval compile open file input raw_input globals locals vars dir getattr setattr"
    " delattr hasattr"
).split()
# the child evaluates the expression with no builtins and prints str() of its value as JSON, null
# for None (the engine forces no output for None)
CALCULATOR_PROGRAM = """\
import json, warnings
warnings.simplefilter("ignore", SyntaxWarning)
value = eval(compile({expression!r}, "<calculator>", "eval"), {{"__builtins__": {{}}}}, {{}})
print(json.dumps(None if value is None else str(value)))
"""


def calculator(expression):
    """The text nanochat's engine forces between <|output_start|> and <|output_end|> for the
    expression inside <|python_start|> ... <|python_end|> (str of use_calculator's value), or None
    where it forces nothing: the same filters (commas dropped; arithmetic without `**`, or string
    literals with a .count() and none of its refused words), then the value, evaluated in the
    sandbox within the engine's 3 s rather than in the engine's own process."""
    expression = expression.replace(",", "")
    if set(expression) <= ARITHMETIC_CHARACTERS:
        if "**" in expression:  # a power can take any time and memory
            return None
    elif not set(expression) <= COUNT_CHARACTERS:
        return None
    elif any(word in expression.lower() for word in REFUSED_WORDS) or ".count(" not in expression:
        return None
    result = run_python(
        CALCULATOR_PROGRAM.format(expression=expression), time_limit_s=CALCULATOR_TIME_LIMIT_S
    )
    return json.loads(result.stdout) if result.success else None


# -- the child: the layers, then the program
# --------------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_ulong = ctypes.c_ulong
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 24, 38, 22
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWIPC = 0x10000000, 0x40000000, 0x08000000


def _syscall(number, *args):
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def _prctl(option, *args):
    args = [_ulong(a) if isinstance(a, int) else a for a in args] + [_ulong(0)] * (4 - len(args))
    if _libc.prctl(ctypes.c_int(option), *args) < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _set_limits(settings):
    """execution.py's three memory limits, the file size, no core dump, and a CPU limit that ends
    the child should the parent die before its wall-clock kill; none above a hard limit it has."""
    memory, file_size = settings["memory_limit_bytes"], settings["file_size_limit_bytes"]
    cpu_s = math.ceil(settings["time_limit_s"]) + 1
    limits = dict(AS=memory, DATA=memory, STACK=memory, FSIZE=file_size, CORE=0, CPU=cpu_s)
    for name, value in limits.items():
        limit = getattr(resource, f"RLIMIT_{name}")
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _own_namespaces(settings):
    """A network namespace with nothing in it, and System V IPC's own (no other process's shared
    memory or queues): as root directly, otherwise inside a new user namespace."""
    flags = CLONE_NEWNET | CLONE_NEWIPC | (CLONE_NEWUSER if os.geteuid() != 0 else 0)
    return ["namespaces"] * (_libc.unshare(ctypes.c_int(flags)) == 0)


def _drop_capabilities(settings):
    """No capability left, the bounding set emptied too so that no exec gives one back. Root
    without capabilities cannot raise its limits, kill other users' processes, mount or reboot."""
    for capability in range(64):
        if _libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), _ulong(capability), *[_ulong(0)] * 3):
            break  # EINVAL past the last capability this kernel knows; EPERM: no capabilities
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _syscall(126, header, (ctypes.c_uint32 * 6)())  # capset: effective, permitted, inheritable = 0
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # nor a setuid or file-capability binary
    return ["nocaps"]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("handled_fs", "handled_net", "scoped")]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


# Landlock's filesystem rights (linux/landlock.h): execute, write, read a file, read a directory,
# then removing and making things; refer (ABI 2), truncate (ABI 3) and device ioctls (ABI 5)
LANDLOCK_READ = 0b1101  # EXECUTE | READ_FILE | READ_DIR
LANDLOCK_FILE_RIGHTS = 0b1 | 0b10 | 0b100 | 1 << 14 | 1 << 15  # those a rule on a file may hold


def _landlock(settings):
    """Landlock's ruleset: reads beneath the Python installation and the system's libraries,
    everything beneath workdir, no TCP, no signals or abstract sockets out. Returns the layers."""
    abi = _libc.syscall(ctypes.c_long(444), None, _ulong(0), _ulong(1))  # its ABI version
    if abi < 1:
        return []
    handled_fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # the rights it knows
    attr = _RulesetAttr(handled_fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct grew with the ABI
    ruleset = _syscall(444, ctypes.byref(attr), _ulong(size), _ulong(0))
    readable = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path}
    readable |= {"/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/localtime"}
    rules = [(path, LANDLOCK_READ) for path in readable if path]
    rules += [("/dev/null", 0b110), ("/dev/urandom", 0b100), (settings["workdir"], handled_fs)]
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
            if not os.path.isdir(path):
                access &= LANDLOCK_FILE_RIGHTS
            rule = _PathBeneath(access & handled_fs, fd)
            try:
                _syscall(445, _ulong(ruleset), ctypes.c_int(1), ctypes.byref(rule), _ulong(0))
            finally:
                os.close(fd)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _syscall(446, _ulong(ruleset), _ulong(0))
    finally:
        os.close(ruleset)
    return ["landlock-fs"] + ["landlock-net"] * (abi >= 4) + ["landlock-scope"] * (abi >= 6)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8)]
    _fields_ += [("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


# x86_64's numbers of execve, execveat, fork, vfork, socket (a unix socket could reach a daemon by
# its path, which Landlock does not hold; socketpair stays), ptrace, unshare, setns, mount, bpf,
# perf_event_open, userfaultfd, the keyrings' add_key, request_key and keyctl, and io_uring's setup,
# enter and register (io_uring's operations would not pass through this filter). The filter is
# written for x86_64 only
REFUSED_SYSCALLS = (59, 322, 57, 58, 41, 101, 272, 308, 165, 321, 298, 323, 248, 249, 250)
REFUSED_SYSCALLS += (425, 426, 427)
SYS_CLONE, SYS_CLONE3, CLONE_THREAD = 56, 435, 0x00010000
EPERM, ENOSYS = 1, 38
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000


def _seccomp(settings):
    """A seccomp filter: the REFUSED_SYSCALLS fail with EPERM, clone only makes threads (clone3
    fails with ENOSYS, so that glibc falls back to clone)."""
    if os.uname().machine != "x86_64":
        return []
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF's opcodes (with their modes)
    arch, nr, arg0 = 4, 0, 16  # offsets in struct seccomp_data (arg0's low 32 bits)
    program = [
        (load, 0, 0, arch),
        (jeq, 1, 0, 0xC000003E),  # AUDIT_ARCH_X86_64; i386's int 0x80 is another architecture
        (ret, 0, 0, RET_KILL_PROCESS),
        (load, 0, 0, nr),
        (jge, 0, 1, 0x40000000),  # x32's numbers, the same calls by other names
        (ret, 0, 0, RET_ERRNO | EPERM),
        (jeq, 0, 1, SYS_CLONE3),
        (ret, 0, 0, RET_ERRNO | ENOSYS),
    ]
    for number in REFUSED_SYSCALLS:
        program += [(jeq, 0, 1, number), (ret, 0, 0, RET_ERRNO | EPERM)]
    program += [
        (jeq, 0, 4, SYS_CLONE),
        (load, 0, 0, arg0),
        (jset, 0, 1, CLONE_THREAD),
        (ret, 0, 0, RET_ALLOW),
        (ret, 0, 0, RET_ERRNO | EPERM),
        (ret, 0, 0, RET_ALLOW),
    ]
    instructions = (_SockFilter * len(program))(*program)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_SECCOMP, 2, ctypes.byref(_SockFprog(len(program), instructions)))
    return ["seccomp"]


def _refused(name):
    def refuse(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the sandbox")

    return refuse


# execution.py's list of what it disables, and the rest of the ways os runs other programs
REFUSED_OS = (
    "kill killpg system putenv remove removedirs rmdir fchdir setuid fork forkpty rename renames"
    " truncate replace unlink fchmod fchown chmod chown chroot lchflags lchmod lchown getcwd chdir"
    " execl execle execlp execlpe execv execve execvp execvpe popen posix_spawn posix_spawnp"
    " spawnl spawnle spawnlp spawnlpe spawnv spawnve spawnvp spawnvpe"
).split()


def _disable_destructive_functions():
    """execution.py's guard, in Python: a program that calls these gets a PermissionError. Any
    program can reach past it (posix, importlib); the layers above are what hold then."""
    faulthandler.disable()
    builtins.exit = builtins.quit = builtins.help = None
    for name in REFUSED_OS:
        if hasattr(os, name):
            setattr(os, name, _refused(f"os.{name}"))
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, _refused(f"shutil.{name}"))
    subprocess.Popen = _refused("subprocess.Popen")

    class NoNewSocket(socket.socket):  # socketpair's sockets come with a fileno: asyncio's loop
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                raise PermissionError("socket.socket is disabled in the sandbox")
            super().__init__(family, type, proto, fileno)

    socket.socket = NoNewSocket
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter", "ctypes", "_ctypes"):
        sys.modules[name] = None


def _run_child(settings):
    with open(settings["program"]) as program:
        source = program.read()
    sys.path += settings["site_packages"]
    _set_limits(settings)
    layers = []
    for take in (_own_namespaces, _drop_capabilities, _landlock, _seccomp):
        try:
            layers += take(settings)
        except OSError:
            pass  # not on this machine (or not for this user): the others hold what they can
    with os.fdopen(settings["report_fd"], "w") as report:
        json.dump(layers, report)
    _disable_destructive_functions()
    sys.argv = ["-c"]
    exec(compile(source, "<program>", "exec"), {"__name__": "__main__"})


def main():
    """The layers a sandboxed program gets on this machine, and what one costs."""
    start = time.perf_counter()
    result = run_python("print(1 + 1)")
    seconds = time.perf_counter() - start
    print(f"a sandboxed print(1 + 1): {result.stdout.strip()!r} in {seconds:.3f} s")
    for name, what in LAYERS.items():
        print(f"{'yes' if name in result.layers else 'NO ':4}{name:15}{what}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _run_child(json.loads(sys.argv[2]))
    else:
        main()
