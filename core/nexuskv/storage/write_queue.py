"""The bounded asynchronous writer: produced state is stored off the caller's thread, never with unbounded memory.

`submit` takes what fits within the byte and item bounds and reports the rest as refused (backpressure), so a
caller never blocks on storage and memory never grows without bound. One worker thread drains the queue.

Tenants share it fairly. Each tenant has its own queue; the worker takes one item from each tenant with work in
turn (round robin), so a tenant with a deep backlog delays nobody else's writes; and while several tenants have
work queued, a tenant may hold at most its fair share of the bounds (the bounds divided by the tenants with work,
this one included), so one tenant committing flat out cannot keep the others out. Refusals are counted per
tenant (`by_tenant`) and logged (at most one line per tenant per `log_every_s`, with the count since the last).
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

log = get_logger("nexuskv.writer")  # the component name operators filter on: stable


@define(frozen=True)
class WriteItem:
    """One payload to store: its size counts against the writer's byte bound while queued."""

    nbytes: int
    payload: Any  # whatever the sink needs (descriptor, payload, priority, ttl)


class Writer:
    """Bounded per-tenant queues drained round robin by one worker thread calling `sink(item.payload)`."""

    def __init__(self, sink: Callable[[Any], None], max_bytes: int = 256 << 20, max_items: int = 4096,
                 name: str = "nexuskv-writer", log_every_s: float = 1.0) -> None:  # fmt: skip
        self._sink = sink
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.log_every_s = log_every_s
        self._queues: collections.OrderedDict[str, collections.deque[WriteItem]] = collections.OrderedDict()
        self._tenant_bytes: dict[str, int] = {}
        self._items = 0
        self._bytes = 0
        self._cv = threading.Condition()
        self._busy = 0
        self._closed = False
        self.stats = {"accepted": 0, "refused": 0, "written": 0, "failed": 0}
        self.by_tenant: dict[str, dict[str, int]] = {}  # tenant -> accepted, refused, written, failed
        self._unlogged: dict[str, tuple[int, float]] = {}  # tenant -> (refusals not yet logged, last log time)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _count(self, tenant: str, what: str, n: int = 1) -> None:
        self.stats[what] += n
        per = self.by_tenant.get(tenant)
        if per is None:
            per = self.by_tenant[tenant] = {"accepted": 0, "refused": 0, "written": 0, "failed": 0}
        per[what] += n

    def submit(self, items: Sequence[WriteItem], tenant: str = "") -> int:
        """Queue as many items (in order) as the bounds and `tenant`'s fair share allow; return how many."""
        accepted = 0
        with self._cv:
            if not self._closed:
                q = self._queues.get(tenant)
                active = len(self._queues) + (q is None)  # tenants with work queued, this one included
                cap_items, cap_bytes = self.max_items // active or 1, self.max_bytes // active or 1
                have_items, have_bytes = (len(q) if q is not None else 0), self._tenant_bytes.get(tenant, 0)
                for it in items:
                    if self._items >= self.max_items or self._bytes + it.nbytes > self.max_bytes:
                        break
                    if active > 1 and (have_items + 1 > cap_items or have_bytes + it.nbytes > cap_bytes):
                        break  # over its fair share while others have work queued
                    if q is None:
                        q = self._queues[tenant] = collections.deque()
                    q.append(it)
                    have_items += 1
                    have_bytes += it.nbytes
                    self._items += 1
                    self._bytes += it.nbytes
                    accepted += 1
                self._tenant_bytes[tenant] = have_bytes
            refused = len(items) - accepted
            self._count(tenant, "accepted", accepted)
            if refused:
                self._count(tenant, "refused", refused)
                self._log_refusal(tenant, refused)
            if accepted:
                self._cv.notify()
        return accepted

    def _log_refusal(self, tenant: str, refused: int) -> None:
        """One line per tenant per `log_every_s` at most, with every refusal since the last line (lock held)."""
        pending, last = self._unlogged.get(tenant, (0, 0.0))
        pending += refused
        now = time.monotonic()
        if now - last >= self.log_every_s:
            log.warning("writer refused state (backpressure)", tenant=tenant, refused=pending,
                        refused_total=self.by_tenant[tenant]["refused"], queued_items=self._items,
                        queued_bytes=self._bytes, tenants_queued=len(self._queues))  # fmt: skip
            self._unlogged[tenant] = (0, now)
        else:
            self._unlogged[tenant] = (pending, last)

    def queued(self) -> tuple[int, int]:
        """(items, bytes) waiting now."""
        with self._cv:
            return self._items, self._bytes

    def _next(self) -> tuple[str, WriteItem]:
        """The next item, round robin over tenants with work (lock held, at least one item queued)."""
        tenant, q = next(iter(self._queues.items()))
        it = q.popleft()
        if q:
            self._queues.move_to_end(tenant)
        else:
            del self._queues[tenant]
        self._items -= 1
        return tenant, it

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if not self._items and self._closed:
                    return
                tenant, it = self._next()
                self._busy += 1
            try:
                self._sink(it.payload)
                ok = True
            except Exception as exc:  # a failing tier must not kill the writer
                ok = False
                log.warning("write failed", tenant=tenant, error=repr(exc))
            finally:
                with self._cv:
                    self._count(tenant, "written" if ok else "failed")
                    self._bytes -= it.nbytes
                    self._tenant_bytes[tenant] -= it.nbytes
                    self._busy -= 1
                    self._cv.notify_all()
            time.sleep(0)  # hand the GIL to a planning thread between items

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._items and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (up to `timeout`), then stop the worker."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
