"""
The lock that makes an out_dir one run's: an flock on a filesystem (lock_out_dir), an object on an
object store (ObjectLock). A second run on the same out_dir is refused in one line naming the
holder; a dead run's lock is taken over. runlog.claim_out_dir takes it at the start of a run.
"""

import fcntl
import json
import os
import secrets
import socket
import threading
import time

from configurator import RunStopped, UsageError
from dataio import storage

LOCK_FILE = "run.lock"
# On an object store the lock is an object, not an flock the OS drops with the process: its holder
# rewrites it every LOCK_REFRESH_S, and a lock not rewritten for LOCK_STALE_S is a dead run's, which
# the next run takes over
LOCK_REFRESH_S, LOCK_STALE_S = 30, 120


def lock_out_dir(out_dir):
    """This run's exclusive lock on out_dir, or one line naming the run that holds it. flock: the OS
    releases it when the process ends, however it ends, so a crashed run's lock file is stale and
    the next run takes it. Returns the open lock file: closing it releases the lock."""
    f = open(os.path.join(out_dir, LOCK_FILE), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UsageError(
            f"{out_dir} is in use by another run ({holder}): wait for it to end, "
            "or give this one another --out_dir"
        ) from None
    f.truncate(0)
    f.write(
        f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    )
    f.flush()
    return f


class ObjectLock:
    """lock_out_dir on an object store: out_dir/run.lock, an object created only if absent (a
    generation precondition, so that of two runs starting at once one wins), naming its holder and
    rewritten every LOCK_REFRESH_S while the run lives; deleted when it ends. A lock not rewritten
    for LOCK_STALE_S, or whose holder was a process of this host that is gone (a crash, kill -9), is
    a dead run's: taken over by deleting exactly that generation, so that of two runs taking it over
    one wins. A live run's lock is never taken."""

    def __init__(self, out_dir):
        self.url = storage.join(out_dir, LOCK_FILE)
        self.fs, self.path = storage.filesystem(self.url)
        self.holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run": secrets.token_hex(8),
        }
        if not self._create():
            generation, held = self._read()
            if held is not None and not self._dead(held):
                raise UsageError(
                    f"{out_dir} is in use by another run (pid {held.get('pid')} on "
                    f"{held.get('host')}, lock refreshed "
                    f"{time.time() - held.get('refreshed', 0):.0f} s ago): wait for it to end (a "
                    f"run that died leaves a lock taken over after {LOCK_STALE_S} s), or give this "
                    "one another --out_dir"
                )
            if generation is not None:
                self._delete(generation)
            if not self._create():
                raise UsageError(
                    f"{out_dir} was taken by another run starting at the same time: give this one "
                    "another --out_dir"
                )
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh, daemon=True, name="out_dir lock")
        self._refresher.start()

    def _content(self):
        return json.dumps({**self.holder, "refreshed": time.time()}).encode()

    def _create(self):
        try:
            with storage.errors(self.url, "out_dir lock"):
                self.fs.pipe_file(self.path, self._content(), mode="create")
            return True
        except FileExistsError:
            return False

    def _read(self):
        """(generation, holder dict) of the lock object, or (None, None) once it is gone."""
        try:
            with storage.errors(self.url, "out_dir lock"):
                self.fs.invalidate_cache(self.path)
                generation = self.fs.info(self.path)["generation"]
                held = json.loads(self.fs.cat_file(self.path))
            return generation, held if isinstance(held, dict) else {}
        except FileNotFoundError:
            return None, None
        except ValueError:  # not ours, or cut: whoever wrote it, it is no live run's refresh
            return generation, {}

    def _dead(self, held):
        if time.time() - held.get("refreshed", 0) > LOCK_STALE_S:
            return True
        if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
            return False
        try:
            os.kill(held["pid"], 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False

    def _delete(self, generation):
        bucket, key = self.path.split("/", 1)
        try:  # only that generation: a lock another run has just taken stays
            self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=generation)
        except (FileNotFoundError, OSError):
            pass  # gone already, or taken since: the create that follows tells

    def _refresh(self):
        while not self._stop.wait(LOCK_REFRESH_S):
            try:
                _, held = self._read()
                if held is not None and held.get("run") != self.holder["run"]:
                    print(
                        f"warning: the lock {self.url} was taken over by another run (this one did "
                        f"not refresh it for {LOCK_STALE_S} s): stop one of them",
                        flush=True,
                    )
                    return
                self.fs.pipe_file(self.path, self._content())
            # a lost network: the next refresh tries again; the lock is stale only after minutes
            except Exception:
                pass

    def close(self):
        """Released, if this run still holds it. Never raises: at the end of a run that failed (the
        network gone), the run's own line says why; a lock left behind is taken over once stale."""
        self._stop.set()
        self._refresher.join()
        try:
            generation, held = self._read()
            if held is not None and held.get("run") == self.holder["run"]:
                self._delete(generation)
        except (UsageError, RunStopped, OSError):
            pass
