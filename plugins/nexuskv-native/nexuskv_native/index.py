"""The native index: `DictIndex`'s answers from a C open-addressing table of 16-byte keys.

The table (`_native.KeyTable`) maps each key to the small-int code of an interned `Holding` and keeps a reverse
list of entries per location; holdings and their codes (`HoldingCodes`, shared with `DictIndex`) and the
per-location counts live here, in Python. Each table call runs under the GIL without releasing it, so it is
atomic for Python threads; writers also hold one lock. Readers take no lock: they read the code-to-holding map
before the table, and a code made or pruned in between shows as a KeyError, after which they read again under
the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

from nexuskv import DeadlinePassed, Holding, HoldingCodes, Layout, Location, Match
from nexuskv_native._native import KeyTable

__all__ = ["NativeIndex", "NativeSnapshot"]


def _scan(table: KeyTable, decode: Mapping[int | None, Holding | None], keys: Sequence[bytes], layout: Layout,
          deadline: float | None) -> Match:  # fmt: skip
    paged_only = not any(g.kind.checkpointed for g in layout.groups)  # a paged prefix stops at its first miss
    if deadline is None:
        codes, distinct, _ = table.lookup(keys, paged_only)
    else:  # the deadline is checked in C every 256 keys, and here before the first
        if time.perf_counter() > deadline:
            raise DeadlinePassed("match")
        codes, distinct, late = table.lookup(keys, paged_only, deadline)
        if late:
            raise DeadlinePassed("match")
    return Match(keys, None, layout, {decode[c] for c in distinct}, codes=codes, decode=decode,
                 distinct_codes=distinct)  # fmt: skip


class NativeSnapshot:
    """A point-in-time copy of a native index (table copied, holdings frozen): reproducible plans."""

    __slots__ = ("_holdings", "_table", "version")

    def __init__(self, table: KeyTable, holdings: dict[int | None, Holding | None], version: int) -> None:
        self._table = table
        self._holdings = holdings
        self.version = version

    def get(self, key: bytes) -> Holding | None:
        """Exact match: the holding of one key."""
        return self._holdings[self._table.get(key)]

    def match(self, keys: Sequence[bytes], layout: Layout) -> Match:
        """Longest-prefix match against the snapshot."""
        return _scan(self._table, self._holdings, keys, layout, None)

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._table.keys())


class NativeIndex:
    """The native matcher: the `Matcher` interface and `DictIndex` semantics over 16-byte block keys."""

    inline = True
    """Bounded C code that honours `match(..., deadline=)`: the kernel calls it inline, not under a watchdog."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table = KeyTable()
        self._codes = HoldingCodes()  # code -> interned holding; `_codes.decode` is what readers read
        self._loc_ids: dict[Location, int] = {}
        self._counts: dict[Location, int] = {}  # blocks held per location
        self.version = 0

    # ------------------------------------------------------------------------------------------ locations

    def _loc(self, location: Location) -> int:
        got = self._loc_ids.get(location)
        if got is None:
            got = self._loc_ids[location] = len(self._loc_ids)
        return got

    def _gain(self, location: Location) -> None:
        self._counts[location] = self._counts.get(location, 0) + 1

    def _lose(self, location: Location) -> None:
        left = self._counts[location] - 1
        if left:
            self._counts[location] = left
        else:  # nothing left there: drop its reverse list too
            del self._counts[location]
            self._table.remap(self._loc_ids[location], {})

    # ------------------------------------------------------------------------------------------ writes

    def insert(self, key: bytes, location: Location, group_mask: int = 1) -> None:
        """Record that `location` holds the groups in `group_mask` for block `key`."""
        if group_mask <= 0:
            raise ValueError(f"group_mask must be positive, got {group_mask}")
        with self._lock:
            cur = self._codes.decode[self._table.get(key)]
            gained = cur is None or not cur.at(location)
            code = self._codes.plus(cur, location, group_mask).code
            self._table.set(key, code, self._loc(location) if gained else -1)
            if gained:
                self._gain(location)
            self.version += 1

    def insert_many(self, keys: Iterable[bytes], location: Location, group_mask: int = 1) -> None:
        """`insert` for many keys at one location (a committed request's blocks); new keys never leave C."""
        if group_mask <= 0:
            raise ValueError(f"group_mask must be positive, got {group_mask}")
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        with self._lock:
            loc = self._loc(location)
            fresh = self._codes.intern(((location, group_mask),)).code  # type: ignore[union-attr]
            added, clash = self._table.add_new(keys, fresh, loc)
            self._counts[location] = self._counts.get(location, 0) + added
            merged: dict[int, tuple[int, bool]] = {}
            done: set[bytes] = set()
            for i, old in clash:
                if keys[i] in done:  # a key listed twice clashes twice: merge it once
                    continue
                done.add(keys[i])
                got = merged.get(old)
                if got is None:
                    held = self._codes.decode[old]
                    got = merged[old] = (self._codes.plus(held, location, group_mask).code, not held.at(location))  # type: ignore[union-attr]
                if got[0] != old:
                    self._table.set(keys[i], got[0], loc if got[1] else -1)
                    if got[1]:
                        self._gain(location)
            self.version += 1

    def remove(self, key: bytes, location: Location | None = None, group_mask: int | None = None) -> bool:
        """Forget groups (all if None) of `key` at `location` (all if None); True if anything was removed."""
        with self._lock:
            cur = self._codes.decode[self._table.get(key)]
            if cur is None:
                return False
            got = self._codes.minus(cur, location, group_mask)
            if got is None:
                return False
            h, lost = got
            if h is None:
                self._table.delete(key)
            else:
                self._table.set(key, h.code)
            for loc in lost:
                self._lose(loc)
            self.version += 1
            return True

    def drop_location(self, location: Location) -> int:
        """Forget everything held at `location`; return how many blocks lost it."""
        with self._lock:
            return self._drop_location(location)

    def _drop_location(self, location: Location) -> int:
        if location not in self._counts:
            return 0
        mapping = {}
        for code, h in list(self._codes.decode.items()):
            if h is not None and h.at(location):
                rest = self._codes.without(h, location)
                mapping[code] = -1 if rest is None else rest.code
        count = self._table.remap(self._loc_ids[location], mapping)
        del self._counts[location]
        self.version += 1
        self._codes.prune(self._table.used_codes())
        return count

    def drop_node(self, node: str, below_epoch: int | None = None) -> int:
        """Forget a node's holdings (only those written before `below_epoch` if given); return blocks affected."""
        with self._lock:
            doomed = [loc for loc in self._counts
                      if loc.node == node and (below_epoch is None or loc.epoch < below_epoch)]  # fmt: skip
            return sum(self._drop_location(loc) for loc in doomed)

    # ------------------------------------------------------------------------------------------ reads

    def get(self, key: bytes) -> Holding | None:
        """Exact match: the holding of one key."""
        decode = self._codes.decode
        try:
            return decode[self._table.get(key)]
        except KeyError:  # a holding made or pruned between the two reads: read again, consistently
            with self._lock:
                return self._codes.decode[self._table.get(key)]

    def match(self, keys: Sequence[bytes], layout: Layout, deadline: float | None = None) -> Match:
        """Longest-prefix match of a request's block keys against the live index.

        With a `deadline` (a `time.perf_counter()` value), `DeadlinePassed` is raised between chunks of keys.
        """
        try:
            return _scan(self._table, self._codes.decode, keys, layout, deadline)
        except KeyError:
            with self._lock:
                return _scan(self._table, self._codes.decode, keys, layout, deadline)

    def holdings(self) -> dict[Location, int]:
        """Blocks held per location."""
        with self._lock:
            return dict(sorted(self._counts.items()))

    def keys_at(self, location: Location) -> frozenset[bytes]:
        """Keys held at one location."""
        with self._lock:
            if location not in self._counts:
                return frozenset()
            codes = {c for c, h in self._codes.decode.items() if h is not None and h.at(location)}
            return frozenset(self._table.keys_at(self._loc_ids[location], codes))

    def snapshot(self) -> NativeSnapshot:
        """A read-only, point-in-time copy with the same `get` / `match`."""
        with self._lock:
            return NativeSnapshot(self._table.copy(), dict(self._codes.decode), self.version)

    def nbytes(self) -> int:
        """Bytes the C table has allocated (entries, index, reverse lists)."""
        return self._table.nbytes()

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and len(key) == 16 and self._table.get(key) is not None
