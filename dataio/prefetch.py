"""
The training batches read ahead of the step (Prefetcher): a thread takes them from any of
dataio/dataloader.py's loaders, so that a step waits neither for the host's reads (from a URL, the
network's latency with them) nor for its copies to the devices.
"""

import queue
import threading


class Prefetcher:
    """The training batches, read and put on the devices by a background thread `depth` batches
    ahead of the step, so that the devices never wait for the host's reads and copies. `put` makes a
    device array of one process-local (accum, rows, T) array. Each batch carries the loader's state
    after it: `state` is that of the last batch taken, what a checkpoint saves, so a resume
    continues after it, whatever was read ahead. An error while reading (a bad token id, a data file
    that changed: RunStopped) is raised, itself, by the next() that would have returned its batch;
    the thread prints nothing."""

    def __init__(self, loader, accum, put, depth=2):
        self.loader, self.accum, self.put = loader, accum, put
        self.state = loader.state_dict()
        self._queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="prefetch", daemon=True)
        self._thread.start()

    def _fill(self):
        try:
            while not self._closed.is_set():
                x, y = self.loader.next(self.accum)
                self._offer((self.put(x), self.put(y), self.loader.state_dict()))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._offer(e)

    def _offer(self, item):
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self):
        """(x, y) of the next step, on the devices."""
        item = self._queue.get()
        if isinstance(item, Exception):
            self.close()
            raise item
        x, y, self.state = item
        return x, y

    def close(self):
        self._closed.set()
        self._thread.join()
