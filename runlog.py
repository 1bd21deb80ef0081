"""
A run's own files in out_dir, besides its checkpoints: the lock that makes the out_dir one run's, and log.jsonl.
Writing them fails in one line: a full disk stops the run (RunStopped, exit 1), a path the OS refuses is the
user's to fix (UsageError, exit 2).
"""

import errno
import fcntl
import os
import socket
import time

from configurator import RunStopped, UsageError

LOCK_FILE = "run.lock"
LOG_FILE = "log.jsonl"


def nearest_existing(path):
    """`path`, or the closest of its parents that exists: where creating it would begin."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def check_out_dir(out_dir):
    """out_dir must be a directory, or creatable as one by this user: checked before anything is written."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"out_dir {out_dir} is a file: give a directory")
    existing = nearest_existing(out_dir)
    if not os.path.isdir(existing):
        raise UsageError(f"out_dir {out_dir} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"out_dir {out_dir} cannot be written: {existing} is not writable by this user")


def write_failed(path, error, intact=None):
    """An OSError writing the run's own files, as one line: a full disk or quota stops the run (RunStopped);
    anything else (a path the OS refuses, /proc/x) is the user's to fix (UsageError). `intact`: the last
    checkpoint, in words ('checkpoint 20 in out/ckpt'), or None."""
    reason = error.strerror or str(error)
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return UsageError(f"cannot write {path} ({reason}): give another --out_dir")
    kept = f"{intact} is intact" if intact else "nothing was saved"
    return RunStopped(f"cannot write {path} ({reason}): the run stopped, {kept}; free space and "
                      f"{'resume with --init_from=resume' if intact else 'run again'}")


def claim_out_dir(out_dir, move_aside=()):
    """out_dir made and locked for this run (returns the open lock file: closing it releases the lock); the entries
    `move_aside` names (a start over: the previous run's checkpoints and log) moved to out_dir/previous-<time>-<pid>/,
    never mixed with this run's; a log line cut by a crash dropped."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = lock_out_dir(out_dir)
    except OSError as e:
        raise write_failed(e.filename or out_dir, e) from None
    old = [p for p in move_aside if os.path.exists(os.path.join(out_dir, p))]
    if old:
        aside = os.path.join(out_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.makedirs(aside)
        for p in old:
            os.rename(os.path.join(out_dir, p), os.path.join(aside, p))
        print(f"start_over: the previous run's {' and '.join(old)} moved to {aside}")
    drop_partial_line(os.path.join(out_dir, LOG_FILE))
    return lock


def lock_out_dir(out_dir):
    """This run's exclusive lock on out_dir, or one line naming the run that holds it. flock: the OS releases it
    when the process ends, however it ends, so a crashed run's lock file is stale and the next run takes it.
    Returns the open lock file: closing it releases the lock."""
    f = open(os.path.join(out_dir, LOCK_FILE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UsageError(f"{out_dir} is in use by another run ({holder}): wait for it to end, "
                         "or give this one another --out_dir") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def append_line(path, line):
    """One write() of the whole line, so that a crash leaves at most a partial last line, never two mixed."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write (disk full?)", path)
    finally:
        os.close(fd)


def drop_partial_line(path):
    """Cut a last line without its newline (a crash mid-write), which would otherwise sit mid-file once appended to."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
