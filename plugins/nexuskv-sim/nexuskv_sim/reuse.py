"""Pieces the baseline routers share: always-reuse loading, router-side bookkeeping, approximate prefix indexes."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping, Sequence

from nexuskv_sim.api import ClusterView, Fetch, NodeLoad, SimRequest
from nexuskv_sim.tiers import block_keys

__all__ = ["ApproxPrefixIndex", "RecentRoutes", "always_reuse", "tier_prefixes"]


def tier_prefixes(view: ClusterView, node: str, req: SimRequest) -> tuple[int, int, int]:
    """Leading blocks of `req` at `node` in hbm, in hbm or dram, in any tier."""
    fast = getattr(view, "holdings", None)
    if fast is not None:
        return fast(node, req)
    return (view.prefix_blocks(node, "hbm", req), view.prefix_blocks(node, "dram", req),
            view.prefix_blocks(node, "disk", req))  # fmt: skip


def always_reuse(view: ClusterView, node: str, req: SimRequest) -> tuple[Fetch, ...]:
    """Load the longest prefix held at `node`, each part from its fastest tier (what LMCache, vLLM do)."""
    h, d, k = tier_prefixes(view, node, req)
    out = []
    if h:
        out.append(Fetch(node, "hbm", 0, h))
    if d > h:
        out.append(Fetch(node, "dram", h, d))
    if k > d:
        out.append(Fetch(node, "disk", d, k))
    return tuple(out)


class RecentRoutes:
    """What a router knows and the delayed load reports do not yet show: requests it routed since each report.

    A node reports at once when a request is routed to it, so a route at `t` shows in a report with `at_ms >= t`.
    """

    def __init__(self) -> None:
        self._routes: deque[tuple[float, str, int, int]] = deque()  # (time, node, prefill tokens, blocks)

    def add(self, now: float, node: str, tokens: int, blocks: int) -> None:
        """Record a request routed to `node` now."""
        self._routes.append((now, node, tokens, blocks))

    def since(self, loads: Mapping[str, NodeLoad]) -> dict[str, tuple[int, int, int]]:
        """Per node (requests, prefill tokens, blocks) routed after that node's report."""
        if loads:
            oldest = min(ld.at_ms for ld in loads.values())
            while self._routes and self._routes[0][0] < oldest:
                self._routes.popleft()
        out: dict[str, tuple[int, int, int]] = {}
        for t, node, tokens, blocks in self._routes:
            ld = loads.get(node)
            if ld is not None and t > ld.at_ms:
                n, tk, b = out.get(node, (0, 0, 0))
                out[node] = (n + 1, tk + tokens, b + blocks)
        return out


class ApproxPrefixIndex:
    """Per-worker LRU sets of the block keys a router sent there (it sees no evictions, only its own routing).

    Keys are prefix-chained, so a held key stands for its whole prefix, like a node of a radix tree.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, OrderedDict[Hashable, None]] = {}

    def match(self, worker: str, keys: Sequence[Hashable]) -> int:
        """Leading keys held for `worker`."""
        held = self._held.get(worker)
        if not held:
            return 0
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def size(self, worker: str) -> int:
        """Blocks held for `worker`."""
        return len(self._held.get(worker, ()))

    def insert(self, worker: str, keys: Sequence[Hashable]) -> None:
        """Record that `keys` went to `worker` (most recent), dropping its least recent beyond capacity."""
        held = self._held.setdefault(worker, OrderedDict())
        for k in keys:
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    @staticmethod
    def keys(req: SimRequest) -> tuple[Hashable, ...]:
        """The keys a router hashes for `req` (same identity as the simulator's blocks)."""
        return block_keys(req)
