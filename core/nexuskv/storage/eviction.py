"""Priority eviction shared by every tier store: which payloads to drop so a new one fits.

A store keeps a heap of `(priority, seq, slot)` (a newer `seq` for a slot makes its older heap entries stale) and
asks `pick_victims` for the lowest-priority, least recently used payloads whose removal makes room, never one above
the incoming payload's priority: all the room or nothing.

Whatever the priorities say, a store never drops a paged block (dense, latent) while it keeps a block that
continues it: a block without its prefix restores nothing. A store's `Lineage` knows the parent links of what it
holds; `pick_victims` takes only blocks none of whose children stay, and never the parent of the incoming block
(the incoming block is refused instead, and the writer tries the next tier down).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

from nexuskv.contracts import StateDescriptor

__all__ = ["Frequency", "HeapEntry", "Lineage", "parent_slot", "pick_victims", "refreshed_priority"]

HeapEntry = tuple[float, int, bytes]
"""(priority, sequence number, slot): lower priority first, older sequence first among equals."""


def parent_slot(slot: bytes, descriptor: StateDescriptor) -> bytes | None:
    """The slot of the block a paged payload continues (same group); None for a first block or a checkpoint."""
    if descriptor.parent_key is None:
        return None
    groups = descriptor.layout.groups
    if 0 <= descriptor.group < len(groups) and groups[descriptor.group].kind.checkpointed:
        return None  # a checkpoint restores on its own: it needs no earlier block
    return bytes.fromhex(descriptor.parent_key) + slot[-1:]


class Lineage:
    """Which held payloads continue which: a store's parent links, pruned lazily against what it still holds.

    `add` is called for every payload a store takes in; removals need no call, because `has_children` asks the
    store (`held(slot)`) and forgets children it no longer holds. Not thread-safe: use it under the store's lock.
    """

    def __init__(self, held: Callable[[bytes], bool]) -> None:
        self._held = held
        self._kids: dict[bytes, set[bytes]] = {}

    def add(self, slot: bytes, descriptor: StateDescriptor) -> None:
        """Record that `slot` (now held) continues its parent block."""
        parent = parent_slot(slot, descriptor)
        if parent is not None:
            self._kids.setdefault(parent, set()).add(slot)

    def has_children(self, slot: bytes, gone: Collection[bytes] = ()) -> bool:
        """True while the store holds a block that continues `slot` (other than those in `gone`)."""
        kids = self._kids.get(slot)
        if not kids:
            return False
        live = {k for k in kids if self._held(k)}
        if len(live) != len(kids):
            if live:
                self._kids[slot] = live
            else:
                del self._kids[slot]
        return any(k not in gone for k in live)

    def clear(self) -> None:
        """Forget every link (the store dropped everything)."""
        self._kids.clear()


def pick_victims(
    heap: list[HeapEntry],
    *,
    used: int,
    need: int,
    capacity: int,
    priority: float,
    size_of: Callable[[bytes, int], int | None],
    keep: bytes | None = None,
    lineage: Lineage | None = None,
    protect: bytes | None = None,
) -> list[HeapEntry] | None:
    """Pop, lowest first, the heap entries to evict so that `need` more bytes fit in `capacity` (`used` now).

    `size_of(slot, seq)` is the size of the payload an entry stands for, or None when the entry is stale (the slot
    is gone or was touched since); stale entries are dropped from the heap on the way. Entries above `priority` are
    never taken, nor `keep` (the slot being replaced), nor, with a `lineage`, a block that a held block continues
    (it becomes a candidate once its children are victims) or `protect` (the incoming block's parent). Returns the
    victims, popped from the heap (a store that keeps them until its write succeeds pushes them back), or None,
    with the heap as it was, when the room cannot be made.
    """
    if used + need <= capacity:
        return []
    victims: list[HeapEntry] = []
    gone: set[bytes] = set()
    held_back: list[HeapEntry] = []  # popped but not taken: pushed back at the end
    freed = 0
    while used - freed + need > capacity and heap:
        prio, seq, slot = heap[0]
        size = size_of(slot, seq)
        if size is None:
            heapq.heappop(heap)  # stale
            continue
        if prio > priority:
            break
        entry = heapq.heappop(heap)
        if slot == keep or (lineage is not None and (slot == protect or lineage.has_children(slot, gone))):
            held_back.append(entry)
            continue
        victims.append(entry)
        gone.add(slot)
        freed += size
        if lineage is not None and held_back:  # its parent may be a leaf now: look at the held-back ones again
            for e in held_back:
                if e[2] != keep:
                    heapq.heappush(heap, e)
            held_back = [e for e in held_back if e[2] == keep]
    for entry in held_back:
        heapq.heappush(heap, entry)
    if used - freed + need > capacity:
        for entry in victims:  # not enough room without evicting more valuable state: change nothing
            heapq.heappush(heap, entry)
        return None
    return victims


class Frequency:
    """GreedyDual-Size-Frequency bookkeeping for a store: reads lift a payload's priority.

    A payload put with a `value` (what the kernel's default priority adds above the aging floor: the recompute
    time it saves per byte) is stored at `floor + value * probation` the first time it is seen (S3-FIFO's small
    queue: a block asked for once goes before any block asked for twice), and every read lifts it to
    `floor + value * (1 + reads)`: state read often outlives state read once. The floor (the priority of the
    most valuable payload evicted so far) makes recent state outlive old state. Evicted payloads leave their read
    count in a bounded history (ARC's and TinyLFU's ghost entries): put again after an eviction (it was asked for
    again), a payload comes back with its past reads plus one. A put again while held keeps its reads and is
    re-priced against today's floor. A payload put with an explicit priority (no value: a `place` rule's, or
    LRU mode's 0) keeps exactly that priority, reads or not.

    Two steps per put, so a refused put changes nothing: `admit` prices it, `record` (after the store made
    room) keeps the bookkeeping. Not thread-safe: use it under the store's lock, like `Lineage`.
    """

    def __init__(self, history: int = 4, probation: float = 0.3) -> None:
        if history < 0 or not 0.0 <= probation <= 1.0:
            raise ValueError(f"history must be >= 0 and probation in [0, 1], got {history}, {probation}")
        self._held: dict[bytes, tuple[float, int]] = {}  # slot -> (value, reads)
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # evicted slot -> reads, oldest first
        self._history = history  # the ghost holds up to `history` times as many entries as are held
        self.probation = probation

    def admit(self, slot: bytes, floor: float, priority: float, value: float | None = None) -> tuple[float, Any]:
        """(priority to store the payload with, bookkeeping to `record` once it is stored)."""
        if value is None or value <= 0.0:  # stored as given: its past reads no longer describe it
            return priority, (0.0, 0, slot in self._ghost)
        held = self._held.get(slot)
        reads = held[1] if held is not None else self._ghost.get(slot, -1) + 1
        prio = floor + value * self.probation if reads == 0 else refreshed_priority(floor, value, reads)
        return prio, (value, reads, held is None and slot in self._ghost)

    def record(self, slot: bytes, entry: Any) -> None:
        """The payload `admit` priced is stored now."""
        value, reads, from_ghost = entry
        if from_ghost:  # the evictions that made room may have pushed it out of the history already
            self._ghost.pop(slot, None)
        self._held[slot] = (value, reads)

    def hit(self, slot: bytes, priority: float, floor: float) -> float:
        """The priority of a held payload just read."""
        value, reads = self._held.get(slot, (0.0, 0))
        if value <= 0.0:
            return priority
        self._held[slot] = (value, reads + 1)
        return refreshed_priority(floor, value, reads + 1)

    def evicted(self, slot: bytes) -> None:
        """A payload was evicted: remember its reads for a while."""
        held = self._held.pop(slot, None)
        if held is not None and held[0] > 0.0 and self._history:
            self._ghost[slot] = held[1]
            self._ghost.move_to_end(slot)
            while len(self._ghost) > self._history * max(64, len(self._held)):
                self._ghost.popitem(last=False)

    def forget(self, slot: bytes) -> None:
        """A payload was deleted or expired: no history (it was not pushed out by better state)."""
        self._held.pop(slot, None)

    def clear(self) -> None:
        """Forget everything."""
        self._held.clear()
        self._ghost.clear()


def refreshed_priority(floor: float, value: float, hits: int) -> float:
    """GreedyDual-Size-Frequency priority of a payload read again: `floor + value * (1 + hits)`.

    `value` is what the kernel's default priority puts above the store's aging floor (the gain per byte of
    keeping the payload); `hits` counts its reads. A payload read often outlives one read once; the floor (the
    priority of the most valuable payload evicted so far) makes recent state outlive old state.
    """
    return floor + value * (1 + hits)
