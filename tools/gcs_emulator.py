"""A Cloud Storage emulator on loopback for the tests (gcp-storage-emulator, from PyPI), with what
it lacks and a run on gs:// relies on: the generation preconditions GCS defines (ifGenerationMatch
on an upload and on a delete, so that a lock object is created only if absent), the generation in a
read's headers (tensorstore's read-modify-write), concurrent connections served one at a time,
objects.move (gcsfs's mv), a bucket that refuses this account (FORBIDDEN, 403) as IAM would, and an
index on disk that a kill cannot leave half written.

    # in memory, or kept in DIR (a restart finds it again)
    python tools/gcs_emulator.py PORT [DIR]

prints `ready` once it serves. The real clients reach it by the environment of
`client_env(port)`."""

import os
import sys
import threading
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer

BUCKET = "nanogpt-test"  # created at start
FORBIDDEN = "forbidden-bucket"


def client_env(port):
    """What points gcsfs (google's clients) and tensorstore (orbax's arrays) at the emulator,
    without credentials."""
    url = f"http://127.0.0.1:{port}"
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
        "TENSORSTORE_GCS_HTTP_VERSION": "1",
    }


def _error(response, status, message):
    response.status = status
    response.json(
        {"error": {"code": status.value, "message": message, "errors": [{"message": message}]}}
    )


def _precondition_failed(request, storage):
    """GCS's ifGenerationMatch: 0 means 'only if absent', a generation 'only if it is still that
    one'."""
    wanted = request.query.get("ifGenerationMatch")
    if not wanted:
        return False
    from gcp_storage_emulator.exceptions import NotFound

    name = request.params.get("object_id") or (request.query.get("name") or [None])[0]
    if name is None and isinstance(request.data, dict):
        name = request.data["meta"].get("name")
    try:
        generation = storage.get_file_obj(request.params["bucket_name"], name)["generation"]
    except NotFound:
        generation = "0"
    return str(generation) != wanted[0]


# the emulator's storage is not thread-safe (its resumable uploads raced): requests are accepted
# concurrently, then served one at a time
_SERVING = threading.Lock()


def _guarded(handler, storage):
    def handle(request, response, *args, **kwargs):
        with _SERVING:
            return _handle(handler, storage, request, response, *args, **kwargs)

    return handle


def _handle(handler, storage, request, response, *args, **kwargs):
    """One request, as GCS would answer it: FORBIDDEN refused, preconditions held, generations
    named."""
    if request.params.get("bucket_name") == FORBIDDEN:
        return _error(
            response,
            HTTPStatus.FORBIDDEN,
            f"emulator@test does not have storage.objects access to the bucket {FORBIDDEN}.",
        )
    if request.method in ("POST", "PUT", "DELETE") and _precondition_failed(request, storage):
        return _error(
            response,
            HTTPStatus.PRECONDITION_FAILED,
            "At least one of the pre-conditions you specified did not hold.",
        )
    result = handler(request, response, storage, *args, **kwargs)
    if request.method == "GET" and request.params.get("object_id") and response.status.value < 300:
        _generation_headers(request, response, storage)
    return result


def _generation_headers(request, response, storage):
    """GCS names an object's generation in each read's headers; tensorstore's read-modify-write of a
    checkpoint's manifest needs it (without it: 'Malformed StorageGeneration')."""
    from gcp_storage_emulator.exceptions import NotFound

    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except NotFound:
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", 1))


class _ConcurrentServer(ThreadingHTTPServer):
    """A thread per request and a deep accept queue: tensorstore writes a checkpoint's files 32 at a
    time, which the emulator's own server (one request at a time, a queue of 5) refuses as
    connection resets."""

    request_queue_size = 256
    daemon_threads = True


def _move(request, response, storage, *args, **kwargs):
    """GCS's objects.move (moveTo), which gcsfs's mv tries first: the emulator lacks it, and gcsfs
    would retry a 501 for half a minute an object before it copies and deletes instead."""
    from gcp_storage_emulator.exceptions import NotFound

    bucket, source, target = (
        request.params[k] for k in ("bucket_name", "object_id", "dest_object_id")
    )
    try:
        obj, data = storage.get_file_obj(bucket, source), storage.get_file(bucket, source)
    except NotFound:
        return _error(response, HTTPStatus.NOT_FOUND, f"No such object: {bucket}/{source}")
    generation = str(time.time_ns())
    moved = dict(obj, name=target, generation=generation, id=f"{bucket}/{target}/{generation}")
    storage.create_file(bucket, target, data, moved)
    storage.delete_file(bucket, source)
    response.json(moved)


def _index_written_whole(storage):
    """The emulator rewrites its whole index (.meta) at each object written, truncating the file
    first, from a thread per request: killed then (a test's network gone), it left an empty index,
    which a restart cannot read. Written to a temporary file renamed over it instead, one writer at
    a time."""
    store, lock = storage._store, threading.Lock()
    write = store.write_bytes

    def write_bytes(rel, content):
        if rel != ".meta":
            return write(rel, content)
        with lock:
            path = store._disk_path(rel)
            temporary = path.with_name(".meta.tmp")
            temporary.write_bytes(content)
            os.replace(temporary, path)

    store.write_bytes = write_bytes


def serve(port, directory=None):
    import http.server

    from gcp_storage_emulator import server

    http.server.HTTPServer = _ConcurrentServer

    emulator = server.create_server(
        "127.0.0.1", port, in_memory=directory is None, data_dir=directory, default_bucket=BUCKET
    )
    storage = emulator._storage
    if directory is not None:
        _index_written_whole(storage)
    # every route through the guard (the router calls handler(request, response, storage))
    move = [
        (
            rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$",
            {"POST": _move},
        )
        for prefix in ("/storage/v1", "")
    ]
    server.HANDLERS = tuple(
        (regex, {m: _guarded(h, storage) for m, h in routes.items()})
        for regex, routes in [*move, *server.HANDLERS]
    )
    emulator.start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
