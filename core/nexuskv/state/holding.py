"""Where blocks are held: locations, interned holdings, and the small-int codes an index stores for them.

Every index (the builtin `DictIndex`, a native one) maps each block key to the code of an interned `Holding`, so a
block costs a key and an int, and the few distinct holdings are shared. `HoldingCodes` owns that interning and
the code -> holding map readers decode through.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Holding", "HoldingCodes", "Location"]


class Location(NamedTuple):
    """A place a block can be held: tier, node and the node's epoch when it was written."""

    tier: str
    node: str
    epoch: int = 0


class Holding:
    """Immutable, interned: where one block is held, and which state groups each location holds for it."""

    __slots__ = ("_cache", "code", "locations", "mask")

    def __init__(self, locations: tuple[tuple[Location, int], ...], code: int = 0) -> None:
        self.code = code
        self.locations = locations
        mask = 0
        for _, m in locations:
            mask |= m
        self.mask = mask
        self._cache: dict[tuple[str | None, str | None], int] = {}

    def mask_at(self, tier: str | None = None, node: str | None = None) -> int:
        """Groups held at locations matching `tier` and `node` (None matches any)."""
        if tier is None and node is None:
            return self.mask
        k = (tier, node)
        got = self._cache.get(k)
        if got is None:
            got = 0
            for loc, m in self.locations:
                if (tier is None or loc.tier == tier) and (node is None or loc.node == node):
                    got |= m
            self._cache[k] = got
        return got

    def at(self, location: Location) -> int:
        """Groups held at exactly `location` (0: none)."""
        for loc, m in self.locations:
            if loc == location:
                return m
        return 0

    def tiers(self) -> set[str]:
        """Tier names holding any part of the block."""
        return {loc.tier for loc, _ in self.locations}

    def __repr__(self) -> str:
        inner = ", ".join(f"{loc.tier}@{loc.node}#{loc.epoch}:{m:b}" for loc, m in self.locations)
        return f"Holding({inner})"


class HoldingCodes:
    """Interned holdings by small-int code, for indexes that store codes (not thread-safe: writers hold a lock).

    Readers take no lock: they read `decode` before the index, and decode the codes they find through it. A new
    holding enters `decode` before any index can hold its code; `prune` replaces `decode` by a new dict, so a
    reader holding the old one stays consistent, and one that meets a code made since gets a KeyError (and then
    reads again under the writers' lock).
    """

    __slots__ = ("_intern", "_next", "decode")

    def __init__(self) -> None:
        self.decode: dict[int | None, Holding | None] = {None: None}  # code -> holding (None: not held)
        self._intern: dict[tuple[tuple[Location, int], ...], Holding] = {}
        self._next = itertools.count()

    def intern(self, locations: Iterable[tuple[Location, int]]) -> Holding | None:
        """The one `Holding` of these (location, group mask) pairs (zero masks dropped); None when empty."""
        locs = tuple(sorted((loc, m) for loc, m in locations if m))
        if not locs:
            return None
        h = self._intern.get(locs)
        if h is None:
            h = self._intern[locs] = Holding(locs, next(self._next))
            self.decode[h.code] = h
        return h

    def plus(self, cur: Holding | None, location: Location, group_mask: int) -> Holding:
        """`cur` (None: held nowhere yet) with the groups in `group_mask` added at `location`."""
        locs = {} if cur is None else dict(cur.locations)
        locs[location] = locs.get(location, 0) | group_mask
        return self.intern(locs.items())  # type: ignore[return-value]  # a positive mask: never empty

    def minus(self, cur: Holding, location: Location | None,
              group_mask: int | None) -> tuple[Holding | None, list[Location]] | None:  # fmt: skip
        """`cur` with groups (all if None) taken away at `location` (every location if None).

        Returns the new holding (None: held nowhere) and the locations left holding nothing of the block, or None
        when nothing was held there to take away.
        """
        locs = dict(cur.locations)
        lost: list[Location] = []
        changed = False
        for loc in list(locs) if location is None else [location]:
            had = locs.get(loc, 0)
            left = 0 if group_mask is None else had & ~group_mask
            if not had or left == had:
                continue
            changed = True
            locs[loc] = left
            if not left:
                lost.append(loc)
        return (self.intern(locs.items()), lost) if changed else None

    def without(self, cur: Holding, location: Location) -> Holding | None:
        """`cur` with everything at `location` taken away (None: held nowhere else)."""
        return self.intern((loc, m) for loc, m in cur.locations if loc != location)

    def prune(self, live: Iterable[int]) -> None:
        """Forget every holding whose code is not in `live` (the codes an index still stores)."""
        keep = set(live)
        self.decode = {None: None, **{c: h for c, h in self.decode.items() if c in keep}}
        self._intern = {h.locations: h for h in self.decode.values() if h is not None}
