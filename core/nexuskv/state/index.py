"""The builtin pure-Python state index: which blocks are held where, and the longest restorable match.

Keys map to the small-int code of an interned `Holding` (the locations and state groups held for a block), so a
block costs a key, a dict slot and a reverse-map slot, and many blocks share one `Holding`. Holding only bytes
and ints, the big dicts are never tracked by the garbage collector: a full collection does not walk a million
entries in the middle of a plan. Any matcher plugin offers the same
interface (`Matcher`), and `Match` turns its per-block answers into restore points per kind, tier and node.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from nexuskv.contracts import Layout
from nexuskv.errors import DeadlinePassed, check_deadline
from nexuskv.state.holding import Holding, HoldingCodes, Location
from nexuskv.state.restore_points import group_masks, longest_restore_point

__all__ = ["DictIndex", "Holding", "HoldingCodes", "IndexSnapshot", "Location", "Match", "Matcher", "match_within"]


class Match:
    """The answer of an index to one request's keys: per-block holdings, and restore points computed lazily."""

    __slots__ = ("_entries", "codes", "decode", "distinct", "distinct_codes", "keys", "layout")

    def __init__(
        self,
        keys: Sequence[bytes],
        entries: list[Holding | None] | None,
        layout: Layout,
        distinct: set[Holding | None] | None = None,
        *,
        codes: list[int | None] | None = None,
        decode: Mapping[int | None, Holding | None] | None = None,
        distinct_codes: set[int | None] | None = None,
    ) -> None:
        """Wrap a matcher's answer.

        `entries[i]` is block i's holding for the scanned prefix (None: not held anywhere). A matcher that keeps
        holdings by code may pass `codes` and `decode` instead; entries are then decoded on first use.
        """
        self.keys = keys
        self._entries = entries
        self.codes = codes
        self.decode = decode
        self.distinct_codes = distinct_codes if distinct_codes is not None or codes is None else set(codes)
        self.layout = layout
        if distinct is None:
            distinct = set(self.entries)
        self.distinct = distinct  # few: holdings are interned

    @property
    def entries(self) -> list[Holding | None]:
        """Per-block holdings of the scanned prefix."""
        if self._entries is None:
            self._entries = list(map(self.decode.__getitem__, self.codes))  # type: ignore[union-attr, arg-type]
        return self._entries

    def masks(self, tier: str | None = None, node: str | None = None) -> list[int]:
        """Per-block group masks held at `tier` / `node` (None matches any)."""
        return [0 if h is None else h.mask_at(tier, node) for h in self.entries]

    def longest(self, tier: str | None = None, node: str | None = None) -> int:
        """Longest valid restore point, in blocks, using only state held at `tier` / `node`."""
        paged, ckpt = group_masks(self.layout.groups)
        if ckpt:
            return longest_restore_point(self.layout, self.masks(tier, node))
        # Paged groups only: the first block that misses a group ends the prefix. Few distinct holdings
        # exist, so test each once and find the first bad one with list.index (C speed), on the codes when
        # the index gave codes (no decoding).
        if self.codes is not None and self.decode is not None:
            seq: list[object] = self.codes  # type: ignore[assignment]
            decode = self.decode
            bad = [c for c in self.distinct_codes if (h := decode[c]) is None or h.mask_at(tier, node) & paged != paged]
        else:
            seq = self.entries  # type: ignore[assignment]
            bad = [h for h in self.distinct if h is None or h.mask_at(tier, node) & paged != paged]
        end = len(seq)
        for b in bad:
            end = min(end, seq.index(b))
        return end

    def tokens(self, tier: str | None = None, node: str | None = None) -> int:
        """Longest valid restore point in tokens."""
        return self.longest(tier, node) * self.layout.page_size

    def by_tier(self) -> dict[str, int]:
        """Longest restore point (blocks) per tier holding any block of the match."""
        tiers = sorted({t for h in self.distinct if h is not None for t in h.tiers()})
        return {t: self.longest(tier=t) for t in tiers}

    def by_node(self) -> dict[str, int]:
        """Longest restore point (blocks) per node holding any block of the match."""
        nodes = sorted({loc.node for h in self.distinct if h is not None for loc, _ in h.locations})
        return {n: self.longest(node=n) for n in nodes}


@runtime_checkable
class Matcher(Protocol):
    """What a matcher plugin provides: the state index and longest-prefix matching over block keys."""

    def insert(self, key: bytes, location: Location, group_mask: int = 1) -> None:
        """Record that `location` holds the groups in `group_mask` for block `key`."""

    def insert_many(self, keys: Iterable[bytes], location: Location, group_mask: int = 1) -> None:
        """`insert` for many keys at one location."""

    def remove(self, key: bytes, location: Location | None = None, group_mask: int | None = None) -> bool:
        """Forget groups (all if None) of `key` at `location` (all if None); True if anything was removed."""

    def drop_location(self, location: Location) -> int:
        """Forget everything held at `location`; return how many blocks lost it."""

    def drop_node(self, node: str, below_epoch: int | None = None) -> int:
        """Forget a node's holdings (only those older than `below_epoch` if given); return blocks affected."""

    def get(self, key: bytes) -> Holding | None:
        """Exact match: the holding of one key."""

    def match(self, keys: Sequence[bytes], layout: Layout) -> Match:
        """Longest-prefix match of a request's block keys."""

    def holdings(self) -> Mapping[Location, int]:
        """Blocks held per location."""

    def snapshot(self) -> IndexSnapshot:
        """A read-only, point-in-time view with the same `get` / `match`."""

    def __len__(self) -> int:
        """Number of indexed blocks."""


_MATCH_CHUNK = 256  # keys looked up between two deadline checks (about 25 us on a cold 10^6-block index)


def _scan(get: object, decode: Mapping[int | None, Holding | None], keys: Sequence[bytes], layout: Layout,
          deadline: float | None = None) -> Match:  # fmt: skip
    paged_only = not group_masks(layout.groups)[1]
    if deadline is None:
        codes = list(map(get, keys))  # type: ignore[call-overload]
    else:
        codes = []
        for i in range(0, len(keys), _MATCH_CHUNK):
            check_deadline(deadline, "match")
            part = list(map(get, keys[i : i + _MATCH_CHUNK]))  # type: ignore[call-overload]
            codes.extend(part)
            if paged_only and None in part:
                break  # a paged prefix cannot skip a block: the rest cannot be restored
    distinct = set(codes)
    if None in distinct and paged_only:
        del codes[codes.index(None) :]  # a paged prefix cannot skip a block: stop at the first miss
        distinct = set(codes)
    return Match(keys, None, layout, {decode[c] for c in distinct}, codes=codes, decode=decode,
                 distinct_codes=distinct)


class IndexSnapshot:
    """A point-in-time copy of an index: plans made against it are reproducible."""

    __slots__ = ("_holdings", "_map", "version")

    def __init__(self, mapping: dict[bytes, int], holdings: dict[int | None, Holding | None], version: int) -> None:
        self._map = MappingProxyType(mapping)
        self._holdings = holdings
        self.version = version

    def get(self, key: bytes) -> Holding | None:
        """Exact match: the holding of one key."""
        return self._holdings[self._map.get(key)]

    def match(self, keys: Sequence[bytes], layout: Layout) -> Match:
        """Longest-prefix match against the snapshot."""
        return _scan(self._map.get, self._holdings, keys, layout)

    def __len__(self) -> int:
        return len(self._map)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._map)


class DictIndex:
    """The builtin matcher: key -> code of an interned `Holding`, plus a reverse map per location.

    Safe to share between threads: every change holds one lock (writer, prefetch, tier I/O and loader threads
    all insert and remove), and readers (`get`, `match`) take no lock on the hot path. A reader that meets a
    holding pruned by `drop_location` in the meantime reads again under the lock.
    """

    inline = True
    """Bounded and honours `match(..., deadline=)`: the kernel calls it inline, not under a watchdog thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._map: dict[bytes, int] = {}  # bytes -> int only: the GC never tracks it
        self._codes = HoldingCodes()  # code -> interned holding; `_codes.decode` is what readers read
        self._by_loc: dict[Location, dict[bytes, None]] = {}  # dicts of bytes -> None: untracked, like _map
        self.version = 0

    def insert(self, key: bytes, location: Location, group_mask: int = 1) -> None:
        """Record that `location` holds the groups in `group_mask` for block `key`."""
        if group_mask <= 0:
            raise ValueError(f"group_mask must be positive, got {group_mask}")
        with self._lock:
            self._insert(key, location, group_mask)

    def _insert(self, key: bytes, location: Location, group_mask: int) -> None:
        cur = self._codes.decode[self._map.get(key)]
        if cur is None:
            locs: dict[Location, int] = {location: group_mask}
        else:
            locs = dict(cur.locations)
            locs[location] = locs.get(location, 0) | group_mask
        self._map[key] = self._codes.intern(locs.items()).code  # type: ignore[union-attr]
        self._by_loc.setdefault(location, {})[key] = None
        self.version += 1

    def insert_many(self, keys: Iterable[bytes], location: Location, group_mask: int = 1) -> None:
        """`insert` for many keys at one location (a committed request's blocks); fast for new keys."""
        if group_mask <= 0:
            raise ValueError(f"group_mask must be positive, got {group_mask}")
        with self._lock:
            self._insert_many(keys, location, group_mask)

    def _insert_many(self, keys: Iterable[bytes], location: Location, group_mask: int) -> None:
        fresh = self._codes.intern(((location, group_mask),))
        code = fresh.code  # type: ignore[union-attr]
        held = self._by_loc.setdefault(location, {})
        m = self._map
        for key in keys:
            cur = m.get(key)
            if cur is None:
                m[key] = code
            elif cur != code:
                locs = dict(self._codes.decode[cur].locations)  # type: ignore[union-attr]
                locs[location] = locs.get(location, 0) | group_mask
                m[key] = self._codes.intern(locs.items()).code  # type: ignore[union-attr]
            held[key] = None
        self.version += 1

    def remove(self, key: bytes, location: Location | None = None, group_mask: int | None = None) -> bool:
        """Forget groups (all if None) of `key` at `location` (all if None); True if anything was removed."""
        with self._lock:
            return self._remove(key, location, group_mask)

    def _remove(self, key: bytes, location: Location | None, group_mask: int | None) -> bool:
        cur = self._codes.decode[self._map.get(key)]
        if cur is None:
            return False
        locs = dict(cur.locations)
        targets = list(locs) if location is None else [location]
        changed = False
        for loc in targets:
            had = locs.get(loc, 0)
            if not had:
                continue
            left = 0 if group_mask is None else had & ~group_mask
            if left == had:
                continue
            changed = True
            locs[loc] = left
            if not left:
                keys = self._by_loc.get(loc)
                if keys is not None:
                    keys.pop(key, None)
                    if not keys:
                        del self._by_loc[loc]
        if not changed:
            return False
        h = self._codes.intern(locs.items())
        if h is None:
            del self._map[key]
        else:
            self._map[key] = h.code
        self.version += 1
        return True

    def drop_location(self, location: Location) -> int:
        """Forget everything held at `location`; return how many blocks lost it."""
        with self._lock:
            return self._drop_location(location)

    def _drop_location(self, location: Location) -> int:
        keys = self._by_loc.pop(location, {})
        for key in keys:
            cur = self._codes.decode[self._map[key]]
            h = self._codes.intern((loc, m) for loc, m in cur.locations if loc != location)  # type: ignore[union-attr]
            if h is None:
                del self._map[key]
            else:
                self._map[key] = h.code
        if keys:
            self.version += 1
            self._codes.prune(set(self._map.values()))
        return len(keys)

    def drop_node(self, node: str, below_epoch: int | None = None) -> int:
        """Forget a node's holdings (only those written before `below_epoch` if given); return blocks affected."""
        with self._lock:
            doomed = [loc for loc in self._by_loc
                      if loc.node == node and (below_epoch is None or loc.epoch < below_epoch)]  # fmt: skip
            return sum(self._drop_location(loc) for loc in doomed)

    def get(self, key: bytes) -> Holding | None:
        """Exact match: the holding of one key."""
        try:
            return self._codes.decode[self._map.get(key)]
        except KeyError:  # its holding was pruned between the two reads: read again, consistently
            with self._lock:
                return self._codes.decode[self._map.get(key)]

    def match(self, keys: Sequence[bytes], layout: Layout, deadline: float | None = None) -> Match:
        """Longest-prefix match of a request's block keys against the live index.

        With a `deadline` (a `time.perf_counter()` value), `DeadlinePassed` is raised between chunks of keys.
        """
        try:
            return _scan(self._map.get, self._codes.decode, keys, layout, deadline)
        except KeyError:  # a holding was pruned (or a new one made) mid-scan: scan again under the lock
            with self._lock:
                return _scan(self._map.get, self._codes.decode, keys, layout, deadline)

    def holdings(self) -> dict[Location, int]:
        """Blocks held per location."""
        with self._lock:
            return {loc: len(keys) for loc, keys in sorted(self._by_loc.items())}

    def keys_at(self, location: Location) -> frozenset[bytes]:
        """Keys held at one location."""
        with self._lock:
            return frozenset(self._by_loc.get(location, ()))

    def snapshot(self) -> IndexSnapshot:
        """A read-only, point-in-time copy with the same `get` / `match`."""
        with self._lock:
            return IndexSnapshot(dict(self._map), dict(self._codes.decode), self.version)

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map


def match_within(index: Matcher, keys: Sequence[bytes], layout: Layout, deadline: float,
                 watchdog: concurrent.futures.Executor | None) -> Match:  # fmt: skip
    """`index.match(keys, layout)`, never later than `deadline` (a `time.perf_counter()` value).

    A matcher whose class declares `inline = True` (the builtin and native ones, the cluster index) takes the
    deadline itself and runs on the caller's thread (`watchdog=None`); any other plugin matcher runs under the
    `watchdog` executor, so a hung plugin costs the deadline, never more (`DeadlinePassed("the matcher")`).
    """
    if watchdog is None:
        return index.match(keys, layout, deadline=deadline)  # type: ignore[call-arg]
    future = watchdog.submit(index.match, keys, layout)
    try:
        return future.result(timeout=max(deadline - time.perf_counter(), 0.0))
    except concurrent.futures.TimeoutError:
        raise DeadlinePassed("the matcher") from None
