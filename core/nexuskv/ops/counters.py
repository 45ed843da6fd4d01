"""Plain thread-safe counters the kernel's parts keep for the metrics: read at scrape time, never pushed.

The parts (hierarchy, load path) count what they do in a `Tally` (ints by key under one lock) or a `Buckets`
histogram; `nexuskv.ops.metrics` turns snapshots of them into Prometheus series when it is scraped. Nothing here
knows about Prometheus, so a part's cost is one lock and one dict update per event.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Hashable, Sequence

__all__ = ["Buckets", "Tally"]


class Tally:
    """Counts by key (any hashable, e.g. `("hits", "dram")`), exact under many threads."""

    __slots__ = ("_counts", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Hashable, int] = {}

    def add(self, key: Hashable, n: int = 1) -> None:
        """Add `n` to the count of `key`."""
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    def get(self, key: Hashable) -> int:
        """The count of `key` (0 when never counted)."""
        return self._counts.get(key, 0)

    def snapshot(self) -> dict[Hashable, int]:
        """A copy of every count."""
        with self._lock:
            return dict(self._counts)


class Buckets:
    """A histogram: counts of observations per upper bound (`le`), their sum and count, exact under many threads."""

    __slots__ = ("_counts", "_lock", "_n", "_sum", "bounds")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._n = 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value
            self._n += 1

    def snapshot(self) -> tuple[list[tuple[float, int]], float, int]:
        """(cumulative counts per upper bound, +Inf last; sum; count)."""
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._n
        out, running = [], 0
        for bound, c in zip((*self.bounds, float("inf")), counts, strict=True):
            running += c
            out.append((bound, running))
        return out, total, n
