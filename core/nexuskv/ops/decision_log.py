"""The decision log: one structured line per plan, and plugin observers fed off the hot path.

Each decision is rendered inline as a structlog line (a background renderer would compete for the GIL and
stall plans by whole switch intervals), except a fallback's: a plan that falls back is late already, so its
line is rendered on the log thread and the plan returns at once. Plugin observers are arbitrary code, so they
run on that thread too, behind a bounded queue: when it falls behind, records are dropped and counted
(`observer_drops`), never waited for. With a decision file, that thread also appends every record to it as a
JSON line, with the plan's inputs for the tenants that opted in (`decision_inputs`: what `nexuskv policy diff`
replays), after a `context` line naming the planner settings; and a shadow revision gets each plan's inputs.

For operators: the last `recent` records stay in a ring buffer (`recent(n)`); `subscribe()` streams every record
to a bounded `Subscription` fed from the log thread (drops counted, never waited for); `sample` and `level` say
which plans get a `decision` line (counts, the ring, the file, observers and subscribers see every plan); and
per-plan counts (action and reason class, fail-open reasons, tokens, deciding rules) are kept for the metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import stat
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs
import structlog

from nexuskv.contracts import Plan, PlanAction, Predicted
from nexuskv.errors import ConfigError
from nexuskv.logs import get_logger
from nexuskv.plugins.manager import PluginManager

if TYPE_CHECKING:
    from nexuskv.ops.capture import DecisionInputs
    from nexuskv.ops.replay import Replayer
    from nexuskv.ops.shadow import Shadow
    from nexuskv.policy.loader import Policies

__all__ = ["FAIL_OPEN_REASONS", "LEVELS", "PLAN_REASONS", "DecisionLog", "Subscription", "fail_open_reason",
           "plan_reason"]

log = get_logger("nexuskv.kernel")  # the decision lines keep the logger name operators filter on
# The decision lines also name their logger for stdlib routing: with `structlog.stdlib.LoggerFactory()` they go to
# `logging.getLogger("nexuskv.kernel")` (docs/operations.md); the default print logger ignores the name.
_lines = structlog.get_logger("nexuskv.kernel", component="nexuskv.kernel")
_PREDICTED = tuple(f.name for f in attrs.fields(Predicted))  # the record's `predicted`, without a generic walk
LEVELS = ("info", "debug", "off")  # the level of the `decision` lines ("off": none)
# Why a plan took its action, as a bounded label: materialize because reuse gains ("gain") or another tenant's
# shared state gains ("shared"); recompute or prefetch because nothing is reusable, the gain does not beat the
# minimum ("min_gain"), the policy allows no reuse ("policy") or loading would cost more ("transfer_cost"); or
# the plan failed open ("fail_open", with `FAIL_OPEN_REASONS` for why).
PLAN_REASONS = ("gain", "shared", "nothing_reusable", "min_gain", "policy", "transfer_cost", "fail_open")
FAIL_OPEN_REASONS = ("no_policies", "control_plane", "breaker", "deadline", "error")
_RECOMPUTE_REASONS = (("recompute: best G", "min_gain"), ("recompute: policy", "policy"),
                      ("recompute: reusing", "transfer_cost"))  # fmt: skip


def plan_reason(plan: Plan, fallback: bool = False) -> str:
    """The plan's reason class (one of `PLAN_REASONS`), from its action and reasons."""
    if fallback:
        return "fail_open"
    if plan.action is PlanAction.MATERIALIZE:
        return "gain" if plan.namespace is None else "shared"
    for reason in plan.reasons:
        if reason.startswith("recompute: "):
            for prefix, cls in _RECOMPUTE_REASONS:
                if reason.startswith(prefix):
                    return cls
    return "nothing_reusable"


def fail_open_reason(reason: str) -> str:
    """The class (one of `FAIL_OPEN_REASONS`) of a fallback's reason (`fail-open: ...`, as the read path words it)."""
    why = reason.removeprefix("fail-open: ")
    if why.startswith("no policy revision"):
        return "no_policies"
    if why.startswith("control plane"):
        return "control_plane"
    if " circuit open" in why:
        return "breaker"
    if why.startswith("deadline "):
        return "deadline"
    return "error"  # a stage raised: a plugin (keyer, matcher, CEL function) or a bug


class Subscription:
    """A bounded stream of decision records, fed from the decision log's thread: `get(timeout)` or iterate.

    When it is full, new records are dropped and counted (`drops`); the log never waits for a subscriber.
    Iteration ends once the subscription (or the log) is closed and what it holds was taken. Records are shared
    with the other consumers: treat them as read-only.
    """

    def __init__(self, owner: DecisionLog, maxsize: int = 1000) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be positive, not {maxsize}")
        self.maxsize = maxsize
        self._owner = owner
        self._items: deque[dict[str, Any]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.drops = 0

    @property
    def closed(self) -> bool:
        """True once closed (records still held can be taken)."""
        return self._closed

    def offer(self, record: dict[str, Any]) -> bool:
        """Hand one record over (the log's thread does); False when it was dropped (full or closed)."""
        with self._cv:
            if self._closed:
                return False
            if len(self._items) >= self.maxsize:
                self.drops += 1
                return False
            self._items.append(record)
            self._cv.notify()
            return True

    def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next record, waiting up to `timeout` seconds (None: until one comes or it is closed); None if none."""
        with self._cv:
            self._cv.wait_for(lambda: self._items or self._closed, timeout)
            return self._items.popleft() if self._items else None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while (record := self.get()) is not None:
            yield record

    def close(self) -> None:
        """Stop receiving records (waiting `get`s return what is held, then None). Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._owner._unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _private_append(path: str | os.PathLike[str]) -> IO[str]:
    """The decision file, opened to append, readable by its owner only (0600).

    It holds request ids, scopes and cache salts. A file that exists with wider permissions is narrowed to 0600,
    and the change is logged. A symlink, anything but a regular file (a FIFO would block the kernel) and a file
    another user owns, or one with other hard links, are refused with a `ConfigError`: the records never go where
    someone else can read them.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        why = "it is a symlink" if os.path.islink(path) else e.strerror
        raise ConfigError(f"decision file {os.fspath(path)!r}: cannot open it ({why})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"decision file {os.fspath(path)!r}: not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"decision file {os.fspath(path)!r}: owned by uid {st.st_uid}, not this user")
        if st.st_nlink > 1:  # a hard link planted at the path: the records would land in another of our files
            raise ConfigError(f"decision file {os.fspath(path)!r}: it has {st.st_nlink} hard links")
        os.set_blocking(fd, True)
        mode = st.st_mode & 0o777
        if mode & 0o077:
            os.fchmod(fd, 0o600)
            log.warning("decision file was readable by others; now 0600", file=str(path), was=oct(mode))
        return os.fdopen(fd, "a", encoding="utf-8", buffering=1)
    except BaseException:
        os.close(fd)
        raise


class DecisionLog:
    """Logs every plan and hands its record to plugin observers; counts decisions and dropped records."""

    def __init__(self, plugins: PluginManager, max_queued: int = 10_000, *, file: str | Path | None = None,
                 inputs_for: Iterable[str] = (), context: Replayer | None = None, node: str = "",
                 sample: float = 1.0, level: str = "info", recent: int = 100) -> None:  # fmt: skip
        """Start the observer thread.

        `file`: append records there; `inputs_for`: tenants (`*`: all) whose records carry their inputs;
        `context`: the planner settings written before the records (what a replay needs besides the inputs);
        `sample`: the fraction of plans whose `decision` line is logged (fallbacks' always are), `level` that
        line's level (`LEVELS`); `recent`: how many records `recent()` keeps.
        """
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample must be within [0, 1], not {sample}")
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
        self._sample_ppm = round(sample * 1_000_000)  # every plan adds it; a line each time it passes a million
        self._sample_acc = 0
        self._level = None if level == "off" else level  # looked up per line: the logging configuration may change
        self._recent: deque[dict[str, Any]] = deque(maxlen=max(recent, 0))
        self._subs: tuple[Subscription, ...] = ()
        self.subscriber_drops_closed = 0  # drops of subscriptions closed since (their counts leave with them)
        self._plans: dict[tuple[str, str], int] = {}  # (action, reason class) -> plans
        self._fail_open: dict[str, int] = {}  # fail-open reason class -> plans
        self._rules: dict[tuple[str, str], int] = {}  # (tenant, rule) -> plans the rule decided
        self._tokens = [0, 0]  # reused, recomputed
        self.plugins = plugins
        self.shadow: Shadow | None = None  # set by the kernel while a candidate revision is shadowed
        self._inputs_for = frozenset(inputs_for)
        self._all_inputs = "*" in self._inputs_for
        self._file = _private_append(file) if file is not None else None
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

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The last `n` decision records (all those kept when None), oldest first."""
        with self._lock:
            records = list(self._recent)
        return records if n is None else records[-n:] if n > 0 else []

    def subscribe(self, maxsize: int = 1000) -> Subscription:
        """A new stream of every decision record from now on, holding at most `maxsize` (see `Subscription`).

        Records are handed over on the log's thread, never on a planning thread. After `close`, the
        subscription is closed at once.
        """
        sub = Subscription(self, maxsize)
        with self._lock:
            if self._stop.is_set():
                sub._closed = True
            else:
                self._subs = (*self._subs, sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs = tuple(s for s in self._subs if s is not sub)
                self.subscriber_drops_closed += sub.drops

    def count_drops(self, n: int) -> None:
        """Count `n` records dropped downstream of a subscription in `subscriber_drops`.

        A forwarder's full stream (a sidecar worker's) drops records the log handed over: they count here too.
        """
        with self._lock:
            self.subscriber_drops_closed += n

    @property
    def subscriber_drops(self) -> int:
        """Records dropped because a subscriber's stream was full (closed subscriptions' included)."""
        with self._lock:  # one snapshot: a subscription closing meanwhile moves its drops, never loses them
            return self.subscriber_drops_closed + sum(s.drops for s in self._subs)

    def counts(self) -> dict[str, Any]:
        """Per-plan counts for the metrics.

        `plans` by (action, reason class), `fail_open` by reason class, `rules` by (policy, rule),
        `tokens_reused`, `tokens_recomputed`, and the drops.
        """
        with self._lock:
            out: dict[str, Any] = {"decisions": self._decisions, "plans": dict(self._plans),
                                   "fail_open": dict(self._fail_open), "rules": dict(self._rules),
                                   "tokens_reused": self._tokens[0], "tokens_recomputed": self._tokens[1],
                                   "observer_drops": self.observer_drops}  # fmt: skip
        out["subscriber_drops"] = self.subscriber_drops  # its own snapshot (the lock is not reentrant)
        out["file_errors"] = self.file_errors
        return out

    def wants_inputs(self, tenant: str) -> bool:
        """Whether a plan of `tenant` should hand its inputs over (a shadow runs, or its records carry them)."""
        return self.shadow is not None or (self._file is not None and (self._all_inputs or tenant in self._inputs_for))

    def record(self, plan: Plan, t0: float, fallback: bool = False, inputs: DecisionInputs | None = None,
               policies: Policies | None = None, policy: str | None = None) -> None:  # fmt: skip
        """Log `plan` (made since `perf_counter()` was `t0`) and queue it for the observers and the decision file.

        A fallback's line is rendered on the log thread (so it may follow lines logged after it). `inputs` go to
        the shadow (with `policies`, the revision the plan used) and, for tenants that opted in, the file.
        """
        record = {"decision_id": plan.decision_id, "request_id": plan.request_id, "tenant": plan.tenant,
                  "action": plan.action.value, "tokens_total": plan.tokens_total,
                  "tokens_reused": plan.tokens_reused, "policy_revision": plan.policy_revision,
                  "epoch": plan.epoch, "rules": list(plan.rules), "reasons": list(plan.reasons),
                  "predicted": {n: getattr(plan.predicted, n) for n in _PREDICTED},
                  "plan_ms": round((time.perf_counter() - t0) * 1e3, 4),
                  "fallback": fallback}  # fmt: skip
        key = (record["action"], plan_reason(plan, fallback))
        why = fail_open_reason(plan.reasons[0] if plan.reasons else "") if fallback else ""
        with self._lock:  # plans record from many threads: the counts stay exact
            self._decisions += 1
            self._plans[key] = self._plans.get(key, 0) + 1
            if fallback:
                self._fail_open[why] = self._fail_open.get(why, 0) + 1
            for rule in plan.rules:  # by the policy that decided (`policy`: the tenant's file, or `default`)
                rk = (policy or plan.tenant, rule)
                self._rules[rk] = self._rules.get(rk, 0) + 1
            self._tokens[0] += plan.tokens_reused
            self._tokens[1] += plan.tokens_total - plan.tokens_reused
            self._recent.append(record)
            line = False
            if not fallback:  # exactly `sample` of the other plans get a line, spread evenly
                self._sample_acc += self._sample_ppm
                line = self._sample_acc >= 1_000_000
                if line:
                    self._sample_acc -= 1_000_000
        shadow = self.shadow
        if inputs is not None and shadow is not None:
            shadow.offer(inputs, policies, plan.decision_id)
        keep = inputs if self._all_inputs or plan.tenant in self._inputs_for else None
        level = self._level
        if fallback:  # the plan is late already: its line is rendered on the log thread, not on the caller's time
            if level is not None or self._observers or self._file is not None or self._subs:
                self._enqueue((level is not None, record, None))
            return
        if line and level is not None:
            getattr(_lines, level)("decision", **record)
        if self._observers or self._file is not None or self._subs:
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
            if render and self._level is not None:
                getattr(_lines, self._level)("decision", **record)
            if self._file is not None:
                self._write(record, inputs)
            if self._observers:
                self.plugins.observe_decision(record)
            for sub in self._subs:
                sub.offer(record)
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
        for sub in self._subs:
            sub.close()  # what each holds can still be taken; then its iteration ends
        shadow, self.shadow = self.shadow, None
        if shadow is not None:
            shadow.close()
        if self._file is not None and not self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._file.close()
