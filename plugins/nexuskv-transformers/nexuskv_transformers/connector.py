"""The engine connector: plan with the kernel, restore from the planned tier, prefill the rest, commit new state.

Three modes run the same engine side by side: `nexuskv` (the kernel decides), `never` (always prefill everything,
the engine alone) and `always` (reuse the longest held prefix whatever it costs, as a cache without a cost model
would). Anything wrong with restored state (a missing block, a corrupt payload, a tensor that is not this model's)
is reported to the kernel and the request recomputes: wrong state is never mounted.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from attrs import define, field

from nexuskv import LoadReport, Plan, PlanAction, Request, get_logger
from nexuskv_transformers.engine import Engine, Prefill
from nexuskv_transformers.models import ReferenceModel
from nexuskv_transformers.state import StateMismatch

__all__ = ["MODES", "Outcome", "TransformersConnector"]

MODES = ("nexuskv", "never", "always")

log = get_logger(__name__)


@define
class Outcome:
    """One request served: what was planned, what was reused, how long the first token took."""

    request: Request
    mode: str
    plan: Plan | None
    tokens_total: int
    tokens_reused: int
    ttft_s: float
    logits: torch.Tensor
    tier: str = ""
    fallback: str = ""
    commit_s: float = 0.0
    committed: int = 0
    timings: dict[str, float] = field(factory=dict)

    @property
    def tokens_recomputed(self) -> int:
        """Tokens the engine prefilled."""
        return self.tokens_total - self.tokens_reused

    def line(self) -> str:
        """The request's plan in one line."""
        p = self.plan
        action = p.action.value if p is not None else "prefill"
        src = f" from {self.tier}" if self.tier else ""
        why = f" ({self.fallback})" if self.fallback else ""
        gain = f" G={p.predicted.gain_ms:+.1f}ms" if p is not None and p.action == PlanAction.MATERIALIZE else ""
        return (f"{self.request.request_id:<14} {self.mode:<8} {action:<11} reuse {self.tokens_reused:>5}/"
                f"{self.tokens_total:<5}{src}{gain} ttft {self.ttft_s * 1e3:7.1f} ms{why}")  # fmt: skip


class TransformersConnector:
    """Serves requests for one reference model through one kernel."""

    def __init__(
        self,
        kernel: Any,
        model: ReferenceModel,
        *,
        mode: str = "nexuskv",
        checkpoint_every: int = 4,
        commit: bool = True,
        engine: Engine | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (have: {MODES})")
        if kernel is not None and model.page_size != kernel.keyer.page_size:
            raise ValueError(f"model page size {model.page_size} is not the kernel's {kernel.keyer.page_size}")
        self.kernel = kernel
        self.ref = model
        self.mode = mode
        self.engine = engine or Engine(model)
        self.codec = self.engine.codec
        self.page = model.page_size
        self.checkpoint_every = max(1, checkpoint_every)
        self.commit_state = commit and mode != "never"
        self._ids = itertools.count()

    def request(self, token_ids: Sequence[int], *, tenant: str, scope: str = "", request_id: str | None = None,
                cache_salt: str = "") -> Request:  # fmt: skip
        """A kernel request for this model."""
        return Request(request_id=request_id or f"req-{next(self._ids)}", tenant=tenant, model=self.ref.identity,
                       tokenizer=self.ref.tokenizer, layout=self.ref.layout, token_ids=tuple(token_ids),
                       scope=scope, cache_salt=cache_salt)  # fmt: skip

    def checkpoints(self, start: int, total: int) -> list[int]:
        """Positions in (start, total] where checkpointed groups are saved.

        Every `checkpoint_every` blocks, the last full block, and the last block a later identical prompt could
        restore to (a prompt always leaves one token to compute).
        """
        if not self.engine.checkpointed or not self.commit_state:
            return []
        step = self.checkpoint_every * self.page
        marks = set(range(step, total + 1, step)) | {total // self.page * self.page,
                                                     (total - 1) // self.page * self.page}  # fmt: skip
        return sorted(p for p in marks if start < p <= total and p > 0)

    # ------------------------------------------------------------------------------------------ serve

    def run(self, request: Request, *, session: str | None = None, all_logits: bool = False) -> Outcome:
        """Serve one request: plan, restore, prefill the rest, commit. TTFT ends when the logits exist."""
        t0 = time.perf_counter()
        total = len(request.token_ids)
        timings: dict[str, float] = {}
        plan: Plan | None = None
        cache, start, tier, fallback = None, 0, "", ""
        keys: list[bytes] = []
        if self.mode != "never":
            keys = self.kernel.keys_for(request, session)
            plan_keys = keys[: (total - 1) // self.page]  # leave at least one token to compute the logits from
            plan = self._plan(request, plan_keys)
            timings["plan_s"] = time.perf_counter() - t0
            if plan.action == PlanAction.MATERIALIZE:
                t1 = time.perf_counter()
                cache, start, tier, fallback = self._restore(plan, request, plan_keys)
                timings["restore_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        out = self.engine.prefill(request.token_ids, cache=cache, start=start,
                                  checkpoints=self.checkpoints(start, total), all_logits=all_logits)  # fmt: skip
        t3 = time.perf_counter()
        timings["prefill_s"] = t3 - t2
        result = Outcome(request, self.mode, plan, total, start, t3 - t0, out.logits, tier, fallback, timings=timings)
        if self.commit_state:
            result.committed = self._commit(request, keys, start, out)
            result.commit_s = time.perf_counter() - t3
        return result

    def _plan(self, request: Request, keys: list[bytes]) -> Plan:
        if self.mode == "nexuskv":
            return self.kernel.plan(request, keys=keys)
        from nexuskv import to_plan  # the always-reuse baseline: the longest held prefix, unpriced

        k = self.kernel
        cands = k.planner.candidates(request, k.index.match(keys, request.layout), node=k.node)
        longest = max(cands, key=lambda c: c.blocks)
        action = PlanAction.MATERIALIZE if longest.blocks else PlanAction.RECOMPUTE
        return k.seal(to_plan(request, longest, action=action, decision_id=f"always-{request.request_id}",
                              page=self.page, transport=k.planner.transport, epoch=k.epoch, cost=k.cost,
                              reasons=["always reuse the longest prefix"]))  # fmt: skip

    def _restore(self, plan: Plan, request: Request, keys: list[bytes]) -> tuple[Any, int, str, str]:
        """(cache, tokens restored, tier, why not all) for a materialize plan; (None, 0, ...) means recompute."""
        got = self.kernel.materialize(plan, request, keys=keys)
        tier = ",".join(dict.fromkeys(s.tier for s in plan.spans))
        blocks = got.blocks
        if self.engine.checkpointed and blocks and not got.complete:
            blocks = 0  # checkpointed groups restore only at the planned checkpoint, which was not loaded
        if blocks == 0:
            return None, 0, tier, f"fail-open: {got.reason or 'nothing loaded'}; recompute"
        states = {k: (v.payload, v.descriptor) for k, v in got.states.items() if k[0] < blocks}
        try:
            for (b, g), (_, desc) in states.items():
                if (desc.model, desc.tokenizer, desc.layout) != (request.model, request.tokenizer, request.layout):
                    raise StateMismatch(f"block {b} group {g} was produced by another model, tokenizer or layout")
            cache = self.codec.restore(states, blocks)
        except StateMismatch as exc:
            self.kernel.report_load_result(plan, LoadReport(ok=False, failed_block=0, tier=plan.spans[0].tier,
                                                            reason=str(exc), corrupt=True),
                                           request=request)  # the kernel re-checks the block against the request
            log.warning("restored state refused; recompute", request_id=request.request_id, reason=str(exc))
            return None, 0, tier, f"refused: {exc}; recompute"
        why = "" if got.complete else f"partial: {got.reason}"
        return cache, blocks * self.page, tier, why

    def _commit(self, request: Request, keys: list[bytes], start: int, out: Prefill) -> int:
        """Commit pages of paged groups from block start/P on, and every checkpoint taken; returns payloads."""
        total = len(request.token_ids)
        payloads: dict[tuple[int, int], bytes] = {}
        specs: dict[tuple[int, int], Any] = {}
        for gi, (g, _) in enumerate(self.ref.groups):
            if g.kind.checkpointed:
                for pos, snaps in out.snapshots.items():
                    if pos % self.page == 0 and gi in snaps:
                        payloads[(pos // self.page - 1, gi)], specs[(pos // self.page - 1, gi)] = \
                            self.codec.checkpoint_payload(snaps[gi])
            else:
                for b in range(start // self.page, total // self.page):
                    payloads[(b, gi)], specs[(b, gi)] = self.codec.page_payload(out.cache, b, gi)
        if not payloads:
            return 0
        return self.kernel.commit(request, payloads, keys=keys, tensors=specs).accepted
