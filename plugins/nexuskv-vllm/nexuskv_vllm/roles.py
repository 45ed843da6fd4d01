"""vLLM's `kv_role` for prefill/decode disaggregation: what a prefill engine hands on, what a decode engine takes.

- `kv_producer` (a prefill engine): saves the blocks its prompts complete, as `kv_both` does, and when a request
  finishes answers, in the response's `kv_transfer_params`, `{"nexuskv_handoff": grant}`: a sealed grant of where
  this engine holds the prompt's blocks (`Kernel.handoff`: node, epoch, address, tiers; no key). The proxy copies
  it into the decode request. The step that saved waits for the blocks to be placed (`report_wait_ms`, 2000 by
  default for a producer), so the grant covers them.
- `kv_consumer` (a decode engine): saves nothing; a request carrying a grant has it checked against its own keys
  (`Kernel.accept_handoff`), and then plans as always: the plan prices fetching the producer's blocks over the
  measured link to it against recomputing them here, and blocks already held here come first. A refused grant, a
  plan that says recompute, a producer that is gone or a payload that does not verify all end the same way: vLLM
  computes what was not loaded.
- `kv_both` (the default): saves and loads; grants are neither issued nor read.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from nexuskv import Kernel, Plan, PlanAction, Request, get_logger

__all__ = ["GRANT_MAX_BYTES", "HANDOFF_FIELD", "ROLES", "Role", "role_of"]

log = get_logger(__name__)

ROLES = ("kv_both", "kv_producer", "kv_consumer")
HANDOFF_FIELD = "nexuskv_handoff"
"""The key of a grant in `kv_transfer_params` (a producer's answer, a consumer's request)."""
PRODUCER_REPORT_WAIT_MS = 2000.0
GRANT_MAX_BYTES = 4096  # a grant's JSON; the kernel refuses larger ones anyway, the gateway drops them first


def role_of(value: object) -> str:
    """vLLM's `kv_role` (None: `kv_both`), or a ValueError naming the roles."""
    role = str(value or "kv_both")
    if role not in ROLES:
        raise ValueError(f"nexuskv_vllm: kv_role {role!r} is not one of {list(ROLES)}")
    return role


class Role:
    """One engine's P/D role; thread-safe."""

    def __init__(self, kernel: Kernel, role: str) -> None:
        role = role_of(role)
        self.kernel = kernel
        self.name = role
        self.saves = role != "kv_consumer"
        self.issues = role == "kv_producer"
        self.accepts = role == "kv_consumer"
        self._lock = threading.Lock()
        self.stats = {"pd_grants_issued": 0, "pd_grants_accepted": 0, "pd_grants_refused": 0, "pd_transfers": 0,
                      "pd_recomputes": 0}  # fmt: skip
        self._granted: set[str] = set()  # requests with an accepted grant whose plan is not decided yet
        self._seen: set[str] = set()  # live requests whose grant was looked at (a preempted one is planned again)

    def counters(self) -> dict[str, int]:
        """A snapshot of the P/D counters, taken under the role's lock."""
        with self._lock:
            return dict(self.stats)

    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    def accept(self, req: Any, request: Request, keys: Sequence[bytes]) -> None:
        """A decode engine's request: take the grant it carries, if any (checked, never trusted)."""
        if not self.accepts:
            return
        params = getattr(req, "kv_transfer_params", None)
        grant = params.get(HANDOFF_FIELD) if isinstance(params, dict) else None
        with self._lock:
            if grant is None or request.request_id in self._seen:
                return
            self._seen.add(request.request_id)
        try:
            got = self.kernel.accept_handoff(request, grant, keys=keys)
        except Exception as exc:  # never fail vLLM's scheduler over a grant: the request recomputes
            log.warning("handoff not accepted; recompute", request_id=request.request_id, error=repr(exc))
            self._count("pd_grants_refused")
            return
        self._count("pd_grants_accepted" if got.ok else "pd_grants_refused")
        if got.ok:
            with self._lock:
                self._granted.add(request.request_id)

    def decided(self, request: Request, plan: Plan) -> None:
        """A granted request's plan: say whether it fetches from the producer or recomputes, and why."""
        with self._lock:
            if request.request_id not in self._granted:
                return
            self._granted.discard(request.request_id)
        peers = sorted({s.node for s in plan.spans if s.node and s.node != self.kernel.node})
        fetch = plan.action == PlanAction.MATERIALIZE and bool(peers)
        self._count("pd_transfers" if fetch else "pd_recomputes")
        log.info("P/D decision", request_id=request.request_id, tenant=request.tenant,
                 decision="transfer" if fetch else "recompute", producers=peers, tokens_reused=plan.tokens_reused,
                 gain_ms=round(plan.predicted.gain_ms, 3) if plan.predicted else None,
                 reasons=list(plan.reasons))  # fmt: skip

    def grant(self, request: Request | None, keys: Sequence[bytes]) -> dict[str, Any] | None:
        """A prefill engine's finished request: the `kv_transfer_params` that hand its state on (None: nothing)."""
        if not self.issues or request is None or not keys:
            return None
        grant = self.kernel.handoff(request, keys=keys)
        if grant is None:
            return None
        self._count("pd_grants_issued")
        return {HANDOFF_FIELD: grant}

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._granted.discard(request_id)
            self._seen.discard(request_id)
