"""The planner: the candidate cuts of an index match, each priced with the cost model.

Candidates are the valid restore points at every boundary where the fastest healthy source changes tier (reuse
only the fast part and recompute the rest, or fetch more), plus the longest valid point. Each is priced with
G = T_recompute - (T_lookup + T_transfer + T_mount), once. Which one wins (the tenant's reuse rules and minimum
gain) is the decision step's (`decision.py`); `best` breaks ties the same way every time: fewer tokens moved,
then tier order.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

from attrs import Factory, define, field

from nexuskv.contracts import Request
from nexuskv.errors import check_deadline as check
from nexuskv.planning.breakers import Health
from nexuskv.planning.cost import CostModel, gain, peer_link
from nexuskv.state.index import Holding, Match
from nexuskv.state.restore_points import group_masks

__all__ = ["RESIDENT_TIER", "Candidate", "Planner", "best"]

RESIDENT_TIER = "gpu"
"""The engine's own KV cache (vLLM's prefix cache) as an index location, fed by the engine's KV events.

Only a routing planner (`Planner.routing`) reads it, and only for the node that holds it: a hit there costs no
transfer and no mount (the engine reuses its own blocks). Plans that load state never read it.
"""

_CHECK_EVERY = 256  # blocks between two deadline checks in the planner's Python loops


@define(frozen=True)
class Candidate:
    """One priced cut: restore `blocks` blocks read from `sources` (runs of blocks per tier and node)."""

    blocks: int
    sources: tuple[tuple[int, int, str, str], ...]  # (first block, end block, tier, node)
    t_recompute_ms: float
    t_lookup_ms: float
    t_transfer_ms: float
    t_mount_ms: float

    slowest_tier: str = ""  # the slowest tier it reads from (empty when nothing is read): what reuse rules see
    # G of this candidate, priced once with it: the decision step ranks and reports it without asking again
    gain_ms: float = field(init=False, default=Factory(lambda c: gain(c.t_recompute_ms, c.t_lookup_ms,
                                                                      c.t_transfer_ms, c.t_mount_ms), takes_self=True))


class Planner:
    """Prices candidates; holds no state of its own besides configuration."""

    def judging(self) -> Planner:
        """This planner over a view of the breakers that changes nothing.

        For plans judged, never executed (the warm-up's, a fallback's hindsight): they must not take a half-open
        breaker's one trial.
        """
        twin = copy.copy(self)
        twin.health = self.health.judging()  # type: ignore[assignment]
        return twin

    def routing(self) -> Planner:
        """This planner for pricing routes: it also counts a node's engine-resident blocks (`RESIDENT_TIER`)."""
        twin = copy.copy(self)
        twin.resident = True
        return twin

    def __init__(self, cost: CostModel, health: Health, tier_order: Sequence[str], transport: str = "local",
                 remote_transport: str = "", shared_tiers: Sequence[str] = ()) -> None:  # fmt: skip
        """`remote_transport` reaches other nodes (without one, only state this node can read is planned).

        `shared_tiers` are this node's tiers that hold other nodes' payloads too (a host-wide shm tier, a Redis
        server): another node's state there is read from the tier itself, not fetched from the peer.
        """
        self.cost = cost
        self.health = health
        self.tier_order = tuple(tier_order)  # fastest first
        self._rank = {t: i for i, t in enumerate(self.tier_order)}
        self.transport = transport
        self.remote_transport = remote_transport
        self.shared_tiers = frozenset(shared_tiers)
        self.resident = False  # `routing()` twins count RESIDENT_TIER locations of the plan's own node

    def peer(self, tier: str, where: str, node: str) -> bool:
        """True when state in `tier` on node `where` must be fetched from that peer by a plan made for `node`."""
        return bool(node and where and where != node and tier not in self.shared_tiers)

    def _best_source(
        self, h: Holding | None, need: int, node: str, healthy: frozenset[str]
    ) -> tuple[int, str, str] | None:
        """(tier rank, tier, node) of the fastest healthy location holding the `need` groups of one block."""
        if h is None:
            return None
        best: tuple[int, int, str, str] | None = None
        for loc, mask in h.locations:
            if mask & need != need:
                continue
            if loc.tier == RESIDENT_TIER:  # the engine's own cache: free, but only to a route for that node
                if self.resident and node and loc.node == node:
                    return (-1, RESIDENT_TIER, node)
                continue
            remote = 0 if (not node or loc.node == node) else 1
            if remote and loc.tier not in self.shared_tiers:  # a peer's: needs a transport to it, a healthy link
                if not self.remote_transport or not self.health.allow(peer_link(loc.node)):
                    continue
                remote = 2
            elif loc.tier not in healthy:
                continue
            key = (remote, self._rank.get(loc.tier, len(self._rank)), loc.tier, loc.node)
            if best is None or key < best:
                best = key
        return None if best is None else (best[1], best[2], best[3])

    def candidates(
        self,
        request: Request,
        match: Match,
        *,
        node: str,
        inflight: Mapping[str, float] | None = None,
        bandwidth_scale: Mapping[str, float] | None = None,
        max_blocks: int | None = None,
        deadline: float | None = None,
    ) -> list[Candidate]:
        """Every candidate cut worth pricing, priced; the empty cut (recompute all) first.

        With a `deadline` (a `time.perf_counter()` value), `DeadlinePassed` is raised inside the long loops.
        """
        check(deadline, "plan (sources)")
        # Asked once per call and passed down: concurrent plans never share this snapshot.
        healthy = frozenset(t for t in self.tier_order if self.health.allow(t))
        layout = request.layout
        paged, ckpt = group_masks(layout.groups)
        entries = match.entries if match.codes is None or ckpt else ()
        scanned = len(match.codes) if match.codes is not None else len(entries)
        limit = min(scanned, len(request.token_ids) // layout.page_size)
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        # Fastest healthy source of each block's paged groups. Holdings are interned and few, so price each
        # distinct one once and map blocks to sources at C speed.
        # Each block becomes one byte naming its source, so runs and the first gap are found by bytes methods.
        sources: list[tuple[str, str]] = []
        code_of: dict[Holding | None, int] = {}
        for h in match.distinct:
            s = self._best_source(h, paged, node, healthy) if paged else (0, "", "")
            src = (s[1], s[2]) if s is not None else ("", "")
            if src not in sources:
                sources.append(src)
            code_of[h] = sources.index(src)
        if len(sources) > 255:  # pragma: no cover - more than 255 distinct sources for one request
            raise ValueError("too many distinct sources in one match")
        check(deadline, "plan (blocks)")
        if match.codes is not None and match.decode is not None:  # an index with codes: skip decoding holdings
            by_code = {c: code_of[match.decode[c]] for c in match.distinct_codes or set(match.codes)}
            if len(set(by_code.values())) <= 1:  # one source for every block (the common case), or no block
                codes = bytes(by_code.values())[:1] * min(limit, len(match.codes))
            elif None not in by_code and max(by_code) < 256:  # translate at C speed
                table = bytearray(range(256))
                for c, src in by_code.items():
                    table[c] = src
                codes = bytes(match.codes[:limit]).translate(table)
            else:
                codes = bytes(map(by_code.__getitem__, match.codes[:limit]))
        else:
            codes = bytes(map(code_of.__getitem__, entries[:limit]))
        gap = sources.index(("", "")) if ("", "") in sources and paged else -1
        # Paged groups cannot skip a block: the usable prefix ends at the first block without a source.
        end = codes.find(bytes((gap,))) if gap >= 0 else len(codes)
        end = len(codes) if end < 0 else end
        runs: list[tuple[int, int, str, str]] = []
        start = 0
        while start < end:
            rest = codes[start:end]
            n = len(rest) - len(rest.lstrip(rest[:1]))
            if paged:
                runs.append((start, start + n, *sources[codes[start]]))
            start += n
        check(deadline, "plan (runs)")
        return self._priced(runs, end, node, inflight, bandwidth_scale, layout.page_size, entries, ckpt, healthy,
                            deadline)  # fmt: skip

    def priced(self, runs: Sequence[tuple[int, int, str, str]], end: int, *, node: str, page: int,
               inflight: Mapping[str, float] | None = None, bandwidth_scale: Mapping[str, float] | None = None,
               max_blocks: int | None = None, deadline: float | None = None) -> list[Candidate]:  # fmt: skip
        """The candidates of a paged-only layout whose per-block sources are already known, as `candidates` prices them.

        `runs` are the maximal runs of one source, `(first block, end block, tier, node)`, covering `[0, end)`
        (the usable prefix as `node` sees it); `max_blocks` clips them as `candidates(max_blocks=...)` clips the
        match. For routing, which finds every node's runs from one match (`planning.fleet`).
        """
        if max_blocks is not None and max_blocks < end:
            end = max(0, max_blocks)
            runs = [(f, min(e, end), t, n) for f, e, t, n in runs if f < end]
        return self._priced(runs, end, node, inflight, bandwidth_scale, page, (), 0, frozenset(), deadline)

    def _priced(self, runs: Sequence[tuple[int, int, str, str]], end: int, node: str,
                inflight: Mapping[str, float] | None, scale: Mapping[str, float] | None, page: int,
                entries: Sequence[Holding | None], ckpt: int, healthy: frozenset[str],
                deadline: float | None) -> list[Candidate]:  # fmt: skip
        """The empty cut, then every cut at a source boundary and the longest, priced."""
        cuts = {r[0] for r in runs[1:]} | {end}  # tier boundaries, and the longest cut
        if ckpt:  # checkpointed groups: only blocks with a checkpoint (of every such group) are cuts
            cuts = self._checkpoint_cuts(entries, end, ckpt, node, cuts, healthy, deadline)
        out = [self._price(0, (), node, inflight, scale, page, entries, ckpt, healthy)]
        for b in sorted(c for c in cuts if c > 0):
            check(deadline, "plan (pricing)")
            cut_runs = tuple((f, min(e, b), t, n) for f, e, t, n in runs if f < b and t)
            out.append(self._price(b, cut_runs, node, inflight, scale, page, entries, ckpt, healthy))
        return out

    def _checkpoint_cuts(self, entries: Sequence[Holding | None], end: int, ckpt: int, node: str, marks: set[int],
                         healthy: frozenset[str], deadline: float | None = None) -> set[int]:  # fmt: skip
        """Checkpoint cuts: the last checkpoint before each paged boundary, and the last one in each tier.

        An earlier checkpoint in a fast tier can beat the last one in a slow tier, so each healthy tier's is priced.
        """
        ck: list[int] = []
        for first in range(1, end + 1, _CHECK_EVERY):
            check(deadline, "plan (checkpoints)")
            ck.extend(b for b in range(first, min(end + 1, first + _CHECK_EVERY))
                      if self._best_source(entries[b - 1], ckpt, node, healthy) is not None)  # fmt: skip
        cuts = {max((b for b in ck if b <= m), default=0) for m in marks}
        found: dict[str, int] = {}
        for b in reversed(ck):
            h = entries[b - 1]
            for loc, mask in h.locations if h is not None else ():
                if mask & ckpt == ckpt and loc.tier in healthy:
                    found.setdefault(loc.tier, b)
            if len(found) == len(healthy):
                break
        return cuts | set(found.values())

    def _price(self, blocks: int, runs: tuple[tuple[int, int, str, str], ...], node: str,
               inflight: Mapping[str, float] | None, scale: Mapping[str, float] | None, page: int,
               entries: Sequence[Holding | None], ckpt: int, healthy: frozenset[str]) -> Candidate:  # fmt: skip
        if ckpt and blocks:
            c = self._best_source(entries[blocks - 1], ckpt, node, healthy)
            if c is not None:
                runs = (*runs, (blocks - 1, blocks, c[1], c[2]))
        block_bytes = self.cost.bytes_per_token * page
        per_tier: dict[str, int] = {}  # blocks read here, per tier
        per_peer: dict[tuple[str, str], int] = {}  # blocks fetched from a peer, per (tier, node)
        remote = self.remote_transport
        resident = 0  # blocks the engine already holds: no transfer, no mount
        for first, end, tier, where in runs:
            if tier == RESIDENT_TIER:
                resident += end - first
            elif remote and where != node and self.peer(tier, where, node):
                per_peer[(tier, where)] = per_peer.get((tier, where), 0) + (end - first)
            else:
                per_tier[tier] = per_tier.get(tier, 0) + (end - first)
        transfer = sum(self.cost.transfer_ms(n * block_bytes, t, transport=self.transport, inflight=inflight,
                                             bandwidth_scale=scale) for t, n in sorted(per_tier.items()))  # fmt: skip
        for (tier, peer), n in sorted(per_peer.items()) if per_peer else ():
            transfer += self.cost.remote_ms(n * block_bytes, tier, peer, transport=remote, inflight=inflight,
                                            bandwidth_scale=scale)  # fmt: skip
        terms = self.cost.terms(blocks * page, transfer, blocks - resident)
        tiers = [*per_tier, *(t for t, _ in per_peer)] if per_peer else per_tier
        slowest = max(tiers, key=lambda t: self._rank.get(t, len(self._rank)), default=RESIDENT_TIER if resident
                      else "")
        return Candidate(blocks, runs, terms.t_recompute_ms, terms.t_lookup_ms, terms.t_transfer_ms,
                         terms.t_mount_ms, slowest)  # fmt: skip


def best(candidates: Sequence[Candidate]) -> Candidate:
    """Highest gain; ties: fewer blocks (less moved), then the sources' tier names (stable)."""
    return max(candidates, key=lambda c: (round(c.gain_ms, 9), -c.blocks, tuple(r[2] for r in c.sources)))
