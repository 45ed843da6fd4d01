"""The read path: `plan` end to end, inside the deadline, and fail-open whatever goes wrong.

One request's plan goes: control plane and transport health -> keys (plain, session or given) -> match (the
builtin index inline, a plugin matcher under a watchdog) -> the tenant's policy -> decide (planner) -> shared
scopes other tenants grant -> prefetch proposals -> the decision log. Any exception, a passed deadline or an
unhealthy control plane gives `recompute` with the reason (`fail-open: ...`).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from nexuskv.cluster.membership import Membership
from nexuskv.contracts import (
    Layout,
    ModelIdentity,
    Plan,
    PlanAction,
    Request,
    StateGroup,
    TokenizerIdentity,
    to_dict,
)
from nexuskv.contracts.config import KernelConfig
from nexuskv.errors import DeadlinePassed
from nexuskv.errors import check_deadline as check
from nexuskv.logs import get_logger
from nexuskv.ops.capture import DecisionInputs, Recorder
from nexuskv.ops.decision_log import DecisionLog, fail_open_reason
from nexuskv.ops.lost_gain import LostGain
from nexuskv.planning.breakers import Health
from nexuskv.planning.budget import budget_for
from nexuskv.planning.budget import format_ms as _ms
from nexuskv.planning.cost import CostModel
from nexuskv.planning.decision import decide_with_shares, to_plan
from nexuskv.planning.planner import Planner
from nexuskv.planning.seal import PlanSeal
from nexuskv.plugins.interfaces import slot_of
from nexuskv.policy.loader import Policies
from nexuskv.policy.serving.live import LivePolicies
from nexuskv.state.index import Match, Matcher, match_within
from nexuskv.state.keys import Keys
from nexuskv.storage.prefetch import Prefetcher

__all__ = ["MAX_SLOWDOWN", "ReadPath"]

MAX_SLOWDOWN = 8.0
"""The most a busy machine stretches a budget by: a plan descheduled for longer is judged slow, not the machine."""
_SLOWDOWN_WEIGHT = 0.1  # of the newest plan in the estimate: about the last 20 plans count

log = get_logger("nexuskv.kernel")  # planning failures keep the logger name operators filter on


class ReadPath:
    """Plans requests; owns the matcher watchdog, link conditions and prefetch de-duplication."""

    def __init__(self, config: KernelConfig, keys: Keys, index: Matcher, planner: Planner, live: LivePolicies | None,
                 membership: Membership, health: Health, cost: CostModel, prefetcher: Prefetcher,
                 decisions: DecisionLog, seal: PlanSeal) -> None:  # fmt: skip
        self.config = config
        self.seal = seal
        self.keys = keys
        self.index = index
        self.planner = planner
        self.live = live
        self.membership = membership
        self.health = health
        self.cost = cost
        self.prefetcher = prefetcher
        self.decisions = decisions
        self.bandwidth_scale: dict[str, float] = dict(config.bandwidth_scale)  # congestion a caller reports
        self.link_load: dict[str, float] = {}  # bytes in flight per tier a caller reports (replay, schedulers)
        tiers = planner.tier_order
        self.prefetch_target = tiers[0] if len(tiers) > 1 else ""
        # bounded matchers that take a deadline (the builtin, the native plugin) run inline; others under a watchdog
        self._inline_matcher = getattr(type(index), "inline", False) is True  # declared by the class, not proxied
        self._watchdog = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nexuskv-watchdog")
        self._bounded_by = None if self._inline_matcher else self._watchdog  # what bounds a match by the deadline
        self._recent_prefetch: dict[tuple[bytes, int, str], float] = {}
        self.deadline_fallbacks = 0  # plans that answered recompute because their deadline passed
        self._lock = threading.Lock()  # guards prefetch de-duplication and the fallback count
        self.lost = LostGain(self.hindsight)  # per fail-open reason: the gain fallbacks gave up
        self._judging = planner.judging()  # the warm-up's and hindsight's planner: it takes no breaker trial
        self.slowdown = 1.0  # recent plans' wall time over their CPU time (EWMA, 1 to MAX_SLOWDOWN): the budget's load

    @property
    def policies(self) -> Policies | None:
        """The serving policies: read it once per operation, and use that object throughout."""
        return self.live.current if self.live is not None else None

    def match(self, request: Request, keys: Sequence[bytes] | None = None, deadline: float | None = None) -> Match:
        """What of the request is held, where: per-block holdings and restore points by kind, tier and node.

        With a `deadline` (a `time.perf_counter()` value), keys and match are bounded by it as in `plan`
        (`DeadlinePassed` once it passes).
        """
        if deadline is None:
            return self.index.match(self.keys.keys(request) if keys is None else keys, request.layout)
        keys = self.keys.keys(request, deadline) if keys is None else keys
        return match_within(self.index, keys, request.layout, deadline, self._bounded_by)

    def plan(self, request: Request, *, keys: Sequence[bytes] | None = None, session: str | None = None,
             deadline_ms: float | None = None) -> Plan:  # fmt: skip
        """Decide what of `request` to restore, from where, and what to prefetch; never later than the deadline.

        Any failure on the way (a plugin raising, the deadline passing, the control plane down) gives a
        `recompute` plan whose reasons say why.
        """
        c0 = time.thread_time()  # a plan's wall time over its own CPU time: how much the machine slows it down
        t0 = time.perf_counter()
        try:
            return self._plan(request, keys, session, deadline_ms, t0)
        finally:
            self._observe(time.perf_counter() - t0, time.thread_time() - c0)

    def _observe(self, wall_s: float, cpu_s: float) -> None:
        """Fold one plan's wall / CPU time ratio into `slowdown` (an estimate: a lost update under a race is fine)."""
        if cpu_s > 0:
            self.slowdown += _SLOWDOWN_WEIGHT * (min(MAX_SLOWDOWN, max(1.0, wall_s / cpu_s)) - self.slowdown)

    def _plan(self, request: Request, keys: Sequence[bytes] | None, session: str | None, deadline_ms: float | None,
              t0: float) -> Plan:  # fmt: skip
        budget = budget_for(request, self.config, self.cost, deadline_ms, self.slowdown)  # the stakes, or the caller's
        end = t0 + budget.ms / 1e3  # every stage and every long loop checks it: the wall time is bounded
        decision_id = f"{random.getrandbits(64):016x}"  # no system call: it would hand the GIL away mid-plan
        stage = "start"
        policies = self.policies  # one revision for the whole plan, whatever a reload swaps in meanwhile
        try:
            if policies is None and self.live is not None:
                return self._fallback(request, decision_id, t0, "no policy revision serving yet")
            if not self.membership.ok():
                return self._fallback(request, decision_id, t0,
                                      f"control plane unavailable ({self.membership.problem})")
            mover = f"transport:{self.planner.transport}"
            if not self.health.allow(mover):
                return self._fallback(request, decision_id, t0, f"{mover} circuit open "
                                      f"({self.health.breaker(mover).last_error})")  # fmt: skip
            stage = "keys"
            if keys is None:
                keys = self.keys.keys_for(request, session, deadline=end)
            stage = "match"
            match = match_within(self.index, keys, request.layout, end, self._bounded_by)
            check(end, "match")
            stage = "plan"
            args = self._args(request, decision_id, policies)
            # the tenant's policy and the scopes others share with it: resolved here, once, and handed on
            policy = policies.for_tenant(request.tenant) if policies is not None else None
            shares = policies.shared_with(request.tenant) if policies is not None else ()
            capture = self.capture(request.tenant)
            planner, recorder, shared = self.planner, None, None
            if capture:  # plan through a recorder: the inputs are what this plan read, as it read them
                recorder = Recorder(self.health, self.cost.links)
                planner, shared = recorder.planner(self.planner), {}
                args["now"] = datetime.datetime.now(datetime.UTC)
            lookup = functools.partial(self.keys.shared_match, self.index, request, end, self._bounded_by, shared)
            decision, shared_keys = decide_with_shares(planner, request, match, policy, shares, args, lookup, end)
            if shared_keys is not None:
                keys = shared_keys
        except DeadlinePassed as exc:
            with self._lock:  # the count stays exact under many planning threads
                self.deadline_fallbacks += 1
            why = "" if deadline_ms is not None else f" (the budget: {budget.why})"
            asked = deadline_ms is not None or request.slo.deadline_ms is not None  # the caller's own deadline
            return self._fallback(request, decision_id, t0, f"deadline {_ms(budget.ms)} ms passed in {exc.stage}{why}",
                                  asked=asked)  # fmt: skip
        except Exception as exc:
            log.exception("planning failed", stage=stage, request_id=request.request_id)
            return self._fallback(request, decision_id, t0, f"{stage} failed: {type(exc).__name__}: {exc}")
        plan = decision.plan  # made by decide() for this call alone: completed in place, then sealed
        object.__setattr__(plan, "reasons", (budget.reason(), *plan.reasons))
        plan = self.seal.seal(plan, fresh=True)
        if plan.prefetch:
            self._propose_prefetch(request, keys, plan)
        inputs = None
        if recorder is not None:  # the objects as they are: rendered (and replayed) off the hot path
            recorder.complete()
            inputs = DecisionInputs(request, match, args["node"], args["epoch"], args["inflight"],  # type: ignore[arg-type]
                                    dict(args["bandwidth_scale"]), args["prefetch_target"],  # type: ignore[call-overload]
                                    frozenset(recorder.denied), recorder.links, shared or {},
                                    at=args["now"])  # type: ignore[arg-type]  # fmt: skip
        # the policy that decided: the tenant's own file, or `default` (a bounded label, whoever the caller names)
        policy = plan.tenant if policies is not None and plan.tenant in policies.sets else "default"
        self.decisions.record(plan, t0, inputs=inputs, policies=policies if capture else None, policy=policy)
        return plan

    def warm_up(self) -> None:
        """Pay here, once, what a process's first plan would pay on its hot path (issue 30: it failed open).

        A synthetic request of its own identity runs every stage a plan runs (keys, with the contracts' first
        conversions; the match; the policy lookups; the decision; the seal; the plan's JSON) and nothing is kept:
        no decision is recorded or counted, nothing is stored or prefetched.
        """
        page = self.config.page_size
        req = Request(request_id="warm-up", tenant="nexuskv-warm-up", model=ModelIdentity(name="nexuskv-warm-up"),
                      tokenizer=TokenizerIdentity(name="nexuskv-warm-up"), token_ids=list(range(4 * page + 1)),
                      layout=Layout(groups=[StateGroup(kind="dense", layers=1)], page_size=page))  # fmt: skip
        policies = self.policies
        for tenant in policies.tenants() if policies is not None else ():  # each tenant's per-reader caches
            policies.for_tenant(tenant)
            policies.shared_with(tenant)
        budget_for(req, self.config, self.cost)
        to_dict(self.seal.seal(self._unrecorded(req, time.perf_counter() + 1.0)))

    def _args(self, request: Request, decision_id: str, policies: Policies | None) -> dict[str, Any]:
        """What the decision step takes besides the request, the match and the policy."""
        return dict(node=request.node or self.config.node, decision_id=decision_id,
                    revision=policies.revision if policies is not None else "", epoch=self.membership.epoch,
                    inflight=self._inflight(), bandwidth_scale=self.bandwidth_scale,
                    prefetch_target=self.prefetch_target)  # fmt: skip

    def hindsight(self, request: Request) -> float:
        """The gain (ms) a plan of `request` predicts now, made under the largest budget the rule gives, not recorded.

        What `LostGain` charges a fallback with: the plan it would have been, had it had the time (0 when that plan
        recomputes too).
        """
        cfg = self.config
        limit = min(cfg.max_deadline_ms, max(cfg.deadline_cap_ms, cfg.deadline_ms) * MAX_SLOWDOWN)
        plan = self._unrecorded(request, time.perf_counter() + limit / 1e3)  # the most the rule could have given it
        return plan.predicted.gain_ms if plan.action is PlanAction.MATERIALIZE else 0.0

    def _unrecorded(self, request: Request, end: float) -> Plan:
        """A plan of `request` by every stage `plan` runs, bounded by `end`, that nothing records, counts or acts on.

        The warm-up's and a fallback's hindsight; breakers are only peeked (`Planner.judging`).
        """
        policies = self.policies
        keys = self.keys.keys(request, end)
        match = match_within(self.index, keys, request.layout, end, self._bounded_by)
        policy = policies.for_tenant(request.tenant) if policies is not None else None
        shares = policies.shared_with(request.tenant) if policies is not None else ()
        lookup = functools.partial(self.keys.shared_match, self.index, request, end, self._bounded_by, None)
        decision, _ = decide_with_shares(self._judging, request, match, policy, shares,
                                         self._args(request, "0" * 16, policies), lookup, end)  # fmt: skip
        return decision.plan

    def capture(self, tenant: str) -> bool:
        """Whether plans of `tenant` keep their inputs (shadow evaluation runs, or its records carry them)."""
        return self.decisions.wants_inputs(tenant)

    def _inflight(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.link_load)
        for tier, n in self.prefetcher.inflight_bytes().items():
            out[tier] = out.get(tier, 0.0) + n
        return out

    def _fallback(self, request: Request, decision_id: str, t0: float, reason: str, asked: bool = False) -> Plan:
        plan = to_plan(request, None, action=PlanAction.RECOMPUTE, decision_id=decision_id,
                       page=request.layout.page_size, transport="", reasons=[f"fail-open: {reason}"],
                       epoch=self.membership.epoch, cost=self.cost)  # fmt: skip
        plan = self.seal.seal(plan, fresh=True)
        self.decisions.record(plan, t0, fallback=True)
        # what it gave up, judged later off this thread; not when the caller set the deadline that passed
        self.lost.fell_back(request, fail_open_reason(reason), judge=not asked)
        return plan

    def _propose_prefetch(self, request: Request, keys: Sequence[bytes], plan: Plan) -> None:
        """Hand the plan's prefetch spans to the prefetcher: O(1) here, the slots are listed on its thread."""
        page = request.layout.page_size
        block_bytes = self.cost.bytes_per_token * page
        groups = len(request.layout.groups)
        now = time.monotonic()
        with self._lock:  # the same prefix planned on two threads is prefetched once
            if len(self._recent_prefetch) > 10_000:
                self._recent_prefetch = {k: v for k, v in self._recent_prefetch.items() if v > now}
            for span in plan.prefetch:
                first = (keys[span.start // page], span.end, span.target_tier)
                if self._recent_prefetch.get(first, 0.0) > now:
                    continue  # asked for moments ago (the same session's next turn, a shared prefix): deduplicated
                self._recent_prefetch[first] = now + self.config.prefetch_deadline_s
                blocks = keys[span.start // page : span.end // page]
                self.prefetcher.propose(request.tenant, lambda blocks=blocks: [slot_of(k, g) for k in blocks
                                                                               for g in range(groups)],
                                        span.tier, span.target_tier, block_bytes, self.config.prefetch_deadline_s,
                                        context=request)  # place rules see the request  # fmt: skip

    def close(self) -> None:
        """Stop judging fallbacks and the matcher watchdog."""
        self.lost.close()
        self._watchdog.shutdown(wait=False, cancel_futures=True)
