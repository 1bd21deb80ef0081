"""
Where a run's files live: a local path, or a URL (gs://bucket/folder on Cloud Storage, or any other
fsspec URL). Orbax and tensorstore write checkpoints to either themselves; this module reads and
writes our own files there (the log, the lock, the marker hosts check, exports, datasets) through
fsspec (gcsfs for gs://), and turns a storage failure into one line naming the bucket and what to
do.

On Cloud Storage an object is written whole or not at all and is never appended to: write_bytes is
that everywhere (a local file is written beside and renamed over), and runlog keeps log.jsonl and
the lock within it.
"""

import errno
import logging
import os
import re
from contextlib import contextmanager

from configurator import MissingExtras, RunStopped, UsageError, require_extras


def is_url(path):
    return isinstance(path, str) and "://" in path


def absolute(path):
    return path if is_url(path) else os.path.abspath(path)


def join(base, *parts):
    return "/".join([base.rstrip("/"), *parts]) if is_url(base) else os.path.join(base, *parts)


def dirname(path):
    return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def bucket_of(url):
    """'gs://bucket' of 'gs://bucket/a/b'."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def filesystem(url):
    """(fsspec filesystem, its path) of a URL. gcsfs finds credentials as Google's clients do (ADC,
    a TPU VM's service account); with $STORAGE_EMULATOR_HOST it talks to that emulator instead."""
    import fsspec

    # gcsfs logs a warning at every bucket it opens without the storage-control API (most accounts),
    # and a traceback at each failed request: our one line says it
    # the latter: gcsfs's read-ahead, a traceback per failed read
    for name in ("gcsfs", "fsspec.prefetcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec names the package its protocol needs: gcsfs is the gcs extras
        raise MissingExtras.of(e) or e


def _local_or_url(path, local, remote):
    """local(path) for a local path, else remote(fs, its path) with a storage failure as one
    line."""
    if not is_url(path):
        return local(path)
    fs, p = filesystem(path)
    with errors(path):
        return remote(fs, p)


def exists(path):
    return _local_or_url(path, os.path.exists, lambda fs, p: fs.exists(p))


def isdir(path):
    """A local directory, or a URL prefix holding at least one object (object stores have no empty
    folders)."""
    return _local_or_url(path, os.path.isdir, lambda fs, p: _kind(fs, p) == "directory")


def isfile(path):
    return _local_or_url(path, os.path.isfile, lambda fs, p: _kind(fs, p) == "file")


def _kind(fs, p):
    """'file', 'directory', or None where nothing is. Not fsspec's isdir and isfile: they answer
    False to any OSError, a lost network's too (which is not 'no checkpoint there')."""
    try:
        return fs.info(p)["type"]
    except FileNotFoundError:
        return None


def glob(pattern):
    """Sorted matches of a glob pattern, local or URL (full URLs back)."""
    if not is_url(pattern):
        import glob as glob_

        return sorted(glob_.glob(pattern))
    fs, p = filesystem(pattern)
    with errors(pattern):
        return sorted(fs.unstrip_protocol(m) for m in fs.glob(p))


def size(path):
    return _local_or_url(path, os.path.getsize, lambda fs, p: fs.size(p))


def read_bytes(path, start=None, end=None):
    """The whole file, or bytes [start, end) of it: a ranged read on an object store."""
    if not is_url(path):
        with open(path, "rb") as f:
            if start is None:
                return f.read()
            f.seek(start)
            return f.read(end - start)
    fs, p = filesystem(path)
    with errors(path):
        return fs.cat_file(p, start=start, end=end)


def write_bytes(path, data):
    """`data` as the file at `path`, whole or not at all: one object upload, or locally a file
    beside renamed over it."""
    if not is_url(path):
        tmp = f"{path}.partial"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return
    fs, p = filesystem(path)
    with errors(path):
        fs.pipe_file(p, data)


def makedirs(path):
    if not is_url(path):  # an object store needs none
        os.makedirs(path, exist_ok=True)


def remove(path, recursive=False):
    if not is_url(path):
        import shutil

        return shutil.rmtree(path) if recursive else os.remove(path)
    fs, p = filesystem(path)
    with errors(path):
        fs.rm(p, recursive=recursive)


def move(src, dst):
    """A file or folder renamed; on an object store, each object copied then deleted (there is no
    rename)."""
    if not is_url(src):
        return os.rename(src, dst)
    fs, p = filesystem(src)
    with errors(src):
        fs.mv(p, filesystem(dst)[1], recursive=True)


def upload(local_dir, url):
    """Every file under a local folder to the same names under `url`."""
    fs, p = filesystem(url)
    with errors(url):
        for root, _, files in os.walk(local_dir):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), local_dir)
                fs.put_file(os.path.join(root, name), f"{p.rstrip('/')}/{rel.replace(os.sep, '/')}")


def check_reachable(url, what="out_dir"):
    """Before anything is written: credentials, the bucket, this account's access, the network, each
    failing in one line naming the bucket and what to do."""
    bucket = bucket_of(url)
    if url.startswith("gs://") and not os.environ.get("STORAGE_EMULATOR_HOST"):
        require_extras("gcs")  # before google.auth, which comes with gcsfs
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            google.auth.default()
        except DefaultCredentialsError as e:
            raise UsageError(
                f"{what} {url}: no Google Cloud credentials to reach {bucket} "
                f"({str(e).splitlines()[0][:160]}): run `gcloud auth application-default login`, "
                "or on a TPU VM give its service account access to the bucket"
            ) from None
    # after the credentials: gcsfs, finding none, would wait on the metadata server
    fs, p = filesystem(url)
    with errors(url, what):
        try:
            # the bucket listed: forbidden and unreachable say so here too
            fs.ls(p.split("/", 1)[0])
        except FileNotFoundError:
            raise UsageError(
                f"{what} {url}: the bucket {bucket} does not exist: create it (gcloud storage "
                f"buckets create {bucket}) or check the name"
            ) from None


@contextmanager
def errors(url, what=None):
    """A storage client's failure on `url` as one line: a missing bucket or a refusal is the user's
    to fix (UsageError), a lost network stops the run (RunStopped). Other errors (a missing object)
    pass unchanged."""
    try:
        yield
    except (UsageError, RunStopped, FileExistsError):
        raise
    except Exception as e:  # gcsfs, aiohttp and google-auth raise many kinds
        line = failure_line(url, e, what)
        if line is None:
            raise
        raise line from None


def failure_line(url, e, what=None):
    """The one-line error for storage failure `e` on `url`, or None when it is not one (a missing
    object)."""
    if not is_url(url):
        return None
    bucket, text = bucket_of(url), " ".join(str(e).split())[:200] or type(e).__name__
    where = f"{what} {url}" if what else url
    if _network_error(e):  # first: a refused connection's text may hold a port such as 54031
        return RunStopped(f"{where}: cannot reach {bucket} ({text}): check the network and retry")
    if isinstance(e, PermissionError) or re.search(r"Forbidden|\b40[13]\b", text):
        return UsageError(
            f"{where}: permission denied on {bucket} ({text}): give this account roles/storage."
            "objectAdmin on the bucket (gcloud storage buckets add-iam-policy-binding)"
        )
    return None


def write_failure(where, e):
    """(cause, fix) of a failed write to `where`: the first error in e's chain that says what to do
    (a full or read-only disk, a lost network, a refused bucket) and that fix. For a URL whose chain
    names none, the client's error as it lists the bucket now, no cached listing: e may be a symptom
    (orbax's 'Path is not a directory' when the network went mid-save: fsspec answers False to isdir
    on any error). Else (e, 'fix the cause above')."""
    chain = e
    while chain is not None:
        if (fix := _fix_for(chain, where)) is not None:
            return chain, fix
        chain = chain.__cause__ or chain.__context__
    if is_url(where):
        fs, p = filesystem(where)
        bucket = p.split("/", 1)[0]
        try:
            fs.invalidate_cache(bucket)
            fs.ls(bucket)
        except Exception as listed:  # noqa: BLE001 - gcsfs, aiohttp and google-auth raise many kinds
            if (fix := _fix_for(listed, where)) is not None:
                return listed, fix
    return e, "fix the cause above"


def _fix_for(error, where):
    """What to do about `error` writing to `where`, or None where it does not say."""
    if isinstance(error, OSError) and error.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EACCES,
        errno.EROFS,
    ):
        return (
            "free space"
            if error.errno in (errno.ENOSPC, errno.EDQUOT)
            else f"make {where} writable"
        )
    line = failure_line(where, error)
    return (
        None
        if line is None
        else "check the network"
        if isinstance(line, RunStopped)
        else "fix the bucket's access"
    )


def _network_error(e):
    import asyncio

    try:
        import aiohttp

        client_errors = (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError)
    except ImportError:
        client_errors = ()
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, ConnectionError, *client_errors)):
        return True
    return isinstance(e, OSError) and e.errno in (
        errno.ECONNREFUSED,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.ETIMEDOUT,
    )


def stat(path):
    """(size, version) of a file as the store has it now, no cached listing: a local file's mtime,
    an object's generation (Cloud Storage; another store's etag or mtime). FileNotFoundError where
    it is gone."""
    if not is_url(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns
    fs, p = filesystem(path)
    # fsspec keeps listings for the process's life: a file changed elsewhere is not in them
    fs.invalidate_cache(p)
    with errors(path):
        info = fs.info(p)
    return info["size"], next(
        (str(info[k]) for k in ("generation", "ETag", "etag", "mtime", "created") if k in info),
        None,
    )


def read_ranges(paths, starts, ends):
    """Bytes [start, end) of each of `paths` (on one filesystem), as a list: concurrent ranged reads
    at a URL."""
    if not is_url(paths[0]):
        return [read_bytes(p, s, e) for p, s, e in zip(paths, starts, ends)]
    fs, _ = filesystem(paths[0])
    names = {p: filesystem(p)[1] for p in set(paths)}
    with errors(paths[0]):
        return fs.cat_ranges([names[p] for p in paths], list(starts), list(ends), on_error="raise")
