"""
A lost process, in a run of several: every other process stops within seconds, in one line naming
it.

JAX's coordination service (it lives in process 0) ends a run one of whose processes died only after
its heartbeat timeout (100 s), aborting the others with a many-line C++ dump; when process 0 dies,
the others abort at once, the same way. This watchdog answers first. train.py starts it right after
jax.distributed.initialize().
"""

import atexit
import ctypes
import os
import select
import signal
import socket
import sys
import threading
import time

import jax
from jax._src import distributed
from jax._src.lib import utils as jaxlib_utils

from compute.sharding import start_backend

# each process says "alive" to its peers this often, from a thread (compiling releases the GIL)
HEARTBEAT_S = 2
# a peer silent this long is lost (its host is down, or it is frozen): JAX itself takes 100 s
SILENT_S = 30
VERDICT_S = 5  # how long an error or an abort waits for the watchdog to name a lost process
WATCH_KEY = "nanogpt/watchdog_port"  # in JAX's key-value store: where process 0's watchdog listens
LOST = (
    "error: process {} of {} stopped responding (killed, or its host is down): this process stops "
    "too; resume every process with --init_from=resume"
)
ABORTED = (
    "error: process {} of {} aborted in JAX's C++ runtime; the C++ log is quiet on every process "
    "but 0: rerun with TF_CPP_MIN_LOG_LEVEL=0 to see why"
)
QUIET = 4  # an absl log level above FATAL (3): no C++ log line at all
# sa_sigaction's signature
ABORT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def watch_processes():
    """In a run of several processes (after jax.distributed.initialize): start this process's
    watchdog, so that one process killed, crashed or cut off ends every other within seconds
    (SILENT_S where nothing says so), each with one line naming it (LOST) and exit 1. None in a run
    of one process."""
    state = distributed.global_state
    if state.client is None or state.num_processes < 2:
        return None
    # libtpu installs a crash handler as it starts: the watchdog's abort handler goes after it
    start_backend()
    return ProcessWatch(
        state.client, state.process_id, state.num_processes, state.coordinator_address
    )


def stop_in_one_line(line):
    """End this process at once, `line` the last thing on its stderr: a traceback of the main thread
    or a C++ log line written meanwhile goes nowhere. What stdout holds is flushed first, if that
    takes under a second."""
    err = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    # the main thread may hold stdout's lock
    flush = threading.Thread(target=sys.stdout.flush, daemon=True)
    flush.start()
    flush.join(1)
    os.write(err, (line + "\n").encode())
    os._exit(1)


class ProcessWatch:
    """Process 0 holds a TCP connection to every other process (a star, as JAX's coordination
    service); on each, both ends say "alive" every HEARTBEAT_S and "bye" as they exit. A connection
    that closes without a bye (the kernel closes a killed process's at once) or stays silent
    SILENT_S is a lost process: process 0 tells the others which, and each stops in one line. The
    heartbeats come from a daemon thread, nothing touches the training step, and a long compilation
    does not stop them.

    Process 0 hosts the coordination service, so the others' JAX client aborts the moment it dies:
    in them, C++ logging is quiet (unless TF_CPP_MIN_LOG_LEVEL says otherwise) and SIGABRT waits for
    the watchdog's verdict. An uncaught JaxRuntimeError, a collective failing as a peer dies, also
    waits for it before its traceback."""

    def __init__(self, client, me, n, coordinator):
        self.me, self.n = me, n
        self.peers = {}  # process id -> its socket
        self.heard = {}  # process id -> time.monotonic() of its last word
        self.said_bye = set()
        self.verdict = threading.Event()  # set once a process is lost: this one is ending
        self.verdict_lock = threading.Lock()
        self.exiting = False  # this process is exiting by itself: nothing is an alarm any more
        self.send_lock = threading.Lock()  # one writer per socket at a time
        self.server = None
        if me == 0:
            self.server = (
                socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
                if socket.has_dualstack_ipv6()
                else socket.create_server(("", 0))
            )
            client.key_value_set(WATCH_KEY, str(self.server.getsockname()[1]))
        atexit.register(self._bye)
        self.previous_excepthook, sys.excepthook = sys.excepthook, self._excepthook
        threading.Thread(
            target=self._watch, args=(client, coordinator), name="process-watchdog", daemon=True
        ).start()

    def _connect(self, client, coordinator):
        """Any process but 0: connect to process 0's watchdog, at the coordinator's host."""
        try:
            port = int(client.blocking_key_value_get(WATCH_KEY, 60_000))
            s = socket.create_connection(
                (coordinator.rsplit(":", 1)[0].strip("[]"), port), timeout=30
            )
            s.settimeout(None)
            s.sendall(f"hello {self.me}\n".encode())
        except (OSError, jax.errors.JaxRuntimeError) as e:
            print(
                f"warning: process {self.me} cannot reach process 0's watchdog ({e}): if a process "
                "is lost, JAX's own abort ends this one, after 100 s",
                file=sys.stderr,
                flush=True,
            )
            return False
        self.peers[0], self.heard[0] = s, time.monotonic()
        self._hook_abort()
        return True

    def _watch(self, client, coordinator):
        if self.me and not self._connect(client, coordinator):
            return
        # socket -> process id (None until process 0 hears its hello)
        who = {s: k for k, s in self.peers.items()}
        partial = {s: b"" for s in who}
        said = time.monotonic()
        while True:
            readable, _, _ = select.select(
                [*who, *([self.server] if self.server else [])], [], [], HEARTBEAT_S
            )
            now = time.monotonic()
            for s in readable:
                if s is self.server:
                    conn, _ = s.accept()
                    who[conn], partial[conn] = None, b""
                    continue
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                k = who[s]
                if not data:  # closed
                    del who[s], partial[s]
                    if k is not None:
                        del self.peers[k]
                        if k not in self.said_bye:
                            self._lost(k)
                    continue
                *lines, partial[s] = (partial[s] + data).split(b"\n")
                for line in lines:
                    word, _, arg = line.decode().partition(" ")
                    if word == "hello":
                        k = who[s] = int(arg)
                        self.peers[k] = s
                    elif word == "bye":
                        self.said_bye.add(k)
                    elif word == "lost":
                        self._lost(int(arg))
                if k is not None:
                    self.heard[k] = now
            for k, t in list(self.heard.items()):
                if k in self.peers and k not in self.said_bye and now - t > SILENT_S:
                    self._lost(k)
            if now - said >= HEARTBEAT_S:
                self._say("alive")
                said = now

    def _say(self, word, peers=None):
        with self.send_lock:
            for k, s in list(self.peers.items()):
                if peers is None or k in peers:
                    try:
                        s.sendall(f"{word}\n".encode())
                    except OSError:  # it is gone: its socket says so to the watchdog
                        pass

    def _lost(self, k):
        """Process k is lost: say so in one line and exit 1; process 0 tells the others first."""
        with self.verdict_lock:
            if self.exiting:
                return  # this process is exiting by itself: a peer gone meanwhile is no news
            first = not self.verdict.is_set()
            self.verdict.set()
        if not first:
            self._wait_for_the_end()
        # process 0 tells the others
        others = [p for p in self.peers if p != k] if self.me == 0 else []
        self._say(f"lost {k}", others)
        # they read it before they notice that process 0's coordination service is gone: wait for
        # them to close
        deadline = time.monotonic() + 2
        for s in [self.peers.get(p) for p in others]:
            while s is not None and time.monotonic() < deadline:
                s.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    if not s.recv(4096):
                        break
                except OSError:
                    break
        stop_in_one_line(LOST.format(k, self.n))

    @staticmethod
    def _wait_for_the_end():
        """Another thread is ending the process (stop_in_one_line)."""
        while True:
            time.sleep(1)

    def _bye(self):
        with self.verdict_lock:
            self.exiting = True
        self._say("bye")

    def _excepthook(self, kind, value, tb):
        if (
            issubclass(kind, jax.errors.JaxRuntimeError)
            and not self.exiting
            and self.verdict.wait(VERDICT_S)
        ):
            self._wait_for_the_end()
        self.previous_excepthook(kind, value, tb)

    def _hook_abort(self):
        """Any process but 0: no C++ log line, and a SIGABRT handler (sigaction: Python's own
        handlers run too late, after abort() has ended the process) that lets the watchdog speak
        first. The handler takes the place of the crash handler that libtpu or absl installed,
        keeping its flags, and hands the signal back to it after."""
        # jax's own default (jax/__init__.py): not the user's
        if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
            jaxlib_utils.absl_set_min_log_level(QUIET)
        libc = ctypes.CDLL(None, use_errno=True)
        # a struct sigaction: its first field the handler
        self.crash_handler = ctypes.create_string_buffer(256)
        if libc.sigaction(signal.SIGABRT, None, self.crash_handler):
            return
        action = ctypes.create_string_buffer(self.crash_handler.raw, 256)
        # kept: the C pointer lives as long as this object
        self.on_abort = ABORT_HANDLER(self._on_abort)
        ctypes.c_void_p.from_buffer(action).value = ctypes.cast(
            self.on_abort, ctypes.c_void_p
        ).value
        libc.sigaction(signal.SIGABRT, action, None)
        self.libc = libc

    def _on_abort(self, signum, info, context):
        if not self.exiting:
            if (
                not self.verdict.wait(VERDICT_S)
                and time.monotonic() - self.heard.get(0, 0) > 2 * HEARTBEAT_S
            ):
                self._lost(0)  # process 0 went quiet while we waited (its host is down)
            if self.verdict.is_set():
                self._wait_for_the_end()
            os.write(2, (ABORTED.format(self.me, self.n) + "\n").encode())
        # the crash handler gets the signal once this one returns (SIGABRT is blocked until then)
        self.libc.sigaction(signal.SIGABRT, self.crash_handler, None)
        signal.raise_signal(signal.SIGABRT)
