"""Cost-aware routing: on which node should a request run? Predicted TTFT per candidate node, and the best one.

A scheduler that embeds the kernel reports each candidate node's load (`NodeState`); `Kernel.route` keys and
matches the request once against the index (every node's holdings, when a cluster-wide index is bound), prices
each node's plan exactly as that node would make it (its own tiers, peers' state over the link to them, the
tenant's reuse rules, open breakers) and predicts

    TTFT(node) = queue(node) + T_lookup + T_transfer + T_mount + T_prefill(what is not restored)

`queue(node)` is the scheduler's `queue_ms` when it reports one, else the kernel's estimate from the reported
queue: `waiting_requests * base_ms + queued_prefill_tokens * per_token_ms + running_decodes * decode_ms` (the
profile's prefill terms). The tenant's `route` rules then exclude nodes or weight their prediction; the lowest
weighted prediction wins, ties to the shorter queue, then the node name: the same inputs give the same answer.

Routing in one pass (paged-only layouts, tenants without reuse rules). A node's plan depends on which node it is
only through the blocks on that node, so one match gives every node's sources (`planning.fleet`): the nodes that
hold nothing of the prefix share one plan, nodes with the same holdings up to their name share one, and a node's
prediction is its queue plus its plan's terms, arithmetic. Only nodes that can win are turned into options and
judged by route rules: the best by prediction among those the rules allow, every node within rounding of it, and
the next allowed one (the "next best" of the reasons). With a `weight` route rule every node is judged (a weight
can lift any node), and `all_options=True` makes every node an option. The chosen node and its option equal what
pricing every node by its own plan gives (`tests/paths/test_route_one_pass.py`). Checkpointed layouts (a plan
needs each block's checkpoints) and tenants with reuse rules (they may read the node) take the per-node path:
every node's own `decide`, all of them options.

A node's engine-resident blocks (index locations in `RESIDENT_TIER`, fed from the engine's own KV events, e.g.
by `nexuskv-vllm-events`) count for that node only, at no transfer and no mount: the engine reuses them itself.

Every stage runs inside the deadline: the keys, the match, the plans and the loop over the nodes; at most
`MAX_NODES` candidates are priced. Anything failing on the way (a plugin, the deadline, a rule engine error) fails
open to the least-loaded node the tenant's route rules allow (judged on the reported queue, as if the node
recomputed), with the reason. A bad node report is a `ValueError` naming the field when the `NodeState` is built.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Sequence
from typing import Any

from nexuskv.cluster.membership import Membership
from nexuskv.contracts import Request
from nexuskv.contracts.config import KernelConfig
from nexuskv.errors import DeadlinePassed
from nexuskv.errors import check_deadline as check
from nexuskv.logs import get_logger
from nexuskv.paths.read import ReadPath
from nexuskv.paths.route_types import NodeState, RouteDecision, RouteOption
from nexuskv.planning.budget import budget_for, format_ms
from nexuskv.planning.cost import CostModel
from nexuskv.planning.decision import choose_unruled, decide
from nexuskv.planning.fleet import FleetRuns, one_pass_applies
from nexuskv.policy.model import RouteEffect, RouteTarget

__all__ = ["NodeState", "RouteDecision", "RouteOption", "Router"]

log = get_logger("nexuskv.routing")  # the component name operators filter on: stable

MAX_NODES = 4096
"""Candidate nodes one `route` call prices at most (more is a `ValueError`: pre-select, as a gateway does)."""


_Terms = tuple[int, float, float, Any]  # (reused tokens, plan ms, load ms, the chosen candidate or None)


def _terms(cost: CostModel, request: Request, chosen: Any) -> _Terms:
    """A plan's part of a prediction: tokens reused, lookup + transfer + mount + prefill of the rest, the load."""
    tokens = len(request.token_ids)
    reused = chosen.blocks * request.layout.page_size if chosen is not None else 0
    plan_ms = cost.prefill_ms(tokens, min(reused, tokens))
    load_ms = 0.0
    if chosen is not None:
        load_ms = chosen.t_lookup_ms + chosen.t_transfer_ms
        plan_ms += load_ms + chosen.t_mount_ms
    return reused, plan_ms, load_ms, chosen


def _band(ms: float) -> float:
    """The largest prediction that can tie `ms` once `_rank` rounds both to 9 digits."""
    return ms + abs(ms) * 1e-6 + 1e-9


def _rank(score: float, queue: float, node: str) -> tuple[float, float, str]:
    """The order `_choose` picks in: weighted prediction, then queue (both to 9 digits), then the name."""
    return float(f"{score:.9g}"), float(f"{queue:.9g}"), node


def _queue_ms(cost: CostModel, ns: NodeState) -> float:
    """The scheduler's `queue_ms`, else the estimate from the reported queue (module docstring)."""
    if ns.queue_ms is not None:
        return float(ns.queue_ms)
    p = cost.profile.prefill
    waiting = ns.waiting_requests * p.base_ms + ns.queued_prefill_tokens * p.per_token_ms
    return waiting + ns.running_decodes * ns.decode_ms


class Router:
    """The kernel's routing part: `route` and its fail-open count. Thread-safe (it only reads shared state).

    It plans with the read path's planner, policies and congestion figures, exactly as `plan` does.
    """

    def __init__(self, reads: ReadPath, cost: CostModel, membership: Membership, config: KernelConfig) -> None:
        self._reads = reads
        self._cost = cost
        self._membership = membership
        self._config = config  # the budget's rule: `planning.budget`, as for plans
        self._lock = threading.Lock()
        self.fallbacks = 0  # routes that failed open
        self.one_pass = True  # False: every node by its own `decide` (the reference the one pass is tested against)

    def route(self, request: Request, nodes: Sequence[NodeState], *, deadline_ms: float | None = None,
              keys: Sequence[bytes] | None = None, all_options: bool = False) -> RouteDecision:  # fmt: skip
        """See `Kernel.route`."""
        decision = self._route(request, nodes, deadline_ms=deadline_ms, keys=keys, every=all_options)
        if decision.fail_open:
            with self._lock:  # exact under many routing threads
                self.fallbacks += 1
        log.debug("route", request_id=request.request_id, tenant=request.tenant, node=decision.node,
                  fail_open=decision.fail_open, reasons=list(decision.reasons))  # fmt: skip
        return decision

    def _route(self, request: Request, nodes: Sequence[NodeState], *, deadline_ms: float | None,
               keys: Sequence[bytes] | None, every: bool) -> RouteDecision:  # fmt: skip
        nodes = tuple(nodes)
        if not nodes:
            raise ValueError("route needs at least one candidate node")
        if len(nodes) > MAX_NODES:
            raise ValueError(f"route: {len(nodes)} candidate nodes, at most {MAX_NODES} (pre-select the candidates)")
        names = [n.node for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"route: candidate nodes repeat: {sorted({n for n in names if names.count(n) > 1})}")
        t0 = time.perf_counter()
        rule = budget_for(request, self._config, self._cost, deadline_ms, self._reads.slowdown)  # as a plan's
        budget = rule.ms
        end = t0 + budget / 1e3
        reads = self._reads
        stage = "keys"
        try:
            keys = reads.keys.keys(request, end) if keys is None else keys
            stage = "match"
            match = reads.match(request, keys, end)
            check(end, "match")
            stage = "policy"
            policies = reads.policies  # one revision for every node's plan
            policy = policies.for_tenant(request.tenant) if policies is not None else None
            stage = "pricing"
            # Routes are judged, never executed: breakers are only peeked at (a half-open one's trial is left to the
            # plan of the node the request goes to), and engine-resident blocks count for their own node.
            planner = reads.planner.judging().routing()
            if self.one_pass and one_pass_applies(request) and not (policy is not None and policy.rules.get("reuse")):
                options = self._price_fleet(planner, request, match, policy, nodes, end, every)
            else:
                options = []
                for ns in nodes:  # each node's plan is bounded inside, and the loop between them
                    check(end, "pricing")
                    options.append(self._price(planner, request, match, policy, ns, end))
        except DeadlinePassed as exc:
            why = "" if deadline_ms is not None else f" (the budget: {rule.why})"
            return self._fail_open(request, nodes, f"deadline {format_ms(budget)} ms passed in {exc.stage}{why}",
                                   budget)  # fmt: skip
        except Exception as exc:
            log.exception("routing failed", stage=stage, request_id=request.request_id)
            return self._fail_open(request, nodes, f"{stage} failed: {type(exc).__name__}: {exc}", budget)
        return _choose(request, options)

    def _excluded(self, request: Request, nodes: Sequence[NodeState],
                  until: float) -> dict[str, tuple[str, ...]] | None:  # fmt: skip
        """Nodes the tenant's route rules exclude, judged without a plan: fail-open keeps the restrictions.

        None when the rules cannot be evaluated (then no node can be shown to be allowed). Judging stops at `until`
        (a `time.perf_counter()` value; checked every 16 nodes, after the first 16): a node not judged by then is
        excluded, never allowed unjudged.
        """
        try:
            policies = self._reads.policies
            policy = policies.for_tenant(request.tenant) if policies is not None else None
            if policy is None or not policy.rules.get("route"):
                return {}
            out = {}
            for i, ns in enumerate(nodes):
                if i and i % 16 == 0 and time.perf_counter() > until:  # the first 16 are always judged
                    out.update((n.node, ("not judged before the deadline",)) for n in nodes[i:] if n.node not in out)
                    break
                queue = _queue_ms(self._cost, ns)
                target = _target(ns, queue, queue)
                verdict = policy.evaluate("route", {"request": request, "node": ns.node, "target": target})
                if not verdict.allowed:
                    out[ns.node] = verdict.deciding
            return out
        except Exception:
            log.exception("route rules failed while failing open", request_id=request.request_id)
            return None

    def _price(self, planner: Any, request: Request, match: Any, policy: Any, ns: NodeState,
               end: float) -> RouteOption:  # fmt: skip
        """One node's option from its own `decide` (the per-node path): its plan, its queue, the rules' verdict."""
        decision = decide(planner, request, match, policy, node=ns.node, decision_id="route",
                          epoch=self._membership.epoch, bandwidth_scale=self._reads.bandwidth_scale,
                          prefetch_target=self._reads.prefetch_target, deadline=end)  # fmt: skip
        return self._option(request, ns, _terms(self._cost, request, decision.detail.chosen),
                            decision.detail.prefetch, ns.node, policy)  # fmt: skip

    def _price_fleet(self, planner: Any, request: Request, match: Any, policy: Any, nodes: Sequence[NodeState],
                     end: float, every: bool) -> list[RouteOption]:  # fmt: skip
        """Every node priced from one match (module docstring: routing in one pass); only nodes that can win."""
        reads, cost = self._reads, self._cost
        fleet = FleetRuns(planner, request, match)
        page = request.layout.page_size
        plans: dict[tuple[Any, ...], tuple[_Terms, tuple[tuple[int, int, str, str], ...], str]] = {}
        min_gain = float(policy.min_gain_ms) if policy is not None else 0.0  # no reuse rules here: only this

        def plan_of(node: str) -> tuple[_Terms, tuple[tuple[int, int, str, str], ...], str]:
            sig = fleet.signature(node)
            got = plans.get(sig)
            if got is None:  # the first node of this signature decides for all of them
                check(end, "pricing")
                runs, stop = fleet.runs(node, sig)
                cands = planner.priced(runs, stop, node=node, page=page, bandwidth_scale=reads.bandwidth_scale,
                                       deadline=end)  # fmt: skip
                chosen, prefetch = choose_unruled(planner, cands, min_gain, reads.prefetch_target, page, node)
                got = plans[sig] = (_terms(cost, request, chosen), prefetch, node)
            return got

        rules = policy.rules.get("route") if policy is not None else None
        weighted = bool(rules) and any(r.effect == RouteEffect.WEIGHT for r in rules)
        shared = None  # the non-holders' plan: one for all of them
        keyed = []
        plan_at = []  # each node's plan, by its position in `nodes`
        for i, ns in enumerate(nodes):
            if i and i % 256 == 0:
                check(end, "pricing")
            if ns.node in fleet.holders:
                plan = plan_of(ns.node)
            else:
                plan = shared = shared or plan_of(ns.node)
            plan_at.append(plan)
            queue = _queue_ms(cost, ns)
            terms = plan[0]
            keyed.append((queue + terms[1] - (min(queue, terms[2]) if ns.overlap_loads else 0.0), queue, ns.node, i))
        if weighted or every:  # a weight can lift any node: every one is judged
            out = []
            for i, ns in enumerate(nodes):
                if i and i % 64 == 0:
                    check(end, "pricing")
                out.append(self._option(request, ns, *plan_at[i], policy))
            return out
        # By prediction: the best allowed node, every node within rounding of it (ties break on the queue and the
        # name, `_rank`) and the next allowed one; the others cannot be chosen, and route rules do not judge them.
        heapq.heapify(keyed)
        options: list[tuple[int, RouteOption]] = []
        allowed: list[float] = []
        first: tuple[float, float] | None = None  # the best allowed node's (prediction, queue)
        while keyed and (len(allowed) < 2 or keyed[0][0] <= _band(allowed[0])):
            predicted, queue, _, i = heapq.heappop(keyed)
            if len(options) % 64 == 63:
                check(end, "pricing")
            if len(allowed) >= 2 and (predicted, queue) == first:
                continue  # an exact tie of the best ranks after it by name: it cannot be chosen
            option = self._option(request, nodes[i], *plan_at[i], policy)
            options.append((i, option))
            if not option.excluded:
                allowed.append(predicted)
                first = first or (predicted, queue)
        return [o for _, o in sorted(options, key=lambda p: p[0])]  # as the nodes came: reasons list them so

    def _option(self, request: Request, ns: NodeState, terms: _Terms, prefetch: Sequence[tuple[int, int, str, str]],
                rep: str, policy: Any) -> RouteOption:  # fmt: skip
        """`ns`'s option from a plan made for `rep` (itself, or a node of the same signature) and its queue."""
        reads, cost = self._reads, self._cost
        reused, plan_ms, load_ms, chosen = terms
        sources: tuple[str, ...] = ()
        spans: tuple[tuple[int, int, str, str], ...] = ()
        tier, source = "", ""
        if chosen is not None:
            spans = tuple((f, e, t, ns.node if not n or n == rep else n) for f, e, t, n in chosen.sources)
            sources = tuple(f"{t}@{n}" for _, _, t, n in spans)
            tier, source = chosen.slowest_tier, spans[-1][3]
        queue = _queue_ms(cost, ns)
        predicted = queue + plan_ms - (min(queue, load_ms) if ns.overlap_loads else 0.0)
        weight, excluded, rules, messages = 1.0, False, (), ()
        if policy is not None and policy.rules.get("route"):
            target = _target(ns, queue, predicted, reused, tier, source)
            verdict = policy.evaluate("route", {"request": request, "node": ns.node, "target": target})
            excluded, rules = not verdict.allowed, verdict.deciding
            messages = verdict.messages + verdict.audits + tuple(f"error: {e}" for e in verdict.errors)
            weight = verdict.weight if verdict.weight is not None else 1.0
        cut = spans[-1][1] if spans else 0  # what the plan loads now is not prefetched as well
        pre = tuple((max(f, cut), e, t, ns.node if not n or n == rep else n) for f, e, t, n in prefetch if e > cut)
        return RouteOption(ns.node, predicted, predicted * weight, queue, plan_ms, reused, sources, spans, excluded,
                           weight, tuple(rules), tuple(messages), pre,
                           reads.prefetch_target if pre else "")  # fmt: skip

    def _fail_open(self, request: Request, nodes: Sequence[NodeState], reason: str,
                   budget_ms: float) -> RouteDecision:  # fmt: skip
        """The least-loaded node the tenant's route rules allow; no node when they cannot be evaluated.

        The rules get one more budget (the route's, at least 1 ms) to judge the nodes, the first 16 always: fail-open
        is bounded too, and a node not judged in it is not chosen.
        """
        grace = max(budget_ms, 1.0) / 1e3
        excluded = self._excluded(request, nodes, time.perf_counter() + grace)
        allowed = [n for n in nodes if excluded is not None and n.node not in excluded]
        if not allowed:
            why = "its route rules could not be evaluated" if excluded is None else "route rules excluded every node"
            return RouteDecision(request.request_id, request.tenant, None, (),
                                 (f"fail-open: {reason}; no node: {why}",), fail_open=True)  # fmt: skip
        node = min(allowed, key=lambda n: (_queue_ms(self._cost, n), n.running_decodes, n.node)).node
        skipped = f" (excluded by route rules: {_names(excluded)})" if excluded else ""
        return RouteDecision(request.request_id, request.tenant, node, (),
                             (f"fail-open: {reason}; least-loaded {node}{skipped}",), fail_open=True)  # fmt: skip


def _names(excluded: dict[str, tuple[str, ...]], most: int = 8) -> str:
    """The first `most` excluded node names, sorted, and how many more."""
    names = sorted(excluded)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _target(ns: NodeState, queue: float, predicted: float, reused: int = 0, tier: str = "",
            source: str = "") -> RouteTarget:  # fmt: skip
    """What route rules see of a node (without a plan: a recompute, as when routing fails open)."""
    return RouteTarget(node=ns.node, labels=dict(ns.labels), queued_prefill_tokens=ns.queued_prefill_tokens,
                       running_decodes=ns.running_decodes, queue_ms=queue, reuse_tokens=reused, tier=tier,
                       source=source, predicted_ttft_ms=predicted)  # fmt: skip


def _choose(request: Request, options: list[RouteOption]) -> RouteDecision:
    """The lowest weighted prediction among the nodes not excluded (ties: shorter queue, then name), with reasons."""
    allowed = [o for o in options if not o.excluded]
    if not allowed:
        reasons = ("every node excluded by route rules: " + "; ".join(f"{o.node}: {', '.join(o.rules)}"
                                                                      for o in options),)  # fmt: skip
        return RouteDecision(request.request_id, request.tenant, None, tuple(options), reasons)
    best = min(allowed, key=lambda o: _rank(o.score_ms, o.queue_ms, o.node))
    how = f"reuse {best.reuse_tokens} tokens from {', '.join(best.sources)}" if best.reuse_tokens else "recompute"
    reasons = [f"{best.node}: predicted TTFT {best.predicted_ttft_ms:.1f} ms (queue {best.queue_ms:.1f} + plan "
               f"{best.plan_ms:.1f}: {how})"]  # fmt: skip
    if best.weight != 1.0:
        reasons.append(f"{best.node}: weighted x{best.weight:g} by {', '.join(best.rules)}")
    runner_up = min((o for o in allowed if o is not best), key=lambda o: (o.score_ms, o.node), default=None)
    if runner_up is not None:
        reasons.append(f"next best {runner_up.node}: {runner_up.score_ms:.1f} ms")
    excluded = [o for o in options if o.excluded]
    if excluded:
        reasons.append("excluded: " + "; ".join(f"{o.node} ({', '.join(o.rules)})" for o in excluded))
    return RouteDecision(request.request_id, request.tenant, best.node, tuple(options), tuple(reasons))
