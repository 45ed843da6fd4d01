"""A complete minimal NexusKV tier store: one file per payload under a directory, bounded in bytes.

A file holds one JSON line (descriptor, priority, expiry) and then the payload; it is written under a temporary
name and renamed into place, so a reader opens a whole file or none. The JSON lines are read back when the store
starts, which makes it a `PersistentTierStore`: a kernel re-indexes what an earlier process left. One process per
directory; writes happen under the store's lock (simple, not fast: `nexuskv-tier-disk` writes behind).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from nexuskv import (
    EvictionCallback,
    Lineage,
    StateDescriptor,
    StoredState,
    from_dict,
    hookimpl,
    parent_slot,
    pick_victims,
    to_dict,
)

__all__ = ["ExampleStore"]

_Item = tuple[StateDescriptor, int, float, float | None, int]  # descriptor, size, priority, expires (epoch s), seq
_Dropped = tuple[bytes, StateDescriptor, bytes | None]  # what the eviction callback is told


class ExampleStore:
    """Payloads in `<path>/<slot hex>.kv`; evicts the lowest priority first, least recently used among equals."""

    def __init__(self, path: str, name: str = "example", capacity_bytes: int = 1 << 30) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.name, self.capacity_bytes, self.root = name, int(capacity_bytes), Path(path)
        self.floor = 0.0  # the priority of the most valuable payload evicted so far (the kernel's aging reads it)
        self._lock = threading.Lock()  # the kernel calls a store from many threads at once
        self._on_evict: EvictionCallback | None = None
        self._items: dict[bytes, _Item] = {}
        self._heap: list[tuple[float, int, bytes]] = []  # (priority, seq, slot); entries of older seqs are stale
        self._seq = itertools.count()
        self._used = 0
        self._lineage = Lineage(self.__contains__)  # never evict a block while a block continuing it stays
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.root.glob("*.tmp"):  # a write an earlier process did not finish
            tmp.unlink()
        for file in self.root.glob("*.kv"):  # what it left: every whole, unexpired file
            try:
                with file.open("rb") as f:
                    head = json.loads(f.readline())
                    size = os.fstat(f.fileno()).st_size - f.tell()
                if head["expires"] is None or head["expires"] > time.time():
                    desc = from_dict(StateDescriptor, head["descriptor"])
                    self._add(bytes.fromhex(file.stem), desc, size, head["priority"], head["expires"])
                    continue
            except (OSError, ValueError, KeyError, TypeError):
                pass  # torn by a crash (a torn payload is caught anyway: the kernel verifies every checksum)
            file.unlink(missing_ok=True)

    def _file(self, slot: bytes) -> Path:
        return self.root / f"{slot.hex()}.kv"

    def _add(self, slot: bytes, desc: StateDescriptor, size: int, priority: float, expires: float | None) -> None:
        seq = next(self._seq)
        self._items[slot] = (desc, size, priority, expires, seq)
        heapq.heappush(self._heap, (priority, seq, slot))
        self._lineage.add(slot, desc)
        self._used += size

    def _drop(self, slot: bytes, read: bool = False) -> _Dropped:
        desc, size, *_ = self._items.pop(slot)
        self._used -= size
        data = None
        with contextlib.suppress(OSError):  # OSError: already gone
            if read:  # an evicted payload goes to the callback, so the kernel can demote it to a lower tier
                data = self._file(slot).read_bytes().split(b"\n", 1)[1]
            self._file(slot).unlink()
        return slot, desc, data

    def _notify(self, dropped: list[_Dropped]) -> None:
        callback = self._on_evict
        for slot, desc, data in dropped if callback is not None else ():
            callback(slot, desc, data)  # outside the lock: the kernel updates its index (and may put elsewhere)

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Be told (slot, descriptor, payload or None) about every payload this store drops on its own."""
        self._on_evict = callback

    def put(self, slot: bytes, payload: bytes | memoryview, descriptor: StateDescriptor, priority: float = 0.0,
            ttl_s: float | None = None) -> bool:  # fmt: skip
        """Write a payload, evicting lower-priority ones first; False (nothing changed) when it cannot fit."""
        size = memoryview(payload).nbytes
        if size > self.capacity_bytes:
            return False
        expires = None if ttl_s is None else time.time() + ttl_s
        head = json.dumps({"descriptor": to_dict(descriptor), "priority": priority, "expires": expires})
        with self._lock:
            old = self._items.get(slot)
            used = self._used - (old[1] if old else 0)
            victims = pick_victims(self._heap, used=used, need=size, capacity=self.capacity_bytes, priority=priority,
                                   size_of=self._size_of, keep=slot, lineage=self._lineage,
                                   protect=parent_slot(slot, descriptor))  # fmt: skip
            if victims is None:
                return False
            tmp = self._file(slot).with_suffix(".tmp")
            try:
                with tmp.open("wb") as f:
                    f.write(head.encode() + b"\n")
                    f.write(payload)
                os.replace(tmp, self._file(slot))
            except OSError:  # a failing disk raises: the kernel counts it against this tier's breaker
                tmp.unlink(missing_ok=True)
                for victim in victims:
                    heapq.heappush(self._heap, victim)
                raise
            self.floor = max([self.floor, *(p for p, _, _ in victims)])
            dropped = [self._drop(victim, read=True) for _, _, victim in victims]
            if old is not None:
                self._used -= old[1]
            self._add(slot, descriptor, size, priority, expires)
        self._notify(dropped)
        return True

    def _size_of(self, slot: bytes, seq: int) -> int | None:
        item = self._items.get(slot)
        return item[1] if item is not None and item[4] == seq else None

    def get(self, slot: bytes) -> StoredState | None:
        """The payload and descriptor of `slot`, or None (a miss; an expired or vanished payload is reported)."""
        f = None
        with self._lock:
            item = self._items.get(slot)
            if item is None:
                return None
            desc, size, priority, expires, _ = item
            if expires is None or expires > time.time():
                with contextlib.suppress(FileNotFoundError):  # deleted behind the store's back: a miss
                    f = self._file(slot).open("rb")  # under the lock: this entry's own file, even if replaced next
            if f is None:
                gone = [self._drop(slot)]
            else:  # a read makes it the most recently used among equals
                seq = next(self._seq)
                self._items[slot] = (desc, size, priority, expires, seq)
                heapq.heappush(self._heap, (priority, seq, slot))
                if len(self._heap) > 2 * len(self._items) + 64:  # drop stale heap entries now and then
                    self._heap = [(p, s, k) for k, (_, _, p, _, s) in self._items.items()]
                    heapq.heapify(self._heap)
        if f is None:
            self._notify(gone)
            return None
        with f:
            f.readline()
            return StoredState(f.read(), desc)

    def delete(self, slot: bytes) -> bool:
        """Drop a payload; True if it was held. Not an eviction: no callback."""
        with self._lock:
            if slot not in self._items:
                return False
            self._drop(slot)
            return True

    def __contains__(self, slot: object) -> bool:
        return slot in self._items

    def slots(self) -> Iterator[bytes]:
        """Every slot held (a snapshot)."""
        with self._lock:
            return iter(list(self._items))

    def used_bytes(self) -> int:
        """Payload bytes held now."""
        return self._used

    def descriptors(self) -> Iterator[tuple[bytes, StateDescriptor]]:
        """(slot, descriptor) of every payload held, from memory: no file is read."""
        with self._lock:
            return iter([(slot, item[0]) for slot, item in self._items.items()])

    def close(self) -> None:
        """Forget the in-memory index; the files stay for the next process (no callbacks)."""
        with self._lock:
            self._items.clear()
            self._heap.clear()
            self._lineage.clear()
            self._used = 0


@hookimpl
def nexuskv_register_tier_stores(register: Callable[..., None]) -> None:
    """Offer the store to kernel configs as `store = "example"`."""
    register("example", ExampleStore)
