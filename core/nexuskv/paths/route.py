"""Cost-aware routing: on which node should a request run? Predicted TTFT per candidate node, and the best one.

A scheduler that embeds the kernel reports each candidate node's load (`NodeState`); `Kernel.route` matches the
request once against the index (every node's holdings, when a cluster-wide index is bound), then for each node
plans exactly as that node would (`planner.decide` with `node=`: its own tiers, peers' state over the link to
them, the tenant's reuse rules, open breakers) and predicts

    TTFT(node) = queue(node) + T_lookup + T_transfer + T_mount + T_prefill(what is not restored)

`queue(node)` is the scheduler's `queue_ms` when it reports one, else the kernel's estimate from the reported
queue: `waiting_requests * base_ms + queued_prefill_tokens * per_token_ms + running_decodes * decode_ms` (the
profile's prefill terms). The tenant's `route` rules then exclude nodes or weight their prediction; the lowest
weighted prediction wins, ties to the shorter queue, then the node name: the same inputs give the same answer.

A node's engine-resident blocks (index locations in `RESIDENT_TIER`, fed from the engine's own KV events, e.g.
by `nexuskv-vllm-events`) count for that node only, at no transfer and no mount: the engine reuses them itself.

Every stage runs inside the deadline: the keys, the match, each node's plan and the loop between the nodes; at most
`MAX_NODES` candidates are priced. Anything failing on the way (a plugin, the deadline, a rule engine error) fails
open to the least-loaded node the tenant's route rules allow (judged on the reported queue, as if the node
recomputed), with the reason. A bad node report is a `ValueError` naming the field when the `NodeState` is built.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import define, field

from nexuskv.cluster.membership import Membership
from nexuskv.contracts import Request
from nexuskv.contracts.config import KernelConfig
from nexuskv.contracts.schema import doc
from nexuskv.errors import DeadlinePassed
from nexuskv.errors import check_deadline as check
from nexuskv.logs import get_logger
from nexuskv.paths.read import ReadPath
from nexuskv.planning.budget import budget_for, format_ms
from nexuskv.planning.cost import CostModel
from nexuskv.planning.decision import decide
from nexuskv.policy.model import RouteTarget

__all__ = ["NodeState", "RouteDecision", "RouteOption", "Router"]

log = get_logger("nexuskv.routing")  # the component name operators filter on: stable

MAX_NODES = 4096
"""Candidate nodes one `route` call prices at most (more is a `ValueError`: pre-select, as a gateway does)."""


def _as_count(value: Any) -> Any:
    """Whole numbers from other sources (numpy ints, `3.0` from a metrics scrape) as int; the rest unchanged."""
    if isinstance(value, int):  # bool included: the validator names it
        return value
    try:
        return operator.index(value)
    except TypeError:
        return int(value) if isinstance(value, float) and value.is_integer() else value


def _as_ms(value: Any) -> Any:
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value


def _as_labels(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def _count(_: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"NodeState.{attribute.name} must be an int >= 0, got {value!r}")


def _ms(_: Any, attribute: Any, value: Any) -> None:
    if value is None and attribute.name == "queue_ms":
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"NodeState.{attribute.name} must be a finite number >= 0, got {value!r}")


def _node(_: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"NodeState.node must be a non-empty string, got {value!r}")


def _labels(_: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"NodeState.labels must map strings to strings, got {value!r}")


@define(frozen=True)
class NodeState:
    """A candidate node as the scheduler reports it (its own bookkeeping, or the engine's metrics)."""

    node: str = field(validator=_node, metadata=doc("Node name, as the node publishes itself (`KernelConfig.node`)."))
    queued_prefill_tokens: int = field(default=0, converter=_as_count, validator=_count,
                                       metadata=doc("Prompt tokens waiting for prefill."))  # fmt: skip
    waiting_requests: int = field(default=0, converter=_as_count, validator=_count,
                                  metadata=doc("Requests waiting."))
    running_decodes: int = field(default=0, converter=_as_count, validator=_count,
                                 metadata=doc("Requests decoding."))
    decode_ms: float = field(default=0.0, converter=_as_ms, validator=_ms,
                             metadata=doc("Prefill delay per running decode (ms), as the scheduler measures it."))
    queue_ms: float | None = field(default=None, converter=_as_ms, validator=_ms,
                                   metadata=doc("The scheduler's own prediction of the wait (wins over estimates)."))
    labels: dict[str, str] = field(factory=dict, converter=_as_labels, validator=_labels,
                                   metadata=doc("Labels route rules can read (zone, gpu, ...)."))
    overlap_loads: bool = field(default=False, metadata=doc(
        "The engine loads restored state while the request waits in its queue (async loading): the wait is "
        "the longer of the two, not their sum."))  # fmt: skip


@define(frozen=True)
class RouteOption:
    """One candidate node, priced."""

    node: str
    predicted_ttft_ms: float  # queue + plan, before weights
    score_ms: float  # predicted_ttft_ms times the route rules' weight: what is compared
    queue_ms: float
    plan_ms: float  # lookup + transfer + mount + prefill of the rest
    reuse_tokens: int
    sources: tuple[str, ...]  # "tier@node" of each restored run, in order
    spans: tuple[tuple[int, int, str, str], ...] = ()  # (first block, end block, tier, node) of each run
    excluded: bool = False
    weight: float = 1.0
    rules: tuple[str, ...] = ()  # route rules that excluded or weighted it
    messages: tuple[str, ...] = ()
    prefetch: tuple[tuple[int, int, str, str], ...] = ()  # runs past the plan worth moving into `prefetch_to`
    prefetch_to: str = ""


@define(frozen=True)
class RouteDecision:
    """Where to run a request: the chosen node (None when route rules excluded every node) and why."""

    request_id: str
    tenant: str
    node: str | None
    options: tuple[RouteOption, ...]
    reasons: tuple[str, ...]
    fail_open: bool = False

    def option(self, node: str) -> RouteOption | None:
        """The priced option of `node` (None when it was not priced: fail-open)."""
        return next((o for o in self.options if o.node == node), None)


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

    def route(self, request: Request, nodes: Sequence[NodeState], *, deadline_ms: float | None = None,
              keys: Sequence[bytes] | None = None) -> RouteDecision:  # fmt: skip
        """See `Kernel.route`."""
        decision = self._route(request, nodes, deadline_ms=deadline_ms, keys=keys)
        if decision.fail_open:
            with self._lock:  # exact under many routing threads
                self.fallbacks += 1
        log.debug("route", request_id=request.request_id, tenant=request.tenant, node=decision.node,
                  fail_open=decision.fail_open, reasons=list(decision.reasons))  # fmt: skip
        return decision

    def _route(self, request: Request, nodes: Sequence[NodeState], *, deadline_ms: float | None,
               keys: Sequence[bytes] | None) -> RouteDecision:  # fmt: skip
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
            planner = reads.planner.routing()  # engine-resident blocks count for their own node
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
        """One node's option: the plan that node would make, its queue, and the route rules' verdict on it."""
        reads, cost = self._reads, self._cost
        decision = decide(planner, request, match, policy, node=ns.node, decision_id="route",
                          epoch=self._membership.epoch, bandwidth_scale=reads.bandwidth_scale,
                          prefetch_target=reads.prefetch_target, deadline=end)  # fmt: skip
        chosen = decision.detail.chosen
        tokens = len(request.token_ids)
        reused = chosen.blocks * request.layout.page_size if chosen is not None else 0
        plan_ms = cost.prefill_ms(tokens, min(reused, tokens))
        sources: tuple[str, ...] = ()
        spans: tuple[tuple[int, int, str, str], ...] = ()
        tier, source, load_ms = "", "", 0.0
        if chosen is not None:
            load_ms = chosen.t_lookup_ms + chosen.t_transfer_ms
            plan_ms += load_ms + chosen.t_mount_ms
            spans = tuple((f, e, t, n or ns.node) for f, e, t, n in chosen.sources)
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
        prefetch = tuple((max(f, cut), e, t, n or ns.node) for f, e, t, n in decision.detail.prefetch if e > cut)
        return RouteOption(ns.node, predicted, predicted * weight, queue, plan_ms, reused, sources, spans, excluded,
                           weight, tuple(rules), tuple(messages), prefetch,
                           reads.prefetch_target if prefetch else "")  # fmt: skip

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
    best = min(allowed, key=lambda o: (float(f"{o.score_ms:.9g}"), float(f"{o.queue_ms:.9g}"), o.node))
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
