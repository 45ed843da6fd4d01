"""The MAC of a plan: what lets a plan cross a process boundary and still be trusted by the one that loads it."""

from __future__ import annotations

import hashlib
import hmac

import attrs

from nexuskv.contracts import Plan

__all__ = ["PlanSeal"]


class PlanSeal:
    """Makes plans tamper-evident: a keyed MAC with the deployment secret over what a plan decides.

    Plans cross process boundaries (a scheduler plans, a worker loads); a plan whose MAC does not check was
    changed on the way or made by another deployment, and is not loaded. The MAC covers the decision id,
    request, tenant, action, token counts, spans, prefetches, route, namespace, policy revision and epoch:
    everything that decides what is loaded, from where and for whom (not the predicted costs or the reasons).
    """

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        self._key = hashlib.blake2b(secret[:64], digest_size=32, person=b"nexuskv.planseal").digest()

    def mac(self, plan: Plan) -> str:
        """The MAC of `plan` (whatever its `mac` field says)."""
        ns = plan.namespace
        spans = tuple((s.start, s.end, s.tier, s.node, s.transport, s.target_tier) for s in plan.spans)
        pre = tuple((s.start, s.end, s.tier, s.node, s.transport, s.target_tier) for s in plan.prefetch)
        content = (plan.decision_id, plan.request_id, plan.tenant, plan.action.value, plan.tokens_total,
                   plan.tokens_reused, spans, pre, plan.route,
                   None if ns is None else (ns.tenant, ns.scope, ns.cache_salt), plan.policy_revision, plan.epoch,
                   plan.schema_version)  # fmt: skip
        return hashlib.blake2b(repr(content).encode(), key=self._key, digest_size=16).hexdigest()

    def seal(self, plan: Plan, *, fresh: bool = False) -> Plan:
        """`plan` with its MAC filled in; `fresh=True` fills in a plan nobody else has seen yet, in place."""
        if fresh:
            object.__setattr__(plan, "mac", self.mac(plan))  # frozen, but not yet shared: no copy on the hot path
            return plan
        return attrs.evolve(plan, mac=self.mac(plan))

    def check(self, plan: Plan) -> bool:
        """True when the plan's MAC is the one this deployment's secret gives."""
        return bool(plan.mac) and hmac.compare_digest(plan.mac, self.mac(plan))
