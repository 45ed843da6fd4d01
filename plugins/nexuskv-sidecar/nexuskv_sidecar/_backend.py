"""Private: what the HTTP layer asks of the kernel, as one interface with two implementations.

`KernelBackend` calls a kernel in this process. `nexuskv_sidecar._channel.RemoteBackend` makes the same calls on the
kernel of another process (a worker's, see `nexuskv_sidecar._workers`). The HTTP layer (`app`) authenticates,
bounds, parses and checks every body itself and hands the backend contract objects; the backend answers with
JSON-ready values, so a worker only serialises them. Every method is safe to call from many threads at once.
"""

from __future__ import annotations

import base64
import collections
import threading
import uuid
from typing import Any, Protocol

from nexuskv import LoadReport, NodeState, Plan, PlanAction, Request, get_logger, to_dict
from nexuskv_sidecar._binary import Parsed
from nexuskv_sidecar._codec import ApiError

__all__ = ["Backend", "KernelBackend", "fail_open", "status_of"]

log = get_logger("nexuskv_sidecar")
_REPORTED_KEPT = 100_000  # decision ids remembered as reported (a report moves breakers once, however resent)


_FORGED = "plan: its MAC does not check (not a plan this deployment made, or altered)"


class Backend(Protocol):
    """The kernel's operations as the HTTP layer uses them."""

    node: str
    decision_log: Any  # `subscribe()` -> a subscription (`get(timeout)`, `closed`, `close()`); `recent(n)`

    def plan(self, req: Request | Parsed, session: str | None) -> dict[str, Any]: ...
    def route(self, req: Request | Parsed, nodes: list[NodeState]) -> dict[str, Any]: ...
    def commit(self, req: Request, payloads: dict[tuple[int, int], bytes]) -> dict[str, Any]: ...
    def materialize(self, plan: Plan, req: Request, with_payloads: bool) -> dict[str, Any]: ...
    def report(self, plan: Plan, report: LoadReport, req: Request | None) -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...
    def metrics(self) -> bytes: ...
    def healthz(self) -> dict[str, Any]: ...


class KernelBackend:
    """The backend over a kernel in this process."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.node: str = kernel.node
        self.decision_log = kernel.decision_log
        self._reported: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._reported_lock = threading.Lock()

    def plan(self, req: Request | Parsed, session: str | None) -> dict[str, Any]:
        """The kernel's plan as JSON (a `recompute` plan naming the defect if the kernel raises)."""
        if isinstance(req, Parsed):
            req = req.request()
        try:
            plan = self.kernel.plan(req, session=session)
        except Exception as exc:  # the kernel fails open by itself; this is the net under a defect
            log.error("plan raised; answering recompute", error=f"{type(exc).__name__}: {exc}")
            plan = fail_open(req, f"sidecar: {type(exc).__name__}")
        return to_dict(plan)

    def route(self, req: Request | Parsed, nodes: list[NodeState]) -> dict[str, Any]:
        """The kernel's route decision as JSON."""
        if isinstance(req, Parsed):
            req = req.request()
        return to_dict(self.kernel.route(req, nodes))

    def commit(self, req: Request, payloads: dict[tuple[int, int], bytes]) -> dict[str, Any]:
        """Hand payloads to the kernel's writer: how many were accepted and refused."""
        result = self.kernel.commit(req, payloads)
        return {"accepted": result.accepted, "refused": result.refused}

    def materialize(self, plan: Plan, req: Request, with_payloads: bool) -> dict[str, Any]:
        """Load and verify `plan`'s state: per block its descriptor (and base64 bytes with `with_payloads`).

        A plan whose MAC does not check is a 403, as on `/v1/report` (one answer for it on every endpoint).
        """
        if not self.kernel.plan_seal.check(plan):
            raise ApiError(403, _FORGED)
        done = self.kernel.materialize(plan, req)
        states = []
        for (block, group), state in sorted(done.states.items()):
            item: dict[str, Any] = {"block": block, "group": group, "descriptor": to_dict(state.descriptor)}
            if with_payloads:
                item["data"] = base64.b64encode(state.payload).decode()
            states.append(item)
        return {"blocks": done.blocks, "tokens": done.tokens, "complete": done.complete, "reason": done.reason,
                "states": states}  # fmt: skip

    def report(self, plan: Plan, report: LoadReport, req: Request | None) -> dict[str, Any]:
        """Apply a load report of a plan this deployment sealed, once per plan: where to recompute from."""
        if not self.kernel.plan_seal.check(plan):
            raise ApiError(403, _FORGED)
        with self._reported_lock:  # breakers are shared: one plan moves them once, however resent
            if plan.decision_id in self._reported:
                raise ApiError(409, f"plan {plan.decision_id} was reported already")
            self._reported[plan.decision_id] = None
            while len(self._reported) > _REPORTED_KEPT:
                self._reported.popitem(last=False)
        # with its request, the kernel authorises the report as it would the load, and derives the plan's keys
        return {"recompute_from": self.kernel.report_load_result(plan, report, request=req)}

    def status(self) -> dict[str, Any]:
        """The kernel's status document."""
        return status_of(self.kernel)

    def metrics(self) -> bytes:
        """The kernel's Prometheus series in the text format."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.kernel.metrics.registry))

    def healthz(self) -> dict[str, Any]:
        """Liveness: the kernel's node and whether its lease is alive."""
        return {"ok": True, "node": self.kernel.node, "control_ok": self.kernel.control_ok()}


def status_of(kernel: Any) -> dict[str, Any]:
    """The kernel's status document (its metrics' status when it has them)."""
    metrics = getattr(kernel, "metrics", None)
    if metrics is not None and callable(getattr(metrics, "status", None)):
        return metrics.status()
    return {"node": kernel.node, "epoch": kernel.epoch, "policy_revision": kernel.policy_revision,
            "decisions": kernel.decisions, "tiers": {n: {"used_bytes": t.used_bytes(), "capacity_bytes":
            t.capacity_bytes} for n, t in kernel.tiers.items()}}  # fmt: skip


def fail_open(req: Request | Parsed, reason: str) -> Plan:
    """A `recompute` plan made without the kernel (the net under a defect): the caller prefills everything."""
    head, tokens = (req.head, len(req.ids)) if isinstance(req, Parsed) else (req, len(req.token_ids))
    return Plan(decision_id=uuid.uuid4().hex, request_id=head.request_id, tenant=head.tenant,
                action=PlanAction.RECOMPUTE, tokens_total=tokens, reasons=(f"fail-open: {reason}",))  # fmt: skip
