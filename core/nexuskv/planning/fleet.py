"""Every candidate node's sources from one match: what lets routing price a fleet in one pass.

A node's plan depends on which node it is only through the locations on that node (its own tiers, its engine's
resident blocks): every other location is a peer's or a shared tier's to it, as to any other node. So the match
is compressed once into runs of blocks with the same holding, each holding's locations are ranked once, and a
node's source runs are read off those runs:

- a node no location names (a *non-holder*) reads every block from the best other location, like every other
  non-holder: one set of runs serves them all;
- a *holder* reads a block from its own best location when it has one (the planner prefers its own tiers and its
  engine's resident blocks to any other), else from the best location on another node.

`signature(node)` is a node's source per run of the match, its own name replaced by `SELF`: nodes with equal
signatures make the same plan up to their name, so the router decides once per signature. The candidates equal
`Planner.candidates` node by node (`tests/planning/test_fleet.py` checks it on random holdings). A holding's
ranking is static (health is applied per route), so it is cached per interned holding. Paged-only layouts:
checkpointed groups (sliding-window, recurrent) need each block's checkpoints, which the per-node path reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from nexuskv.contracts import Request
from nexuskv.planning.cost import peer_link
from nexuskv.planning.planner import RESIDENT_TIER, Planner
from nexuskv.state.holding import Holding
from nexuskv.state.index import Match
from nexuskv.state.restore_points import group_masks

__all__ = ["SELF", "FleetRuns", "one_pass_applies"]

class _Self:
    __slots__ = ()

    def __repr__(self) -> str:
        return "SELF"


SELF: Any = _Self()
"""The node's own name in a signature: an object no node name can equal (a name is any string a peer publishes)."""

Run = tuple[int, int, str, str]  # (first block, end block, tier, node)
_NONE = ("", "")


def one_pass_applies(request: Request) -> bool:
    """True when `FleetRuns` can give the request's sources: a paged-only layout (no checkpointed group)."""
    paged, ckpt = group_masks(request.layout.groups)
    return bool(paged) and not ckpt


class FleetRuns:
    """One match, ranked once: `runs(node)` and `signature(node)` of any node (a holder's: O(its holdings' runs)).

    Not thread-safe; built per route call (a snapshot of the breakers' view, as one plan's is).
    """

    def __init__(self, planner: Planner, request: Request, match: Match) -> None:
        layout = request.layout
        paged, _ = group_masks(layout.groups)
        scanned = len(match.codes) if match.codes is not None else len(match.entries)
        limit = min(scanned, len(request.token_ids) // layout.page_size)
        holdings, self._code_runs = _compress(match, limit)
        self._healthy = frozenset(t for t in planner.tier_order if planner.health.allow(t))
        self._health = planner.health
        self._links: dict[str, bool] = {}  # peer -> its link is usable (asked once per route)
        static = (paged, planner.resident, planner.tier_order, planner.shared_tiers, bool(planner.remote_transport))
        self._ranked = ranked = [_ranking(h, static) for h in holdings]
        self.holders: dict[str, list[int]] = {}  # node -> holdings that name it
        for i, r in enumerate(ranked):
            for node in r.nodes:
                self.holders.setdefault(node, []).append(i)
        self._at: dict[int, list[int]] = {}  # holding -> positions of its code runs
        for p, (_, _, i) in enumerate(self._code_runs):
            self._at.setdefault(i, []).append(p)
        self._base = tuple(self._source(i, None) for _, _, i in self._code_runs)  # what a non-holder reads

    def signature(self, node: str) -> tuple[tuple[str, str], ...]:
        """`node`'s source of each run of the match, its own name as `SELF` (equal signatures: equal plans)."""
        if node not in self.holders:
            return self._base
        srcs = list(self._base)
        for i in self.holders[node]:
            src = self._source(i, node)
            if src[1] == node:
                src = (src[0], SELF)  # type: ignore[assignment]
            for p in self._at.get(i, ()):
                srcs[p] = src
        return tuple(srcs)

    def runs(self, node: str, signature: tuple[tuple[str, str], ...] | None = None) -> tuple[list[Run], int]:
        """`node`'s source runs over its usable prefix, and that prefix's end (in blocks).

        `signature` is `signature(node)` when the caller has it already.
        """
        out: list[Run] = []
        sig = self.signature(node) if signature is None else signature
        for (first, end, _), src in zip(self._code_runs, sig, strict=True):
            if src == _NONE:
                return out, first
            where = node if src[1] is SELF else src[1]
            if out and out[-1][2] == src[0] and out[-1][3] == where:
                out[-1] = (out[-1][0], end, src[0], where)
            else:
                out.append((first, end, src[0], where))
        return out, (out[-1][1] if out else 0)

    def _source(self, i: int, node: str | None) -> tuple[str, str]:
        """The best source of holding `i` for `node` (a holder's own first; None is any non-holder)."""
        r = self._ranked[i]
        if node is not None:
            for tier in r.own.get(node, ()):
                if tier == RESIDENT_TIER or tier in self._healthy:
                    return tier, node
        for peer, tier, where in r.others:
            if where == node:
                continue
            if not peer:
                if tier in self._healthy:
                    return tier, where
                continue
            ok = self._links.get(where)
            if ok is None:
                ok = self._links[where] = self._health.allow(peer_link(where))
            if ok:
                return tier, where
        return _NONE


class _Ranking:
    """A holding's locations in the planner's order, health aside (applied per route): static, so cached."""

    __slots__ = ("nodes", "others", "own")

    def __init__(self, h: Holding | None, static: tuple[int, bool, tuple[str, ...], frozenset[str], bool]) -> None:
        paged, resident, order, shared, remote = static
        rank = {t: i for i, t in enumerate(order)}
        others: list[tuple[int, int, str, str]] = []  # (1 shared tier | 2 peer, tier rank, tier, node)
        own: dict[str, list[tuple[int, str]]] = {}
        nodes: dict[str, None] = {}
        for loc, mask in h.locations if h is not None else ():
            nodes[loc.node] = None
            if mask & paged != paged:
                continue
            if loc.tier == RESIDENT_TIER:  # the engine's own cache: free, to a route for its node only
                if resident:
                    own.setdefault(loc.node, []).append((-1, loc.tier))
                continue
            r = rank.get(loc.tier, len(rank))
            own.setdefault(loc.node, []).append((r, loc.tier))
            if loc.tier in shared:  # another node's state in a tier this node reads itself
                others.append((1, r, loc.tier, loc.node))
            elif remote:  # a peer's: needs a healthy link to it
                others.append((2, r, loc.tier, loc.node))
        self.nodes = tuple(nodes)
        self.others = tuple((kind == 2, tier, node) for kind, _, tier, node in sorted(others))
        self.own = {n: tuple(t for _, t in sorted(ts)) for n, ts in own.items()}


_CACHE: dict[tuple[object, ...], _Ranking] = {}
_CACHE_MAX = 4096  # holdings are interned and immutable; the cache only spares the ranking of the ones in use


def _ranking(h: Holding | None, static: tuple[int, bool, tuple[str, ...], frozenset[str], bool]) -> _Ranking:
    key = (h, static)
    got = _CACHE.get(key)
    if got is None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        got = _CACHE[key] = _Ranking(h, static)
    return got


def _compress(match: Match, limit: int) -> tuple[list[Holding | None], list[tuple[int, int, int]]]:
    """The distinct holdings of the first `limit` blocks, and the runs of blocks with one holding (by index).

    With at most 256 distinct holdings each block becomes one byte naming its holding, so a run is what `lstrip`
    removes (C speed per run); with more, the runs are found item by item.
    """
    if match.codes is not None and match.decode is not None:
        seq: Sequence[object] = match.codes[:limit]
        decode = match.decode
        distinct: list[object] = list(match.distinct_codes or set(seq))
    else:
        seq = match.entries[:limit]
        decode = None
        distinct = list(match.distinct)
    if len(distinct) > 256:  # many holdings (long prompts over a fleet): only those of the first `limit` blocks
        distinct = list(dict.fromkeys(seq))
    idx = {c: i for i, c in enumerate(distinct)}
    holdings = [decode[c] if decode is not None else c for c in distinct]  # type: ignore[index]
    runs = []
    if len(distinct) <= 256:
        data = bytes(map(idx.__getitem__, seq))
        start, n = 0, len(data)
        while start < n:
            rest = data[start:]
            end = start + len(rest) - len(rest.lstrip(rest[:1]))
            runs.append((start, end, rest[0]))
            start = end
    else:
        start = 0
        for item, group in itertools.groupby(seq):
            end = start + sum(1 for _ in group)
            runs.append((start, end, idx[item]))
            start = end
    return holdings, runs  # type: ignore[return-value]
