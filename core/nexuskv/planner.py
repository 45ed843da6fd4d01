"""The planner: from an index match, the tenant's reuse rules and the cost model, the cut that gains most.

Candidates are the valid restore points at every boundary where the fastest healthy source changes tier (reuse
only the fast part and recompute the rest, or fetch more), plus the longest valid point. Each is priced with
G = T_recompute - (T_lookup + T_transfer + T_mount); the best one wins if its gain exceeds the tenant's minimum
and its reuse rules allow it. Same inputs, same plan: ties break on fewer tokens moved, then tier order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import define, field

from nexuskv.contracts import Namespace, Plan, PlanAction, PlanSpan, Predicted, Request
from nexuskv.cost import CostModel, gain, peer_link
from nexuskv.errors import check_deadline as check
from nexuskv.health import Health
from nexuskv.index import Holding, Match
from nexuskv.kinds import group_masks

__all__ = ["Candidate", "PlanDetail", "Planner"]

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

    @property
    def gain_ms(self) -> float:
        """G of this candidate."""
        return gain(self.t_recompute_ms, self.t_lookup_ms, self.t_transfer_ms, self.t_mount_ms)


@define(frozen=True)
class PlanDetail:
    """What the kernel needs beyond the `Plan` contract: the chosen candidate and every one considered."""

    chosen: Candidate | None
    candidates: tuple[Candidate, ...] = field(default=())
    prefetch: tuple[tuple[int, int, str, str], ...] = field(default=())  # (first block, end, from tier, node)
    verdicts: tuple[Any, ...] = field(default=())


class Planner:
    """Prices candidates; holds no state of its own besides configuration."""

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
        cuts = {r[0] for r in runs[1:]} | {end}  # tier boundaries, and the longest cut
        if ckpt:  # checkpointed groups: only blocks with a checkpoint (of every such group) are cuts
            cuts = self._checkpoint_cuts(entries, end, ckpt, node, cuts, healthy, deadline)
        scale = bandwidth_scale
        out = [self._price(0, (), node, inflight, scale, layout.page_size, entries, ckpt, healthy)]
        for b in sorted(c for c in cuts if c > 0):
            check(deadline, "plan (pricing)")
            cut_runs = tuple((f, min(e, b), t, n) for f, e, t, n in runs if f < b and t)
            out.append(self._price(b, cut_runs, node, inflight, scale, layout.page_size, entries, ckpt, healthy))
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
        for first, end, tier, where in runs:
            if remote and where != node and self.peer(tier, where, node):
                per_peer[(tier, where)] = per_peer.get((tier, where), 0) + (end - first)
            else:
                per_tier[tier] = per_tier.get(tier, 0) + (end - first)
        transfer = sum(self.cost.transfer_ms(n * block_bytes, t, transport=self.transport, inflight=inflight,
                                             bandwidth_scale=scale) for t, n in sorted(per_tier.items()))  # fmt: skip
        for (tier, peer), n in sorted(per_peer.items()) if per_peer else ():
            transfer += self.cost.remote_ms(n * block_bytes, tier, peer, transport=remote, inflight=inflight,
                                            bandwidth_scale=scale)  # fmt: skip
        terms = self.cost.terms(blocks * page, transfer, blocks)
        tiers = [*per_tier, *(t for t, _ in per_peer)] if per_peer else per_tier
        slowest = max(tiers, key=lambda t: self._rank.get(t, len(self._rank)), default="")
        return Candidate(blocks, runs, terms.t_recompute_ms, terms.t_lookup_ms, terms.t_transfer_ms,
                         terms.t_mount_ms, slowest)  # fmt: skip


def best(candidates: Sequence[Candidate]) -> Candidate:
    """Highest gain; ties: fewer blocks (less moved), then the sources' tier names (stable)."""
    return max(candidates, key=lambda c: (round(c.gain_ms, 9), -c.blocks, tuple(r[2] for r in c.sources)))


def to_plan(
    request: Request,
    chosen: Candidate | None,
    *,
    action: PlanAction,
    decision_id: str,
    page: int,
    transport: str,
    prefetch: Sequence[tuple[int, int, str, str]] = (),
    prefetch_to: str = "",
    reasons: Sequence[str] = (),
    rules: Sequence[str] = (),
    revision: str = "",
    epoch: int = 0,
    cost: CostModel,
    namespace: Namespace | None = None,
    peer: Callable[[str, str], bool] | None = None,
    remote_transport: str = "",
) -> Plan:
    """The `Plan` contract for a decision; spans for which `peer(tier, node)` holds go over `remote_transport`."""
    total = len(request.token_ids)
    reused = chosen.blocks * page if chosen is not None and action == PlanAction.MATERIALIZE else 0

    runs = chosen.sources if reused and chosen is not None else ()
    if peer is None or not remote_transport:  # one node's state only: every span goes over `transport`
        spans = tuple(PlanSpan(start=f * page, end=e * page, tier=t, node=n, transport=transport)
                      for f, e, t, n in runs)  # fmt: skip
    else:
        spans = tuple(PlanSpan(start=f * page, end=e * page, tier=t, node=n,
                               transport=remote_transport if peer(t, n) else transport)
                      for f, e, t, n in runs)  # fmt: skip
    pre = tuple(PlanSpan(start=f * page, end=e * page, tier=t, node=n, transport=transport, target_tier=prefetch_to)
                for f, e, t, n in prefetch)  # fmt: skip
    if reused and chosen is not None:
        predicted = Predicted(t_recompute_ms=chosen.t_recompute_ms, t_lookup_ms=chosen.t_lookup_ms,
                              t_transfer_ms=chosen.t_transfer_ms, t_mount_ms=chosen.t_mount_ms,
                              gain_ms=chosen.gain_ms,
                              ttft_ms=cost.prefill_ms(total, reused) + chosen.t_lookup_ms + chosen.t_transfer_ms
                              + chosen.t_mount_ms)  # fmt: skip
    else:
        predicted = Predicted(t_lookup_ms=cost.lookup_ms(), ttft_ms=cost.prefill_ms(total))
    return Plan(decision_id=decision_id, request_id=request.request_id, tenant=request.tenant, action=action,
                tokens_total=total, tokens_reused=reused, spans=spans, prefetch=pre, predicted=predicted,
                reasons=tuple(reasons), rules=tuple(rules), policy_revision=revision, epoch=epoch,
                namespace=namespace)  # fmt: skip


@define(frozen=True)
class Decision:
    """The planner's answer: the plan, the chosen candidate (if any) and what was considered."""

    plan: Plan
    detail: PlanDetail


def decide(
    planner: Planner,
    request: Request,
    match: Match,
    policy: Any,
    *,
    node: str,
    decision_id: str,
    epoch: int,
    inflight: Mapping[str, float] | None = None,
    bandwidth_scale: Mapping[str, float] | None = None,
    prefetch_target: str = "",
    shared_from: Namespace | None = None,
    deadline: float | None = None,
    revision: str | None = None,
    now: Any = None,
) -> Decision:
    """Price the candidates, apply the tenant's reuse rules and minimum gain, and choose.

    `policy` is a `PolicySet` (or None: no rules, no minimum gain). A `deny` with `max_tokens` shrinks the
    candidate to the cap; a plain deny rules the candidate out. Blocks past the chosen cut that sit in a slower
    tier and would pay if they were in `prefetch_target` are proposed for prefetch. `shared_from` is the
    namespace of another tenant whose shared state `match` found: reuse rules then see `match.shared`.
    `revision` is what the plan names as its policy revision (default: the policy set's own); `now` is the time
    rules see (default: the clock; a replay passes the recorded time).
    """
    from nexuskv.policy.model import Candidate as MatchView  # the view reuse rules see as `match`

    page = request.layout.page_size
    cands = planner.candidates(request, match, node=node, inflight=inflight, bandwidth_scale=bandwidth_scale,
                               deadline=deadline)  # fmt: skip
    reasons: list[str] = []
    rules: list[str] = []
    verdicts: list[Any] = []
    longest = max(cands, key=lambda c: c.blocks)  # everything held, however slow
    held = longest.blocks
    if held:
        by_tier = ", ".join(f"{t} {n}" for t, n in sorted(_blocks_per_tier(longest)))
        reasons.append(f"match: {held} of {len(request.token_ids) // page} blocks reusable ({by_tier})")
    else:
        reasons.append("match: nothing reusable")
    min_gain = float(policy.min_gain_ms) if policy is not None else 0.0
    chosen: Candidate | None = None
    ranked = sorted(cands, key=lambda c: (-round(c.gain_ms, 9), c.blocks))
    for cand in ranked:
        if cand.blocks == 0 or cand.gain_ms <= min_gain:
            break
        if policy is None:
            chosen = cand
            break
        check(deadline, "plan (reuse rules)")
        verdict = _reuse_verdict(policy, request, cand, node, page, MatchView, shared_from, now)
        verdicts.append(verdict)
        rules.extend(r for r in verdict.deciding if r not in rules)
        reasons.extend(f"policy warning: {w}" for w in verdict.warnings)
        if verdict.allowed and (verdict.max_tokens is None or verdict.max_tokens >= cand.blocks * page):
            chosen = cand
            break
        cap = (verdict.max_tokens or 0) // page
        reasons.append(f"policy: {', '.join(verdict.deciding) or 'reuse'} "
                       + (f"caps reuse at {cap * page} tokens" if cap else "refuses this candidate"))  # fmt: skip
        if cap:
            capped = [c for c in planner.candidates(request, match, node=node, inflight=inflight, deadline=deadline,
                                                    bandwidth_scale=bandwidth_scale, max_blocks=cap) if c.blocks]
            if capped:
                alt = best(capped)
                v2 = _reuse_verdict(policy, request, alt, node, page, MatchView, shared_from, now)
                verdicts.append(v2)
                fits = v2.max_tokens is None or v2.max_tokens >= alt.blocks * page
                if alt.gain_ms > min_gain and v2.allowed and fits:
                    chosen = alt
                    break
    if chosen is not None:
        action = PlanAction.MATERIALIZE
        reasons.append(f"reuse {chosen.blocks * page} tokens: saves {chosen.t_recompute_ms:.2f} ms, costs "
                       f"{chosen.t_transfer_ms + chosen.t_mount_ms + chosen.t_lookup_ms:.2f} ms, "
                       f"G = {chosen.gain_ms:.2f} ms > min gain {min_gain:g} ms")  # fmt: skip
    else:
        action = PlanAction.RECOMPUTE
        top = ranked[0] if ranked else None
        if held and top is not None and top.blocks:
            reasons.append(f"recompute: best G = {top.gain_ms:.2f} ms does not beat min gain {min_gain:g} ms"
                           if top.gain_ms <= min_gain else "recompute: policy allows no reuse")  # fmt: skip
        elif held:
            reasons.append(f"recompute: reusing {longest.blocks * page} tokens would lose "
                           f"{-longest.gain_ms:.2f} ms (transfer {longest.t_transfer_ms:.2f} ms)")  # fmt: skip
    prefetch = _prefetch(planner, longest, chosen, prefetch_target, min_gain, page, node) if prefetch_target else ()
    if prefetch and action == PlanAction.RECOMPUTE:
        action = PlanAction.PREFETCH
    if prefetch:
        reasons.append(f"prefetch {sum(e - f for f, e, _, _ in prefetch) * page} tokens into {prefetch_target} "
                       "for the next request of this prefix")  # fmt: skip
    if shared_from is not None and chosen is not None:
        reasons.insert(0, f"shared by tenant {shared_from.tenant} (scope {shared_from.scope})")
    plan = to_plan(request, chosen, action=action, decision_id=decision_id, page=page,
                   transport=planner.transport, prefetch=prefetch, prefetch_to=prefetch_target, reasons=reasons,
                   rules=rules, epoch=epoch,
                   revision=getattr(policy, "revision", "") if revision is None else revision, cost=planner.cost,
                   namespace=shared_from if chosen is not None else None,
                   peer=(lambda t, n: planner.peer(t, n, node)) if planner.remote_transport else None,
                   remote_transport=planner.remote_transport)  # fmt: skip
    return Decision(plan, PlanDetail(chosen, tuple(cands), tuple(prefetch), tuple(verdicts)))


def _blocks_per_tier(c: Candidate) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for f, e, t, _ in c.sources:
        out[t] = out.get(t, 0) + e - f
    return list(out.items())


def _reuse_verdict(policy: Any, request: Request, cand: Candidate, node: str, page: int, view: Any,
                   shared_from: Namespace | None = None, now: Any = None) -> Any:  # fmt: skip
    owner, scope = (shared_from.tenant, shared_from.scope) if shared_from else (request.tenant, request.scope)
    match_view = view(tokens=cand.blocks * page, blocks=cand.blocks, tier=cand.slowest_tier,
                      node=cand.sources[-1][3] if cand.sources else "", owner=owner, scope=scope,
                      shared=owner != request.tenant, kind=request.layout.kind)  # fmt: skip
    predicted = Predicted(t_recompute_ms=cand.t_recompute_ms, t_lookup_ms=cand.t_lookup_ms,
                          t_transfer_ms=cand.t_transfer_ms, t_mount_ms=cand.t_mount_ms, gain_ms=cand.gain_ms)
    values = {"request": request, "match": match_view, "tier": cand.slowest_tier, "node": node, "cost": predicted}
    if now is not None:
        values["now"] = now
    return policy.evaluate("reuse", values)


def _prefetch(planner: Planner, longest: Candidate, chosen: Candidate | None, target: str,
              min_gain: float, page: int, node: str) -> tuple[tuple[int, int, str, str], ...]:  # fmt: skip
    """Runs of the longest candidate that are not in `target` and would pay if they were (this node's only)."""
    if not longest.blocks or (planner.remote_transport and
                              any(n != node and planner.peer(t, n, node) for _, _, t, n in longest.sources)):
        return ()  # fmt: skip
    slow = tuple(r for r in longest.sources if r[2] != target)
    if not slow:
        return ()
    block_bytes = planner.cost.bytes_per_token * page
    moved = planner.cost.transfer_ms(longest.blocks * block_bytes, target)
    gain_if_fast = planner.cost.recompute_ms(longest.blocks * page) - (
        longest.t_lookup_ms + moved + longest.t_mount_ms)
    have = chosen.gain_ms if chosen is not None else 0.0
    return slow if gain_if_fast > max(min_gain, have) else ()
