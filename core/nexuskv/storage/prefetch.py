"""Bounded prefetch: move state into a faster tier ahead of the request that will want it.

Tasks are bounded in bytes, in count and per tenant (a share of the byte bound), each has a deadline, can be
cancelled, and is deduplicated: a block already queued for the same target tier is not queued twice, whichever
request asked. Stats and the task table make it observable.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from attrs import define, field

from nexuskv.logs import get_logger

__all__ = ["PrefetchTask", "Prefetcher"]

log = get_logger("nexuskv.prefetch")  # the component name operators filter on: stable


@define
class PrefetchTask:
    """One prefetch: move `slots` (bytes each) from `source` to `target` for `tenant` before `deadline`."""

    task_id: int
    tenant: str
    slots: tuple[bytes, ...]
    source: str
    target: str
    nbytes: int
    deadline: float
    state: str = "queued"  # queued, running, done, failed, expired, cancelled
    moved: int = 0
    error: str = ""
    created: float = field(factory=time.monotonic)
    context: Any = None  # handed to `move` with each slot (the kernel passes the request: place rules see it)


class Prefetcher:
    """Runs `move(slot, source, target, context) -> bool` for queued tasks on one worker thread."""

    def __init__(self, move: Callable[[bytes, str, str, Any], bool], *, max_bytes: int = 512 << 20, max_tasks: int = 64,
                 tenant_share: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._move = move
        self.max_bytes = max_bytes
        self.max_tasks = max_tasks
        self.tenant_share = tenant_share
        self._clock = clock
        self._ids = itertools.count(1)
        self._tasks: dict[int, PrefetchTask] = {}
        self._queue: collections.deque[int] = collections.deque()
        self._pending: set[tuple[bytes, str]] = set()  # (slot, target) queued or running: dedup
        self._bytes = 0
        self._tenant_bytes: dict[str, int] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._active: PrefetchTask | None = None  # the task on the worker now, cancelled or not
        self._proposals: list[tuple[Any, ...]] = []  # spans planners proposed, listed into tasks on this thread
        self._listing = False  # the worker is turning proposals into tasks
        self.stats = {"submitted": 0, "deduplicated": 0, "refused": 0, "done": 0, "failed": 0, "expired": 0,
                      "cancelled": 0, "bytes_moved": 0}  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="nexuskv-prefetch", daemon=True)
        self._thread.start()

    def submit(self, tenant: str, slots: Sequence[bytes], source: str, target: str, block_bytes: int,
               deadline_s: float, context: Any = None) -> PrefetchTask | None:  # fmt: skip
        """Queue a prefetch of the slots not already pending; None when nothing new or the bounds refuse it."""
        with self._cv:
            new = tuple(s for s in dict.fromkeys(slots) if (s, target) not in self._pending)
            self.stats["deduplicated"] += len(slots) - len(new)
            if not new or self._closed:
                return None
            nbytes = len(new) * block_bytes
            tenant_cap = int(self.max_bytes * self.tenant_share)
            if (len(self._queue) >= self.max_tasks or self._bytes + nbytes > self.max_bytes
                    or self._tenant_bytes.get(tenant, 0) + nbytes > tenant_cap):  # fmt: skip
                self.stats["refused"] += 1
                return None
            task = PrefetchTask(next(self._ids), tenant, new, source, target, nbytes, self._clock() + deadline_s,
                                context=context)
            self._tasks[task.task_id] = task
            self._queue.append(task.task_id)
            self._pending.update((s, target) for s in new)
            self._bytes += nbytes
            self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + nbytes
            self.stats["submitted"] += 1
            self._cv.notify()
            return task

    def propose(self, tenant: str, slots: Callable[[], Sequence[bytes]], source: str, target: str,
                block_bytes: int, deadline_s: float, context: Any = None) -> None:  # fmt: skip
        """`submit` later, on the prefetch thread: `slots()` is called there (a planner never lists them)."""
        with self._cv:
            if self._closed:
                return
            self._proposals.append((tenant, slots, source, target, block_bytes, deadline_s, context))
            self._cv.notify()

    def cancel(self, task_id: int) -> bool:
        """Cancel a task; True if it was still live.

        A queued task is released at once (its slots may be asked for again); a running one stops before its
        next slot.
        """
        with self._cv:
            task = self._tasks.get(task_id)
            if task is None or task.state not in ("queued", "running"):
                return False
            if task.state == "queued":
                self._queue.remove(task_id)
                task.state = "cancelled"
                self._release(task)
            else:
                task.state = "cancelled"
            return True

    def _release(self, task: PrefetchTask) -> None:
        """Give back a task's dedup entries and byte budget (lock held)."""
        self.stats[task.state] = self.stats.get(task.state, 0) + 1
        self._pending.difference_update((s, task.target) for s in task.slots)
        self._bytes -= task.nbytes
        self._tenant_bytes[task.tenant] -= task.nbytes
        self._cv.notify_all()

    def _finish(self, task: PrefetchTask, state: str) -> None:
        with self._cv:
            self._active = None
            if task.state in ("queued", "running"):
                task.state = state
            self._release(task)
            if len(self._tasks) > 1024:  # remember recent tasks only: memory stays bounded
                done = [tid for tid, t in self._tasks.items() if t.state not in ("queued", "running")]
                for tid in done[: len(self._tasks) - 1024]:
                    del self._tasks[tid]
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._proposals and not self._closed:
                    self._cv.wait()
                proposals, self._proposals = self._proposals, []
                self._listing = bool(proposals)
            try:
                for tenant, slots, source, target, block_bytes, deadline_s, context in proposals:
                    self.submit(tenant, slots(), source, target, block_bytes, deadline_s, context)
            except Exception as exc:  # a bad proposal must not kill the worker
                log.warning("prefetch proposal failed", error=repr(exc))
            with self._cv:
                self._listing = False
                self._cv.notify_all()
                if not self._queue and not self._closed:
                    continue
                if self._closed and not self._queue:
                    return
                task = self._tasks[self._queue.popleft()]
                if task.state == "queued":
                    task.state = "running"
                self._active = task
            if task.state != "running":
                self._finish(task, task.state)
                continue
            try:
                for slot in task.slots:
                    if task.state != "running":
                        break
                    if self._clock() > task.deadline:
                        task.state = "expired"
                        break
                    if self._move(slot, task.source, task.target, task.context):
                        task.moved += 1
                        self.stats["bytes_moved"] += task.nbytes // len(task.slots)
                    time.sleep(0)  # hand the GIL to a planning thread between moves, never hold it for a burst
            except Exception as exc:
                task.error = repr(exc)
                log.warning("prefetch failed", task=task.task_id, source=task.source, error=task.error)
                self._finish(task, "failed")
                continue
            self._finish(task, "done")

    def tasks(self) -> list[PrefetchTask]:
        """Every task still remembered (most recent last)."""
        with self._cv:
            return list(self._tasks.values())

    def inflight_bytes(self) -> dict[str, int]:
        """Bytes queued or moving per source tier (the planner's contention input)."""
        with self._cv:
            out: dict[str, int] = {}
            for t in self._tasks.values():
                if t.state in ("queued", "running") or t is self._active:
                    out[t.source] = out.get(t.source, 0) + t.nbytes
            return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no task is queued or running."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._queue or self._proposals or self._listing)
                                     and self._active is None, timeout)  # fmt: skip

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what is queued and stop the worker."""
        with self._cv:
            for tid in self._queue:
                self._tasks[tid].state = "cancelled"
                self._release(self._tasks[tid])
            self._queue.clear()
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
