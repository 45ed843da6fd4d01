"""The load path: planned state is read back, verified, and the engine told where to recompute from.

`materialize` loads a plan's spans through their transports on a worker pool, each span bounded by a timeout,
every payload checksum-verified; it stops at the first missing, corrupt (quarantined) or slow block and never
returns wrong state. Connectors that load by themselves report with `report_load_result`, which feeds the
breakers and quarantines what they found corrupt. State read from a slower tier is queued for promotion.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Sequence

from attrs import define

from nexuskv.contracts import Namespace, Plan, PlanAction, PlanSpan, Request
from nexuskv.contracts.config import KernelConfig
from nexuskv.logs import get_logger
from nexuskv.ops.counters import Buckets, Tally
from nexuskv.paths.write import WritePath
from nexuskv.planning.breakers import Health
from nexuskv.planning.cost import peer_link
from nexuskv.planning.seal import PlanSeal
from nexuskv.plugins.interfaces import StoredState
from nexuskv.policy.serving.live import LivePolicies
from nexuskv.policy.sharing import authorise
from nexuskv.state.identity import keyed_layout
from nexuskv.state.keys import Keys
from nexuskv.state.restore_points import group_masks
from nexuskv.storage.hierarchy import Hierarchy

__all__ = ["LoadPath", "LoadReport", "Materialized"]

log = get_logger("nexuskv.loadpath")  # the component name operators filter on: stable

_States = dict[tuple[int, int], StoredState]
# Upper bounds (seconds) of the |measured - predicted| TTFT histogram.
TTFT_ERROR_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@define(frozen=True)
class Materialized:
    """State loaded for a plan: payloads of blocks [0, blocks) by (block, group); recompute from `tokens` on."""

    plan: Plan
    blocks: int
    tokens: int
    states: dict[tuple[int, int], StoredState]
    reason: str = ""

    @property
    def complete(self) -> bool:
        """True when everything the plan asked for was loaded and verified."""
        return self.tokens == self.plan.tokens_reused


@define(frozen=True)
class LoadReport:
    """What a connector reports after restoring a plan: success, or where and why it failed."""

    ok: bool
    failed_block: int | None = None
    tier: str = ""
    reason: str = ""
    corrupt: bool = False
    timeout: bool = False
    measured_ttft_ms: float | None = None  # the engine's measured time to first token, vs plan.predicted.ttft_ms


class LoadPath:
    """Materialize plans and take connectors' load reports; owns the loader pool."""

    def __init__(self, config: KernelConfig, keys: Keys, hierarchy: Hierarchy, health: Health,
                 writes: WritePath, seal: PlanSeal, live: LivePolicies | None) -> None:  # fmt: skip
        self.config = config
        self.seal = seal
        self.live = live
        self.keys = keys
        self.hierarchy = hierarchy
        self.health = health
        self.writes = writes
        self._loader = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="nexuskv-load")
        self.counts = Tally()  # reports ok / failed, link_bytes / link_transfers per link, TTFT sums (metrics)
        self.ttft_error = Buckets(TTFT_ERROR_BUCKETS_S)  # |measured - predicted| TTFT of reports that measured it

    def materialize(self, plan: Plan, request: Request, *, keys: Sequence[bytes] | None = None,
                    timeout_ms: float | None = None) -> Materialized:  # fmt: skip
        """Load the plan's spans (checksums verified, each tier read bounded by a timeout).

        Stops at the first block that is missing, corrupt (quarantined), or slow (its tier's breaker opens):
        the caller restores blocks [0, blocks) and recomputes from `tokens` on. Never returns wrong state.
        """
        if plan.action != PlanAction.MATERIALIZE or not plan.spans:
            return Materialized(plan, 0, 0, {}, "nothing to load")
        refused = self._refusal(plan, request)
        if refused:
            log.warning("plan refused: nothing loaded", request_id=request.request_id, tenant=request.tenant,
                        reason=refused)  # fmt: skip
            return Materialized(plan, 0, 0, {}, f"refused: {refused}")
        if plan.namespace is not None:  # state another tenant shares: its keys, whatever the caller passed
            keys = self.keys.under(plan.namespace, request)
        keys = self.keys.keys(request) if keys is None else keys
        page = request.layout.page_size
        paged, ckpt = group_masks(request.layout.groups)
        limit = timeout_ms if timeout_ms is not None else self.config.load_timeout_ms
        order = self.hierarchy.tier_order
        states: _States = {}
        last = plan.tokens_reused // page
        for span in plan.spans:
            jobs = []
            for b in range(span.start // page, span.end // page):
                need = paged | (ckpt if b == last - 1 else 0)
                jobs.extend((b, g) for g in range(len(request.layout.groups)) if need & (1 << g))
            source = self._source(span)  # a peer's span is judged by the link to that peer, not by a tier here
            peer = source != span.tier
            if peer:  # the fetch itself gives up with the load: a hung peer must not hold loader threads
                future = self._loader.submit(self._load_peer, keys, jobs, span, limit / 1e3,
                                             plan.namespace or request.namespace)  # fmt: skip
            else:
                future = self._loader.submit(self._load_many, keys, jobs, span)
            try:
                got, bad = future.result(timeout=limit / 1e3)
            except concurrent.futures.TimeoutError:
                self.health.breaker(source).failure(f"load timed out after {limit:g} ms", severe=True)
                if not peer:
                    self.health.breaker(f"transport:{span.transport}").failure(f"load from {span.tier} timed out")
                return self._partial(plan, states, span.start // page, page, f"{source} timed out")
            except Exception as exc:
                self.health.breaker(source).failure(repr(exc))
                return self._partial(plan, states, span.start // page, page, f"{source} failed: {exc!r}")
            states.update(got)
            if self.config.promote_on_hit and order and (peer or span.tier != order[0]):
                self.writes.promote(request, got, source)
            if bad is not None:
                b, why = bad
                return self._partial(plan, states, b, page, why)
            self.health.breaker(source).success()
            if not peer:
                self.health.breaker(f"transport:{span.transport}").success()
        return Materialized(plan, last, last * page, states)

    def _refusal(self, plan: Plan, request: Request | None) -> str:
        """Why this plan must not be loaded (or reported on) for this request ("" when it may).

        A plan is checked, not trusted: its MAC must be this deployment's, it must be for the request's
        tenant and fit its tokens, and state of another namespace needs that owner's share grant for this
        very request, now. Without a request (a connector's report that names none), only the MAC is checked.
        """
        if not self.seal.check(plan):
            return "the plan's MAC does not check (changed on the way, or made by another deployment)"
        if request is None:
            return ""
        if plan.tenant != request.tenant:
            return f"the plan is for tenant {plan.tenant!r}, the request is tenant {request.tenant!r}'s"
        if plan.tokens_reused > len(request.token_ids):
            return f"the plan reuses {plan.tokens_reused} tokens of a {len(request.token_ids)}-token request"
        if plan.namespace is not None:
            policies = self.live.current if self.live is not None else None
            return authorise(policies, request, plan.namespace, plan.tokens_reused // request.layout.page_size)
        return ""

    def _load_many(self, keys: Sequence[bytes], jobs: list[tuple[int, int]],
                   span: PlanSpan) -> tuple[_States, tuple[int, str] | None]:  # fmt: skip
        got: _States = {}
        tier, transport = span.tier, span.transport
        started = time.perf_counter()  # measuring: a whole span, as the planner prices it, is one sample
        for b, g in jobs:
            st = self.hierarchy.load(keys[b], g, tier=tier, transport=transport)
            if st is None:
                return got, (b, f"block {b} group {g} missing or corrupt in {tier}")
            got[(b, g)] = st
        if jobs:
            nbytes = sum(len(st.payload) for st in got.values())
            self._transferred(tier if transport == "local" else transport, nbytes, time.perf_counter() - started)
        return got, None

    def _load_peer(self, keys: Sequence[bytes], jobs: list[tuple[int, int]], span: PlanSpan, timeout_s: float,
                   namespace: Namespace) -> tuple[_States, tuple[int, str] | None]:  # fmt: skip
        """A peer's span: every block in one pipelined fetch, timed as one sample of the link to that peer."""
        started = time.perf_counter()
        answers = self.hierarchy.load_peer(span.node, span.tier, span.transport, [(keys[b], g) for b, g in jobs],
                                           timeout_s=timeout_s, namespace=namespace)  # fmt: skip
        elapsed = time.perf_counter() - started
        got: _States = {}
        for (b, g), st in zip(jobs, answers, strict=True):
            if st is None:
                return got, (b, f"block {b} group {g} missing or corrupt on node {span.node} ({span.tier})")
            got[(b, g)] = st
        if got:
            self._transferred(peer_link(span.node), sum(len(st.payload) for st in got.values()), elapsed)
        return got, None

    def _transferred(self, link: str, nbytes: int, elapsed: float) -> None:
        """Count a span read over `link` and feed its link estimate (when links are measured)."""
        self.counts.add(("link_bytes", link), nbytes)
        self.counts.add(("link_transfers", link))
        links = self.hierarchy.cost.links
        if links is not None:
            links.observe(link, nbytes, elapsed)

    def _source(self, span: PlanSpan) -> str:
        """What a span's failures count against: `peer:<node>` for a span fetched from a peer, else its tier."""
        remote = self.hierarchy.remote
        return peer_link(span.node) if remote and span.transport == remote and span.node != self.config.node \
            else span.tier  # fmt: skip

    def _partial(self, plan: Plan, states: _States, first_bad: int, page: int, reason: str) -> Materialized:
        keep = {k: v for k, v in states.items() if k[0] < first_bad}
        log.warning("materialize stopped early; recompute from the last good block", request_id=plan.request_id,
                    tenant=plan.tenant, good_tokens=first_bad * page, reason=reason)  # fmt: skip
        return Materialized(plan, first_bad, first_bad * page, keep, reason)

    def report_load_result(self, plan: Plan, report: LoadReport, *, keys: Sequence[bytes] | None = None,
                           group: int = 0, request: Request | None = None) -> int:  # fmt: skip
        """A connector tells how restoring a plan went; returns the token to recompute from.

        Success closes the breakers of the tiers read; a failure counts against the tier's breaker (a timeout or
        corrupt data opens it at once). A report is checked, not trusted: the plan's MAC must be this
        deployment's, and with `request` the report is authorised exactly as `materialize` authorises a load
        (the request's tenant, its tokens, the owner's share grant now) and the plan's keys are the request's own
        (the owner's, for shared state), whatever `keys` says. A report that fails a check changes nothing and
        answers 0. A block reported corrupt is read again and quarantined only when the kernel's own checks reject
        it: its checksum, its being the block's, and (with `request`, for the reporter's own state) its descriptor
        naming the request's namespace, model, tokenizer and layout. Only the plan's own blocks can be named; another
        tenant's shared state is never quarantined or forgotten on a reader's word, only on the kernel's checks.
        """
        refused = self._refusal(plan, request)
        if refused:
            log.warning("load report refused: nothing changed", request_id=plan.request_id, tenant=plan.tenant,
                        reason=refused)  # fmt: skip
            return 0
        if request is not None:
            keys = self.keys.under(plan.namespace, request) if plan.namespace is not None else self.keys.keys(request)
        sources = {self._source(s) for s in plan.spans}  # a peer's span is judged by the link to that peer
        self._count_report(plan, report)
        if report.ok:
            for src in sources:
                self.health.breaker(src).success()
            return plan.tokens_reused
        block = report.failed_block if report.failed_block is not None else 0
        page = self.keys.page_size
        at = next((s for s in plan.spans if s.start // page <= block < s.end // page), None)
        peer = at if at is not None and self._source(at) != at.tier else None  # the failed block was a peer's
        tier = report.tier or (at.tier if at is not None else next(iter(sources)) if len(sources) == 1 else "")
        source = self._source(peer) if peer is not None else tier
        if source:
            self.health.breaker(source).failure(report.reason or "load failed",
                                                severe=report.corrupt or report.timeout)  # fmt: skip
        ours = keys is not None and block < min(len(keys), plan.tokens_reused // page)  # a block the plan reads
        if report.corrupt and ours and tier and keys is not None:
            if peer is None:
                self._reverify(plan, keys[block], group, tier, request, report.reason or "reported corrupt")
            elif plan.namespace is None:  # the reporter's own state on a peer: its entry leaves this node's index
                self.hierarchy.forget_peer(keys[block], group, tier, peer.node)
            # another tenant's state on a peer is never forgotten on a reader's word (it cannot be re-read here)
        log.warning("load failed; recompute from the last good block", request_id=plan.request_id,
                    tenant=plan.tenant, tier=tier, block=block, reason=report.reason)  # fmt: skip
        return min(plan.tokens_reused, block * self.keys.page_size)

    def _reverify(self, plan: Plan, key: bytes, group: int, tier: str, request: Request | None, why: str) -> None:
        """Read a block a connector reported corrupt again; quarantine it only when the kernel's checks reject it."""
        got = self.hierarchy.load(key, group, tier=tier)  # checksum and key checked: a mismatch is quarantined
        if got is None:
            return  # quarantined by the read, or gone
        # The descriptor is compared with the request only for the reporter's own state: a reader of a shared
        # scope differs from the owner in what keys leave out (a latent layout's tensor-parallel rank), and must
        # never delete the owner's state on its word.
        if request is not None and plan.namespace is None:
            d = got.descriptor
            own = (request.namespace, request.model, request.tokenizer, keyed_layout(request.layout))
            if (d.namespace, d.model, d.tokenizer, keyed_layout(d.layout)) != own:
                self.hierarchy.quarantine(key, group, tier, reason=f"{why}; its descriptor is another request's state")
                return
        log.warning("a block reported corrupt verifies: kept", request_id=plan.request_id, tier=tier,
                    key=key.hex(), group=group, reason=why)  # fmt: skip

    def _count_report(self, plan: Plan, report: LoadReport) -> None:
        self.counts.add("reports_ok" if report.ok else "reports_failed")
        measured = report.measured_ttft_ms
        # The prediction error is of plans that ran as planned: a failed load's TTFT includes a recompute the
        # prediction never assumed, and a fail-open plan predicted nothing. Values that are not finite are refused.
        fell = any(r.startswith("fail-open") for r in plan.reasons)
        if (measured is not None and report.ok and not fell and math.isfinite(measured) and 0 <= measured < 1e12
                and math.isfinite(plan.predicted.ttft_ms)):  # fmt: skip
            predicted = plan.predicted.ttft_ms
            self.counts.add("ttft_measured_us", round(measured * 1e3))  # exact sums: integer microseconds
            self.counts.add("ttft_predicted_us", round(predicted * 1e3))
            self.ttft_error.observe(abs(measured - predicted) / 1e3)

    def close(self) -> None:
        """Stop the loader pool (queued loads are cancelled)."""
        self._loader.shutdown(wait=False, cancel_futures=True)
