"""Shadow evaluation and impact analysis: the same decisions under two policy revisions, and how they differ.

`Shadow` runs a candidate revision beside the live one on real traffic without touching a plan: the read path
hands each plan's inputs over (a bounded queue; when the shadow thread falls behind, inputs are dropped and
counted), and the shadow thread decides them again under the live revision and under the candidate, from the
same inputs, so every disagreement is the policies' doing and not the index's. `impact` does the same for
decision records written with their inputs (`nexuskv policy diff OLD NEW --decisions LOG`). Both count
disagreements with one `Disagreements`: by what changed (action, tokens reused, tier, deciding rules, shared
source) and by the rules responsible, with sampled examples.
"""

from __future__ import annotations

import collections
import queue
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from attrs import define, field

from nexuskv.logs import get_logger
from nexuskv.ops.capture import DecisionInputs
from nexuskv.ops.replay import Outcome, Replayer
from nexuskv.policy.loader import Policies

__all__ = ["Disagreements", "RuleDiff", "Shadow", "ShadowReport", "impact"]

log = get_logger("nexuskv.shadow")  # the component name operators filter on: stable

SETTINGS = "(no rule: min_gain_ms, default tier or share grants)"


@define(frozen=True)
class ShadowReport:
    """Counts of one comparison of two revisions (shadow evaluation, or `policy diff` over recorded decisions)."""

    baseline: str  # the live / OLD revision(s) compared against
    candidate: str
    compared: int  # decisions decided under both
    disagreed: int
    by_change: Mapping[str, int]  # action / tokens_reused / tier / rules / shared_from -> decisions
    by_rule: Mapping[str, int]  # rule -> decisions it decided differently under the two revisions
    transitions: Mapping[str, int]  # "materialize -> recompute" -> decisions
    examples: tuple[Mapping[str, Any], ...] = ()
    dropped: int = 0  # inputs the shadow thread could not keep up with
    incomplete: int = 0  # compared, but the candidate shares a scope the inputs did not record
    failed: int = 0  # inputs that could not be decided again (a replay error: logged)

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {"baseline": self.baseline, "candidate": self.candidate, "compared": self.compared,
                "disagreed": self.disagreed, "by_change": dict(self.by_change), "by_rule": dict(self.by_rule),
                "transitions": dict(self.transitions), "examples": [dict(e) for e in self.examples],
                "dropped": self.dropped, "incomplete": self.incomplete, "failed": self.failed}  # fmt: skip


@define
class Disagreements:
    """Counts disagreements between outcomes under two revisions; thread-safe."""

    max_examples: int = 20
    compared: int = 0
    disagreed: int = 0
    incomplete: int = 0
    failed: int = 0
    by_change: collections.Counter[str] = field(factory=collections.Counter)
    by_rule: collections.Counter[str] = field(factory=collections.Counter)
    transitions: collections.Counter[str] = field(factory=collections.Counter)
    examples: list[dict[str, Any]] = field(factory=list)
    _lock: threading.Lock = field(factory=threading.Lock, repr=False)

    def add(self, decision_id: str, tenant: str, old: Outcome, new: Outcome, incomplete: bool = False,
            blamed: list[str] | None = None) -> list[str]:  # fmt: skip
        """Count one decision; returns what changed (empty when the two agree).

        `blamed`: the rules responsible (`RuleDiff.blame`); by default those that decided under one revision only.
        """
        changes = old.changes(new)
        rules = blamed if blamed is not None else sorted(set(old.rules) ^ set(new.rules)) or [SETTINGS]
        with self._lock:
            self.compared += 1
            self.incomplete += incomplete
            if not changes:
                return changes
            self.disagreed += 1
            self.by_change.update(changes)
            self.by_rule.update(rules)
            if old.action != new.action:
                self.transitions[f"{old.action} -> {new.action}"] += 1
            if len(self.examples) < self.max_examples:
                self.examples.append({"decision_id": decision_id, "tenant": tenant, "changes": changes,
                                      "rules": rules, "before": str(old), "after": str(new)})  # fmt: skip
        return changes

    def fail(self) -> None:
        """Count a decision that could not be replayed."""
        with self._lock:
            self.failed += 1

    def report(self, baseline: str, candidate: str, dropped: int = 0) -> ShadowReport:
        """The counts so far."""
        with self._lock:
            return ShadowReport(baseline, candidate, self.compared, self.disagreed, dict(self.by_change),
                                dict(self.by_rule.most_common()), dict(self.transitions.most_common()),
                                tuple(dict(e) for e in self.examples), dropped, self.incomplete,
                                self.failed)  # fmt: skip


_VAR = re.compile(r"\bvariables\.([A-Za-z_]\w*)")


def _fingerprint(rule: Any, variables: Mapping[str, Any]) -> tuple[Any, ...]:
    """What defines a compiled rule's behaviour (not where it is written).

    Its settings, its expressions and the sources of every policy variable they read, transitively.
    """
    exprs = [rule.when, rule.message_fn, rule.max_tokens, rule.tier_fn, rule.ttl_fn, rule.priority_fn,
             rule.weight_fn, *rule.match]  # fmt: skip
    sources = tuple(c.source if c is not None else None for c in exprs)
    used: dict[str, str] = {}
    todo = [m.group(1) for src in sources if src for m in _VAR.finditer(src)]
    while todo:
        name = todo.pop()
        if name in used or name not in variables:
            continue
        used[name] = variables[name].source
        todo.extend(m.group(1) for m in _VAR.finditer(used[name]))
    return (rule.effect, rule.failure, rule.message, sources, rule.tier, rule.ttl_s, rule.priority, rule.scope,
            rule.tenants, rule.weight, tuple(sorted(used.items())))  # fmt: skip


class RuleDiff:
    """Which rules two revisions define differently, per tenant (cached: asked once per decision)."""

    def __init__(self, old: Policies | None, new: Policies) -> None:
        self.old, self.new = old, new
        self._edited: dict[tuple[str, str], frozenset[str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _rules(policies: Policies | None, tenant: str, kinds: Iterable[str]) -> dict[tuple[str, str], Any]:
        if policies is None or (tenant not in policies.sets and "default" not in policies.sets):
            return {}
        ps = policies.for_tenant(tenant)
        return {(k, r.name): _fingerprint(r, ps.variables.get(k, {})) for k in kinds for r in ps.rules.get(k, ())}

    def edited(self, tenant: str, kind: str = "reuse") -> frozenset[str]:
        """Names of `tenant`'s rules of `kind` added, removed or defined differently between the revisions."""
        with self._lock:
            got = self._edited.get((tenant, kind))
        if got is None:
            a, b = self._rules(self.old, tenant, (kind,)), self._rules(self.new, tenant, (kind,))
            got = frozenset(name for (_, name) in a.keys() | b.keys() if a.get((kind, name)) != b.get((kind, name)))
            with self._lock:
                self._edited[(tenant, kind)] = got
        return got

    def blame(self, tenant: str, old: Outcome, new: Outcome) -> list[str]:
        """The rules responsible for a disagreement.

        Reuse rules that decided under one revision only, or under either and are defined differently; the
        owner's share rules defined differently when the shared source changed.
        """
        either = set(old.rules) | set(new.rules)
        out = (set(old.rules) ^ set(new.rules)) | (either & self.edited(tenant))
        if old.shared_from != new.shared_from:
            for owner in {s.split("/", 1)[0] for s in (old.shared_from, new.shared_from) if s}:
                out |= {f"share {owner}/{name}" for name in self.edited(owner, "share")}
        return sorted(out) or [SETTINGS]

    def not_replayed(self) -> list[str]:
        """What differs that replayed plans cannot show, as `kind tenant/name`.

        Admit, place and route rules, and the settings only they read (`default_tier`, `failure`).
        """
        if self.old is None:
            return []
        out = []
        for tenant in sorted(set(self.old.sets) | set(self.new.sets)):
            a = self._rules(self.old, tenant, ("admit", "place", "route")) if tenant in self.old.sets else {}
            b = self._rules(self.new, tenant, ("admit", "place", "route")) if tenant in self.new.sets else {}
            out.extend(f"{kind} {tenant}/{name}" for (kind, name) in sorted(a.keys() | b.keys())
                       if a.get((kind, name)) != b.get((kind, name)))  # fmt: skip
            po, pn = self.old.sets.get(tenant), self.new.sets.get(tenant)
            for setting in ("default_tier", "failure"):
                if po is not None and pn is not None and getattr(po, setting) != getattr(pn, setting):
                    out.append(f"setting {tenant}/{setting}")
        return out


class Shadow:
    """A candidate revision evaluated beside the live one, on a thread of its own."""

    def __init__(self, candidate: Policies, replayer: Replayer, *, max_queued: int = 1000, log_every: int = 100,
                 max_examples: int = 20) -> None:  # fmt: skip
        """`log_every`: one disagreement in this many is logged (the first of each rule always is)."""
        self.candidate = candidate
        self.replayer = replayer
        self.log_every = max(1, log_every)
        self.counts = Disagreements(max_examples)
        self.dropped = 0
        self._baselines: set[str] = set()
        self._logged_rules: set[str] = set()
        self._diff: RuleDiff | None = None  # for the live revision last seen
        self._queue: queue.Queue[tuple[DecisionInputs, Policies | None, str] | None] = queue.Queue(max_queued)
        self._idle = threading.Condition()
        self._busy = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="nexuskv-shadow", daemon=True)
        self._thread.start()

    def offer(self, inputs: DecisionInputs, live: Policies | None, decision_id: str) -> None:
        """Queue one plan's inputs (never blocks: dropped and counted when the shadow thread is behind, or closed)."""
        with self._idle:  # put under the lock (it never blocks): close() cannot slip in between
            if self._closed:
                self.dropped += 1
                return
            try:
                self._queue.put_nowait((inputs, live, decision_id))
            except queue.Full:
                self.dropped += 1
                return
            self._busy += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._compare(*item)
            except Exception:  # never lose the thread: the input is counted as failed
                log.exception("shadow evaluation failed", decision_id=item[2])
                self.counts.fail()
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _compare(self, inputs: DecisionInputs, live: Policies | None, decision_id: str) -> None:
        before, _ = self.replayer.decide(inputs, live)
        after, missing = self.replayer.decide(inputs, self.candidate)
        tenant = inputs.request.tenant
        if live is not None:
            with self._idle:
                self._baselines.add(live.revision)
        old = Outcome.of(before, self.replayer.tier_order)
        new = Outcome.of(after, self.replayer.tier_order)
        diff = self._diff
        if diff is None or diff.old is not live:  # the latest live revision only: a reload replaces it
            diff = self._diff = RuleDiff(live, self.candidate)
        rules = diff.blame(tenant, old, new)
        changes = self.counts.add(decision_id, tenant, old, new, incomplete=bool(missing), blamed=rules)
        if changes:
            first = not self._logged_rules.issuperset(rules)
            if first or self.counts.disagreed % self.log_every == 0:
                self._logged_rules.update(rules)
                log.warning("shadow disagreement", decision_id=decision_id, tenant=tenant, changes=changes,
                            rules=rules, live=str(old), candidate=str(new),
                            candidate_revision=self.candidate.revision)  # fmt: skip

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every input offered so far is compared (tests, and `report` callers who want it exact)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def report(self) -> ShadowReport:
        """Disagreements so far."""
        with self._idle:
            baselines = ",".join(sorted(self._baselines))
        return self.counts.report(baselines, self.candidate.revision, self.dropped)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the shadow thread (inputs still queued are not compared); never raises."""
        with self._idle:
            if self._closed:  # closed already: the stop marker is queued or consumed
                return
            self._closed = True  # no offer gets in after this
        while True:
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:  # make room for the stop marker: what is dropped was never going to be compared
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    continue
                with self._idle:
                    self._busy -= 1
                    self.dropped += 1
                    self._idle.notify_all()
        self._thread.join(timeout)


def impact(records: Iterable[Mapping[str, Any]], old: Policies, new: Policies, *,
           max_examples: int = 20) -> tuple[ShadowReport, dict[str, int]]:  # fmt: skip
    """Replay decision records (from a decision file) under `old` and `new`; the report and skip counts.

    Records are the file's lines: a `context` line (the kernel's planner settings) precedes the decisions it
    made. Decisions without inputs, fallbacks, and decisions before any context line are skipped and counted.
    `skipped["differs_from_record"]` counts decisions whose replay under `old` is not what was recorded (the log
    came from another revision, or from state the inputs do not capture).
    """
    counts = Disagreements(max_examples)
    skipped: collections.Counter[str] = collections.Counter()
    replayer: Replayer | None = None
    diff = RuleDiff(old, new)
    for rec in records:
        kind = rec.get("record")
        if kind == "context":
            try:
                replayer = Replayer.from_json(rec["planner"])
            except Exception as exc:  # decisions after it cannot be priced as they were: skipped, counted
                replayer = None
                log.warning("unusable context line in the decision file", line=rec.get("line"),
                            error=f"{type(exc).__name__}: {exc}")  # fmt: skip
            continue
        if kind == "unreadable":
            skipped["unreadable lines"] += 1
            continue
        if kind != "decision":
            continue
        if rec.get("fallback"):
            skipped["fallbacks"] += 1
            continue
        if "inputs" not in rec:
            skipped["without inputs"] += 1
            continue
        if replayer is None:
            skipped["without a usable context line"] += 1
            continue
        try:
            inputs = DecisionInputs.from_json(rec["inputs"])
            before, _ = replayer.decide(inputs, old)
            after, missing = replayer.decide(inputs, new)
        except Exception as exc:
            log.warning("decision not replayable", decision_id=rec.get("decision_id"), error=f"{type(exc).__name__}: "
                        f"{exc}")  # fmt: skip
            counts.fail()
            continue
        if (before.action.value, before.tokens_reused) != (rec.get("action"), rec.get("tokens_reused")):
            skipped["differs_from_record"] += 1
        tenant = str(rec.get("tenant", ""))
        old_outcome, new_outcome = Outcome.of(before, replayer.tier_order), Outcome.of(after, replayer.tier_order)
        counts.add(str(rec.get("decision_id", "")), tenant, old_outcome, new_outcome, incomplete=bool(missing),
                   blamed=diff.blame(tenant, old_outcome, new_outcome))  # fmt: skip
    return counts.report(old.revision, new.revision), dict(skipped)
