"""The decision log: one structured line per plan, and plugin observers fed off the hot path.

Each decision is rendered inline as a structlog line (a background renderer would compete for the GIL and
stall plans by whole switch intervals), except a fallback's: a plan that falls back is late already, so its
line is rendered on the log thread and the plan returns at once. Plugin observers are arbitrary code, so they
run on that thread too, behind a bounded queue: when it falls behind, records are dropped and counted
(`observer_drops`), never waited for. With a decision file, that thread also appends every record to it as a
JSON line, with the plan's inputs for the tenants that opted in (`decision_inputs`: what `nexuskv policy diff`
replays), after a `context` line naming the planner settings; and a shadow revision gets each plan's inputs.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from nexuskv.contracts import Plan, Predicted
from nexuskv.logs import get_logger
from nexuskv.plugins import PluginManager

if TYPE_CHECKING:
    from nexuskv.policy.loader import Policies
    from nexuskv.replay import DecisionInputs, Replayer
    from nexuskv.shadow import Shadow

__all__ = ["DecisionLog"]

log = get_logger("nexuskv.kernel")  # the decision lines keep the logger name operators filter on
_PREDICTED = tuple(f.name for f in attrs.fields(Predicted))  # the record's `predicted`, without a generic walk


class DecisionLog:
    """Logs every plan and hands its record to plugin observers; counts decisions and dropped records."""

    def __init__(self, plugins: PluginManager, max_queued: int = 10_000, *, file: str | Path | None = None,
                 inputs_for: Iterable[str] = (), context: Replayer | None = None, node: str = "") -> None:  # fmt: skip
        """Start the observer thread.

        `file`: append records there; `inputs_for`: tenants (`*`: all) whose records carry their inputs;
        `context`: the planner settings written before the records (what a replay needs besides the inputs).
        """
        self.plugins = plugins
        self.shadow: Shadow | None = None  # set by the kernel while a candidate revision is shadowed
        self._inputs_for = frozenset(inputs_for)
        self._all_inputs = "*" in self._inputs_for
        self._file = open(file, "a", encoding="utf-8", buffering=1) if file is not None else None  # noqa: SIM115
        if self._file is not None:
            context_line = {"record": "context", "node": node, "at": time.time(),
                            "planner": context.to_json() if context is not None else None}  # fmt: skip
            self._file.write(json.dumps(context_line) + "\n")
        self.file_errors = 0
        self._lock = threading.Lock()  # plans log from many threads: the counts stay exact
        self._decisions = 0
        self.observer_drops = 0
        self._observers = bool(plugins.pm.hook.nexuskv_observe_decision.get_hookimpls())  # fallbacks go to them too
        self._queue: queue.Queue[tuple[bool, dict[str, Any], DecisionInputs | None] | None] = queue.Queue(max_queued)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._observe, name="nexuskv-observers", daemon=True)
        self._thread.start()

    @property
    def decisions(self) -> int:
        """How many plans were logged (fallbacks included)."""
        return self._decisions

    def wants_inputs(self, tenant: str) -> bool:
        """Whether a plan of `tenant` should hand its inputs over (a shadow runs, or its records carry them)."""
        return self.shadow is not None or (self._file is not None and (self._all_inputs or tenant in self._inputs_for))

    def record(self, plan: Plan, t0: float, fallback: bool = False, inputs: DecisionInputs | None = None,
               policies: Policies | None = None) -> None:  # fmt: skip
        """Log `plan` (made since `perf_counter()` was `t0`) and queue it for the observers and the decision file.

        A fallback's line is rendered on the log thread (so it may follow lines logged after it). `inputs` go to
        the shadow (with `policies`, the revision the plan used) and, for tenants that opted in, the file.
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
        shadow = self.shadow
        if inputs is not None and shadow is not None:
            shadow.offer(inputs, policies, plan.decision_id)
        keep = inputs if self._all_inputs or plan.tenant in self._inputs_for else None
        if fallback:  # the plan is late already: its line is rendered on the log thread, not on the caller's time
            self._enqueue((True, record, None))
            return
        log.info("decision", **record)
        if self._observers or self._file is not None:
            self._enqueue((False, record, keep))

    def _enqueue(self, item: tuple[bool, dict[str, Any], DecisionInputs | None]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:  # the thread is behind the decisions: drop and count, never wait
                self.observer_drops += 1

    def _observe(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    return  # closing, and everything queued is done
                continue
            if item is None:
                return
            render, record, inputs = item
            if render:
                log.info("decision", **record)
            if self._file is not None:
                self._write(record, inputs)
            if self._observers:
                self.plugins.observe_decision(record)
            time.sleep(0)  # hand the lock to a planning thread between records: this thread never makes a plan wait

    def _write(self, record: dict[str, Any], inputs: DecisionInputs | None) -> None:
        line = {"record": "decision", **record}
        try:
            if inputs is not None:
                line["inputs"] = inputs.to_json()
            self._file.write(json.dumps(line) + "\n")  # type: ignore[union-attr]
        except Exception as exc:  # a full disk or an unserialisable plugin value never stops the decisions
            self.file_errors += 1
            if self.file_errors == 1:
                log.error("decision file write failed", error=f"{type(exc).__name__}: {exc}")

    def close(self, timeout: float = 2.0) -> None:
        """Stop the observer thread (after the records queued, within `timeout`) and the shadow; close the file.

        Never raises. The file is closed only once the thread has stopped (an observer stuck past the timeout
        keeps it open rather than have the thread write to a closed file).
        """
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)  # waits for room while the thread drains
        self._thread.join(timeout)
        shadow, self.shadow = self.shadow, None
        if shadow is not None:
            shadow.close()
        if self._file is not None and not self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._file.close()
