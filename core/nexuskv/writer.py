"""The bounded asynchronous writer: produced state is stored off the caller's thread, never with unbounded memory.

`submit` takes what fits within the byte and item bounds and reports the rest as refused (backpressure), so a
caller never blocks on storage and memory never grows without bound. One worker thread drains the queue.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from attrs import define

from nexuskv.logs import get_logger

__all__ = ["WriteItem", "Writer"]

log = get_logger(__name__)


@define(frozen=True)
class WriteItem:
    """One payload to store: its size counts against the writer's byte bound while queued."""

    nbytes: int
    payload: Any  # whatever the sink needs (descriptor, payload, priority, ttl)


class Writer:
    """A bounded queue and one worker thread calling `sink(item.payload)` for each item."""

    def __init__(self, sink: Callable[[Any], None], max_bytes: int = 256 << 20, max_items: int = 4096,
                 name: str = "nexuskv-writer") -> None:  # fmt: skip
        self._sink = sink
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._q: collections.deque[WriteItem] = collections.deque()
        self._bytes = 0
        self._cv = threading.Condition()
        self._busy = 0
        self._closed = False
        self.stats = {"accepted": 0, "refused": 0, "written": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[WriteItem]) -> int:
        """Queue as many items (in order) as the bounds allow; return how many were accepted."""
        accepted = 0
        with self._cv:
            if self._closed:
                self.stats["refused"] += len(items)
                return 0
            for it in items:
                if len(self._q) >= self.max_items or self._bytes + it.nbytes > self.max_bytes:
                    break
                self._q.append(it)
                self._bytes += it.nbytes
                accepted += 1
            self.stats["accepted"] += accepted
            self.stats["refused"] += len(items) - accepted
            if accepted:
                self._cv.notify()
        return accepted

    def queued(self) -> tuple[int, int]:
        """(items, bytes) waiting now."""
        with self._cv:
            return len(self._q), self._bytes

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q and self._closed:
                    return
                it = self._q.popleft()
                self._busy += 1
            try:
                self._sink(it.payload)
                self.stats["written"] += 1
            except Exception as exc:  # a failing tier must not kill the writer
                self.stats["failed"] += 1
                log.warning("write failed", error=repr(exc))
            finally:
                with self._cv:
                    self._bytes -= it.nbytes
                    self._busy -= 1
                    self._cv.notify_all()
            time.sleep(0)  # hand the GIL to a planning thread between items

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._q and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout`), then stop the worker."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
