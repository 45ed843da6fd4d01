"""Reuse lost to fallbacks, measured: per fail-open reason, the plans that fell back and the gain they gave up.

A plan that fails open answers `recompute` at once; what it would have saved is not known then (it fell back
before pricing). `LostGain` finds out in hindsight, off the hot path: each fallback's request is handed to one
background thread (a bounded queue: when it is full the fallback is counted but not judged, `unjudged`), which
plans it again through a caller-given function under a generous deadline and adds the gain that plan predicts (0
when it would recompute too) to the fallback's reason class. It is an estimate: the tiers may have changed in the
moments between. The counts are what `nexuskv_fail_open_lost_gain_ms_total` and `/status` report, and what
`bench/load.py` holds against the gain of every plan that reused.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from nexuskv.logs import get_logger

__all__ = ["LostGain"]

log = get_logger("nexuskv.kernel")

_QUEUE = 256
_QUEUED_TOKENS = 1 << 21  # prompts waiting to be judged hold at most this many tokens (~75 MB), whatever their count
_PER_SECOND = 50  # judged at most this often: an outage that makes every plan fall back does not double the work


class LostGain:
    """Judges fallbacks in hindsight on its own thread; thread-safe counts per reason class."""

    def __init__(self, judge: Callable[[Any], float]) -> None:
        """`judge(request)` plans `request` again without recording it and returns its predicted gain in ms."""
        self._judge = judge
        self._lock = threading.Condition()
        self._queue: queue.Queue[tuple[Any, str] | None] = queue.Queue(_QUEUE)
        self._counts: dict[str, list[float]] = {}  # reason -> [fallbacks, judged, lost gain ms]
        self._pending = 0  # queued or being judged
        self._tokens = 0  # tokens of the prompts queued or being judged
        self._allowance = float(_PER_SECOND)  # a token bucket: judgements left now
        self._refilled = time.monotonic()
        self._thread: threading.Thread | None = None
        self._closed = False

    def fell_back(self, request: Any, reason: str, judge: bool = True) -> None:
        """Count a fallback of class `reason` and queue its request to be judged (never blocks, never raises).

        `judge=False` counts it only (a fallback the caller asked for with a deadline of its own is not the kernel's
        loss, and judging it would let a caller make the kernel plan at a budget it never granted). A fallback
        past the rate (50 a second) or the queue's bounds (256 requests, 2 Mi tokens) is counted, not judged.
        """
        size = len(getattr(request, "token_ids", ()))
        with self._lock:
            self._counts.setdefault(reason, [0, 0, 0.0])[0] += 1
            if self._closed or not judge or self._tokens + size > _QUEUED_TOKENS or not self._take():
                return
            if self._thread is None:  # started on the first fallback: a kernel that never falls back has no thread
                thread = threading.Thread(target=self._run, name="nexuskv-lost-gain", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had now (a process at its limit): judged another time
                    return
                self._thread = thread
            try:
                self._queue.put_nowait((request, reason))
            except queue.Full:
                return  # counted, never judged: `unjudged` says how many
            self._pending += 1
            self._tokens += size

    def _take(self) -> bool:
        """One judgement from the token bucket (under the lock)."""
        now = time.monotonic()
        self._allowance = min(float(_PER_SECOND), self._allowance + (now - self._refilled) * _PER_SECOND)
        self._refilled = now
        if self._allowance < 1.0:
            return False
        self._allowance -= 1.0
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            request, reason = item
            try:
                gain = max(0.0, float(self._judge(request)))
            except Exception as exc:  # a request that cannot be planned at all: no gain we can price
                log.debug("lost gain not judged", error=f"{type(exc).__name__}: {exc}")
                gain = None
            with self._lock:
                if gain is not None:
                    row = self._counts[reason]
                    row[1] += 1
                    row[2] += gain
                self._pending -= 1
                self._tokens -= len(getattr(request, "token_ids", ()))
                self._lock.notify_all()

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued fallback is judged (tests and benches); False when `timeout_s` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout_s)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per reason class: `fallbacks`, `judged`, `unjudged` (not judged yet, or dropped) and `lost_gain_ms`."""
        with self._lock:
            return {r: {"fallbacks": int(n), "judged": int(j), "unjudged": int(n - j), "lost_gain_ms": round(g, 3)}
                    for r, (n, j, g) in sorted(self._counts.items())}  # fmt: skip

    def close(self) -> None:
        """Stop judging (what is still queued is dropped); counts stay readable."""
        with self._lock:
            self._closed = True
            thread = self._thread
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._pending -= 1
                    self._tokens -= len(getattr(item[0], "token_ids", ()))
            self._lock.notify_all()
        if thread is not None:
            self._queue.put(None)
            thread.join(5)
