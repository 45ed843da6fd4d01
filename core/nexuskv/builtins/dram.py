"""Builtin DRAM tier store: payloads in process memory, bounded in bytes, evicting lowest priority first."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Iterator

from nexuskv import (
    EvictionCallback,
    Frequency,
    Lineage,
    StateDescriptor,
    StoredState,
    hookimpl,
    parent_slot,
    pick_victims,
)

__all__ = ["DramStore"]


class DramStore:
    """An in-process tier store with a byte capacity.

    Eviction order: lowest `priority` first, least recently used among equals. `get` returns a read-only
    memoryview over the stored bytes (no copy). Thread-safe. Payloads are not re-verified on read: the
    loader checks the descriptor checksum wherever a payload is restored. A payload put with `ttl_s` is dropped
    (and reported like an eviction) when it is next read after it expired.
    """

    def __init__(self, capacity_bytes: int = 1 << 30, name: str = "dram") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self._items: dict[bytes, tuple[bytes, StateDescriptor, float, int]] = {}
        self._freq = Frequency()  # reads lift default priorities (GreedyDual-Size-Frequency)
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count()
        self._used = 0
        self._lock = threading.RLock()
        self._on_evict: EvictionCallback | None = None
        self.evictions = 0
        self.floor = 0.0  # priority of the most valuable payload evicted so far (GreedyDual's L)
        self._expires: dict[bytes, float] = {}  # slot -> monotonic deadline, only for payloads put with a TTL
        self._lineage = Lineage(self.__contains__)  # a prefix is never dropped while its continuation stays

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Be told (slot, descriptor, payload) about every eviction."""
        self._on_evict = callback

    counts_reads = True  # the hierarchy passes the default priority's `value`: reads lift it (`Frequency`)

    def put(self, slot: bytes, payload: bytes | memoryview, descriptor: StateDescriptor, priority: float = 0.0,
            ttl_s: float | None = None, value: float | None = None) -> bool:  # fmt: skip
        """Store a copy of `payload`; evict lower-priority payloads to make room. False if it cannot fit.

        With `value` (the kernel's default priority above the aging floor) the priority is `floor + value`
        priced by `Frequency` against this store's floor now; without, `priority` is kept as given.
        """
        data = bytes(payload)
        evicted: list[tuple[bytes, StateDescriptor, bytes]] = []
        with self._lock:
            old = self._items.pop(slot, None)
            if old is not None:
                self._used -= len(old[0])
            priority, entry = self._freq.admit(slot, self.floor, priority, value)
            room = len(data) <= self.capacity_bytes and self._make_room(len(data), priority, evicted,
                                                                        parent_slot(slot, descriptor))
            if not room:
                if old is not None:  # keep what was there rather than lose both, with a fresh heap entry (the
                    seq = next(self._seq)  # old one may have been dropped as stale while room was sought)
                    self._items[slot] = (old[0], old[1], old[2], seq)
                    self._used += len(old[0])
                    heapq.heappush(self._heap, (old[2], seq, slot))
                ok = False
            else:
                seq = next(self._seq)
                self._items[slot] = (data, descriptor, priority, seq)
                self._freq.record(slot, entry)
                heapq.heappush(self._heap, (priority, seq, slot))
                self._lineage.add(slot, descriptor)
                self._used += len(data)
                if ttl_s is not None:
                    self._expires[slot] = time.monotonic() + ttl_s
                else:
                    self._expires.pop(slot, None)
                ok = True
        self._notify(evicted)
        return ok

    def _make_room(self, need: int, priority: float, evicted: list[tuple[bytes, StateDescriptor, bytes]],
                   protect: bytes | None = None) -> bool:  # fmt: skip
        """Evict lowest-priority payloads (never above `priority`, leaves first) until `need` bytes fit, or nothing."""

        def size_of(slot: bytes, seq: int) -> int | None:
            item = self._items.get(slot)
            return len(item[0]) if item is not None and item[3] == seq else None

        victims = pick_victims(self._heap, used=self._used, need=need, capacity=self.capacity_bytes,
                               priority=priority, size_of=size_of, lineage=self._lineage, protect=protect)  # fmt: skip
        if victims is None:
            return False
        for prio, _, slot in victims:
            self.floor = max(self.floor, prio)  # GreedyDual aging: new state starts above what was evicted
            item = self._items.pop(slot)
            self._freq.evicted(slot)
            self._expires.pop(slot, None)
            self._used -= len(item[0])
            self.evictions += 1
            evicted.append((slot, item[1], item[0]))
        return True

    def _notify(self, evicted: list[tuple[bytes, StateDescriptor, bytes | None]]) -> None:
        cb = self._on_evict
        if cb is not None:
            for slot, desc, data in evicted:
                cb(slot, desc, data)

    def get(self, slot: bytes) -> StoredState | None:
        """The payload (a read-only memoryview) and descriptor of `slot`, or None."""
        expired = None
        with self._lock:
            item = self._items.get(slot)
            if item is not None and self._expires and self._expires.get(slot, float("inf")) <= time.monotonic():
                self._items.pop(slot)
                self._freq.forget(slot)
                self._expires.pop(slot)
                self._used -= len(item[0])
                expired, item = item, None
            if item is not None:
                data, desc, prio, _ = item
                prio = self._freq.hit(slot, prio, self.floor)
                seq = next(self._seq)
                self._items[slot] = (data, desc, prio, seq)
                heapq.heappush(self._heap, (prio, seq, slot))
                if len(self._heap) > 2 * len(self._items) + 64:
                    self._compact()
        if item is None:
            if expired is not None:  # outside the lock: the callback updates the kernel's index
                self._notify([(slot, expired[1], None)])
            return None
        return StoredState(memoryview(data), desc)

    def _compact(self) -> None:
        self._heap = [(p, s, k) for k, (_, _, p, s) in self._items.items()]
        heapq.heapify(self._heap)

    def delete(self, slot: bytes) -> bool:
        """Drop a payload; True if it was held. Deletion is not an eviction: no callback."""
        with self._lock:
            item = self._items.pop(slot, None)
            if item is None:
                return False
            self._freq.forget(slot)
            self._expires.pop(slot, None)
            self._used -= len(item[0])
            return True

    def __contains__(self, slot: object) -> bool:
        return slot in self._items

    def slots(self) -> Iterator[bytes]:
        """Every slot held (a snapshot)."""
        with self._lock:
            return iter(list(self._items))

    def used_bytes(self) -> int:
        """Bytes held now."""
        return self._used

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """Drop everything (no eviction callbacks)."""
        with self._lock:
            self._items.clear()
            self._freq.clear()
            self._expires.clear()
            self._heap.clear()
            self._lineage.clear()
            self._used = 0


@hookimpl
def nexuskv_register_tier_stores(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the DRAM tier as `dram`."""
    register("dram", DramStore)
