"""The decision log: one structured line per plan, and plugin observers fed off the hot path.

Each decision is rendered inline as a structlog line (a background renderer would compete for the GIL and
stall plans by whole switch intervals), except a fallback's: a plan that falls back is late already, so its
line is rendered on the log thread and the plan returns at once. Plugin observers are arbitrary code, so they
run on that thread too, behind a bounded queue: when it falls behind, records are dropped and counted
(`observer_drops`), never waited for.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import attrs

from nexuskv.contracts import Plan, Predicted
from nexuskv.logs import get_logger
from nexuskv.plugins import PluginManager

__all__ = ["DecisionLog"]

log = get_logger("nexuskv.kernel")  # the decision lines keep the logger name operators filter on
_PREDICTED = tuple(f.name for f in attrs.fields(Predicted))  # the record's `predicted`, without a generic walk


class DecisionLog:
    """Logs every plan and hands its record to plugin observers; counts decisions and dropped records."""

    def __init__(self, plugins: PluginManager, max_queued: int = 10_000) -> None:
        self.plugins = plugins
        self._lock = threading.Lock()  # plans log from many threads: the counts stay exact
        self._decisions = 0
        self.observer_drops = 0
        self._observers = bool(plugins.pm.hook.nexuskv_observe_decision.get_hookimpls())  # fallbacks go to them too
        self._queue: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._observe, name="nexuskv-observers", daemon=True)
        self._thread.start()

    @property
    def decisions(self) -> int:
        """How many plans were logged (fallbacks included)."""
        return self._decisions

    def record(self, plan: Plan, t0: float, fallback: bool = False) -> None:
        """Log `plan` (made since `perf_counter()` was `t0`) and queue it for the observers.

        A fallback's line is rendered on the log thread (so it may follow lines logged after it).
        """
        with self._lock:
            self._decisions += 1
        record = {"decision_id": plan.decision_id, "request_id": plan.request_id, "tenant": plan.tenant,
                  "action": plan.action.value, "tokens_total": plan.tokens_total,
                  "tokens_reused": plan.tokens_reused, "policy_revision": plan.policy_revision,
                  "epoch": plan.epoch, "rules": list(plan.rules), "reasons": list(plan.reasons),
                  "predicted": {n: getattr(plan.predicted, n) for n in _PREDICTED},
                  "plan_ms": round((time.perf_counter() - t0) * 1e3, 4),
                  "fallback": fallback}  # fmt: skip
        if fallback:  # the plan is late already: its line is rendered on the log thread, not on the caller's time
            self._enqueue(("log", record))
            return
        log.info("decision", **record)
        if self._observers:
            self._enqueue(("observe", record))

    def _enqueue(self, item: tuple[str, dict[str, Any]]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:  # the thread is behind the decisions: drop and count, never wait
                self.observer_drops += 1

    def _observe(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, record = item
            if kind == "log":
                log.info("decision", **record)
            if self._observers:
                self.plugins.observe_decision(record)
            time.sleep(0)  # hand the lock to a planning thread between records: this thread never makes a plan wait

    def close(self, timeout: float = 2.0) -> None:
        """Stop the observer thread (records still queued are dropped)."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(timeout)
