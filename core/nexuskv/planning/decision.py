"""The decision step of a plan: the priced candidates, the tenant's reuse rules and minimum gain, the choice.

`decide` prices the candidate cuts of one match (`Planner.candidates`), asks the tenant's `reuse` rules about
them in order of gain and returns the `Plan` with its reasons; `decide_with_shares` is the whole step of a live
plan: the tenant's own state, then every scope another tenant shares with it (the larger gain wins). The read
path resolves the tenant's policy and the shared scopes once and hands them in; shadow evaluation and
`nexuskv policy diff` replay the same function over recorded inputs, so a replay is the plan's own logic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import define, field

from nexuskv.contracts import Namespace, Plan, PlanAction, PlanSpan, Predicted, Request
from nexuskv.errors import DeadlinePassed
from nexuskv.errors import check_deadline as check
from nexuskv.planning.cost import CostModel
from nexuskv.planning.planner import RESIDENT_TIER, Candidate, Planner, best
from nexuskv.policy.model import Candidate as MatchView  # the view reuse rules see as `match`
from nexuskv.state.index import Match

__all__ = ["Decision", "PlanDetail", "choose_unruled", "decide", "decide_with_shares", "to_plan"]


@define(frozen=True)
class PlanDetail:
    """What the kernel needs beyond the `Plan` contract: the chosen candidate and every one considered."""

    chosen: Candidate | None
    candidates: tuple[Candidate, ...] = field(default=())
    prefetch: tuple[tuple[int, int, str, str], ...] = field(default=())  # (first block, end, from tier, node)
    verdicts: tuple[Any, ...] = field(default=())


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
    priced: Callable[[int | None], list[Candidate]] | None = None,
) -> Decision:
    """Price the candidates, apply the tenant's reuse rules and minimum gain, and choose.

    `policy` is a `PolicySet` (or None: no rules, no minimum gain). A `deny` with `max_tokens` shrinks the
    candidate to the cap; a plain deny rules the candidate out. Blocks past the chosen cut that sit in a slower
    tier and would pay if they were in `prefetch_target` are proposed for prefetch. `shared_from` is the
    namespace of another tenant whose shared state `match` found: reuse rules then see `match.shared`.
    `revision` is what the plan names as its policy revision (default: the policy set's own); `now` is the time
    rules see (default: the clock; a replay passes the recorded time). `priced(max_blocks)` gives the candidates
    when the caller found `node`'s sources itself (routing: `Planner.priced` over `planning.fleet`'s runs).
    """
    page = request.layout.page_size
    if priced is None:
        def priced(cap: int | None) -> list[Candidate]:
            return planner.candidates(request, match, node=node, inflight=inflight, bandwidth_scale=bandwidth_scale,
                                      max_blocks=cap, deadline=deadline)  # fmt: skip
    cands = priced(None)
    reasons: list[str] = []
    rules: list[str] = []
    verdicts: list[Any] = []
    longest = max(cands, key=lambda c: c.blocks)  # everything held, however slow
    held = longest.blocks
    if held:
        by_tier = ", ".join(f"{t} {n}" for t, n in sorted(_blocks_per_tier(longest)))
        reasons.append(f"match: {held} of {len(request.token_ids) // page} blocks reusable ({by_tier})")
    else:
        reasons.append(f"match: nothing reusable{_held_elsewhere(match, node)}")
    min_gain = float(policy.min_gain_ms) if policy is not None else 0.0
    chosen: Candidate | None = None
    ranked = _ranked(cands)
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
            capped = [c for c in priced(cap) if c.blocks]
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


def _ranked(cands: Sequence[Candidate]) -> list[Candidate]:
    """Candidates in the order the decision tries them: highest gain first, then fewer blocks."""
    return sorted(cands, key=lambda c: (-round(c.gain_ms, 9), c.blocks))


def choose_unruled(planner: Planner, cands: Sequence[Candidate], min_gain: float, prefetch_target: str, page: int,
                   node: str) -> tuple[Candidate | None, tuple[tuple[int, int, str, str], ...]]:  # fmt: skip
    """`decide`'s chosen candidate and prefetch for a tenant without reuse rules, without building the plan.

    What routing prices per node: the same ranking, minimum gain and prefetch proposal as `decide`.
    """
    top = _ranked(cands)[0]  # as `decide`: the best is taken, or nothing
    chosen = top if top.blocks and top.gain_ms > min_gain else None
    if not prefetch_target:
        return chosen, ()
    longest = max(cands, key=lambda c: c.blocks)
    return chosen, tuple(_prefetch(planner, longest, chosen, prefetch_target, min_gain, page, node))


def _held_elsewhere(match: Match, node: str, most: int = 3) -> str:
    """` on n1; the prefix is held on gpu-0`: where the prefix is when `node` can use none of it ("" if nowhere).

    Read from the match's distinct holdings (plain attributes: no call into the index on the plan's path).
    """
    others = sorted({loc.node for h in match.distinct if h is not None for loc, _ in h.locations
                     if loc.node != node})  # fmt: skip
    if not others:
        return ""
    more = f" and {len(others) - most} more nodes" if len(others) > most else ""
    holders = ", ".join(o or "this node" for o in others[:most])
    return f" on {node or 'this node'}; the prefix is held on {holders}{more}"


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
    slow = tuple(r for r in longest.sources if r[2] not in (target, RESIDENT_TIER))  # the engine's: held already
    if not slow:
        return ()
    block_bytes = planner.cost.bytes_per_token * page
    held = sum(e - f for f, e, t, _ in longest.sources if t == RESIDENT_TIER)  # the engine's: nothing to move
    moved = planner.cost.transfer_ms((longest.blocks - held) * block_bytes, target)
    gain_if_fast = planner.cost.recompute_ms(longest.blocks * page) - (
        longest.t_lookup_ms + moved + longest.t_mount_ms)
    have = chosen.gain_ms if chosen is not None else 0.0
    return slow if gain_if_fast > max(min_gain, have) else ()


Lookup = Callable[[str, str], "tuple[Match, Sequence[bytes]] | None"]
"""`lookup(owner, scope)`: what the index holds of the request in that scope, and its keys there (None: nothing)."""


def _gain(plan: Plan) -> float:
    return plan.predicted.gain_ms if plan.action == PlanAction.MATERIALIZE else 0.0


def decide_with_shares(planner: Planner, request: Request, match: Match, policy: Any,
                       shared: Sequence[tuple[str, str, Any]], args: Mapping[str, Any], lookup: Lookup,
                       end: float | None) -> tuple[Decision, Sequence[bytes] | None]:  # fmt: skip
    """The plan's decision: its own state, then each shared scope `lookup(owner, scope)` finds; the best gain wins.

    `policy` is the tenant's `PolicySet` (None: no rules), `shared` the `(owner, scope, owner's PolicySet)` of
    every scope another tenant's `share` rule names it for: both resolved by the caller, once per plan. Returns
    the decision and the keys of the shared scope it chose (None: the tenant's own). The own decision stands when
    the deadline passes during the shared scopes (they are an optimisation on top).
    """
    now = args.get("now")
    decision = decide(planner, request, match, policy, deadline=end, **args)
    chosen_keys: Sequence[bytes] | None = None
    check(end, "plan")
    for owner, scope, owner_policy in shared:
        try:
            check(end, "shared state")
            found = lookup(owner, scope)
            if found is None:
                continue
            held, keys = found
            blocks = held.longest()
            if not blocks or not owner_policy.share_granted(request, owner, scope, blocks, now):
                continue
            ns = Namespace(tenant=owner, scope=scope, cache_salt=request.cache_salt)
            got = decide(planner, request, held, policy, shared_from=ns, deadline=end, **args)
        except DeadlinePassed:
            break
        if _gain(got.plan) > _gain(decision.plan):
            decision, chosen_keys = got, keys
    return decision, chosen_keys
