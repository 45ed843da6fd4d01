"""Priority eviction shared by every tier store: which payloads to drop so a new one fits.

A store keeps a heap of `(priority, seq, slot)` (a newer `seq` for a slot makes its older heap entries stale) and
asks `pick_victims` for the lowest-priority, least recently used payloads whose removal makes room, never one above
the incoming payload's priority: all the room or nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["HeapEntry", "pick_victims"]

HeapEntry = tuple[float, int, bytes]
"""(priority, sequence number, slot): lower priority first, older sequence first among equals."""


def pick_victims(
    heap: list[HeapEntry],
    *,
    used: int,
    need: int,
    capacity: int,
    priority: float,
    size_of: Callable[[bytes, int], int | None],
    keep: bytes | None = None,
) -> list[HeapEntry] | None:
    """Pop, lowest first, the heap entries to evict so that `need` more bytes fit in `capacity` (`used` now).

    `size_of(slot, seq)` is the size of the payload an entry stands for, or None when the entry is stale (the slot
    is gone or was touched since); stale entries are dropped from the heap on the way. Entries above `priority` are
    never taken, nor `keep` (the slot being replaced). Returns the victims, popped from the heap (a store that
    keeps them until its write succeeds pushes them back), or None, with the heap as it was, when the room cannot
    be made.
    """
    if used + need <= capacity:
        return []
    popped: list[HeapEntry] = []
    victims: list[HeapEntry] = []
    freed = 0
    while used - freed + need > capacity and heap:
        prio, seq, slot = heap[0]
        size = size_of(slot, seq)
        if size is None:
            heapq.heappop(heap)  # stale
            continue
        if prio > priority:
            break
        popped.append(heapq.heappop(heap))
        if slot != keep:
            victims.append(popped[-1])
            freed += size
    if used - freed + need > capacity:
        for entry in popped:  # not enough room without evicting more valuable state: change nothing
            heapq.heappush(heap, entry)
        return None
    for entry in popped:
        if entry[2] == keep:
            heapq.heappush(heap, entry)
    return victims
