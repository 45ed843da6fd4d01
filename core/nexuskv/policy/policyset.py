"""A tenant's compiled policy: rules of its file and its parents, type-checked, evaluated into a `Verdict`.

Each rule kind sees its own variables (`state`, `request`, `match`, `tier`, `node`, `cost`, `now`, and the
policy's named `variables`, evaluated lazily and at most once per evaluation). Evaluation errors follow the
rule's `failure` setting; the safe default turns an error into an enforced deny (no store, no reuse).
"""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import define

from nexuskv.cel import STRING, TIMESTAMP, CelEvalError, CelType, Compiled, Env, FunctionDecl, fuse, message_type
from nexuskv.contracts import Predicted, Request, StateDescriptor
from nexuskv.logs import get_logger
from nexuskv.policy import fused_rules
from nexuskv.policy.model import Candidate, Failure, PolicyFile, RouteTarget
from nexuskv.policy.pause import pause
from nexuskv.policy.verdict import Placement, Verdict

__all__ = ["KINDS", "CompiledRule", "PolicySet", "RuleSource", "kind_env"]

log = get_logger("nexuskv.policy.policyset")  # the component name operators filter on: stable

KINDS = ("admit", "reuse", "place", "share", "route")

_COMMON: dict[str, CelType] = {"request": message_type(Request), "node": STRING, "now": TIMESTAMP}
_PER_KIND: dict[str, dict[str, CelType]] = {
    "admit": {"state": message_type(StateDescriptor)},
    "place": {"state": message_type(StateDescriptor)},
    "reuse": {"match": message_type(Candidate), "tier": STRING, "cost": message_type(Predicted)},
    "share": {"match": message_type(Candidate)},
    "route": {"target": message_type(RouteTarget)},
}


def kind_env(kind: str, functions: Mapping[str, FunctionDecl] | None = None) -> Env:
    """The declarations a rule of `kind` is checked against (without the policy's own variables)."""
    return Env({**_COMMON, **_PER_KIND[kind]}, functions or {})


@define(frozen=True)
class RuleSource:
    """One file of an `extends` chain, as read."""

    model: PolicyFile
    path: str
    text: str
    revision: str


class _Variables:
    """Base of the `variables` value of one evaluation: each variable is computed on first use, at most once.

    Each policy kind gets a subclass whose attributes are `_LazyVariable` descriptors; the first access stores
    the value in the instance dict, which then shadows the descriptor (plain attribute speed afterwards).
    """

    __slots__ = ("__dict__", "_act")

    def __init__(self, act: dict[str, Any]) -> None:
        self._act = act


class _LazyVariable:
    __slots__ = ("fn", "name")

    def __init__(self, name: str, fn: Callable[[Mapping[str, object]], object]) -> None:
        self.name = name
        self.fn = fn

    def __get__(self, obj: _Variables | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        errors = obj.__dict__.get(" errors")  # not an identifier: never shadows a variable
        if errors is not None and self.name in errors:
            raise errors[self.name]  # failed once in this evaluation: never computed twice
        try:
            value = self.fn(obj._act)
        except CelEvalError as exc:
            err = CelEvalError(f"variable {self.name!r}: {exc}")
            obj.__dict__.setdefault(" errors", {})[self.name] = err
            raise err from None
        obj.__dict__[self.name] = value
        return value


def _variables_class(kind: str, fns: Mapping[str, Compiled]) -> type[_Variables] | None:
    if not fns:
        return None
    attrs_ = {name: _LazyVariable(name, f.fn) for name, f in fns.items()}
    return type(f"Variables_{kind}", (_Variables,), attrs_)


_DENY, _WARN, _AUDIT, _ALLOW, _WEIGHT = 0, 1, 2, 3, 4
_new = tuple.__new__  # builds a Verdict without the NamedTuple constructor's Python frame
_EFFECT_CODE = {"deny": _DENY, "warn": _WARN, "audit": _AUDIT, "allow": _ALLOW, "apply": _DENY, "exclude": _DENY,
                "weight": _WEIGHT}


@define(frozen=True)
class CompiledRule:
    """One rule as compiled: its expressions, effect and settings (built by `compiler`)."""

    name: str
    kind: str
    file: str
    match: tuple[Compiled, ...]
    when: Compiled
    effect: str
    failure: Failure
    message: str
    message_fn: Compiled | None = None
    max_tokens: Compiled | None = None
    tier: str | None = None
    tier_fn: Compiled | None = None
    ttl_s: float | None = None
    ttl_fn: Compiled | None = None
    priority: float | None = None
    priority_fn: Compiled | None = None
    scope: str = ""
    tenants: tuple[str, ...] = ()
    weight: float | None = None
    weight_fn: Compiled | None = None


class PolicySet:
    """The compiled rules of one policy (a tenant's file plus everything it extends)."""

    def __init__(
        self,
        name: str,
        revision: str,
        rules: Mapping[str, Sequence[CompiledRule]],
        variables: Mapping[str, Mapping[str, Compiled]],
        settings: Mapping[str, Any],
        files: Sequence[str],
    ) -> None:
        self.name = name
        self.revision = revision
        self.rules = {k: tuple(v) for k, v in rules.items()}
        self.variables = variables
        self.failure: Failure = settings["failure"]
        self.min_gain_ms: float = settings["min_gain_ms"]
        self.default_tier: str = settings["default_tier"]
        self.files = tuple(files)
        self._uses_now = {k: any(_uses(r, "now") for r in v) or any("now" in f.source for f in variables[k].values())
                          for k, v in self.rules.items()}  # fmt: skip
        self._vars = {k: _variables_class(k, variables[k]) for k in self.rules}
        # Hot-loop form of each rule: the generated functions themselves, effect as a small int.
        self._fast = {
            k: tuple((r, tuple(m.fn for m in r.match), r.when.fn, r.max_tokens.fn if r.max_tokens else None,
                      _EFFECT_CODE[r.effect]) for r in v)
            for k, v in self.rules.items()
        }  # fmt: skip
        # Every rule's `match and when` of a kind in one generated function: one call per evaluation.
        self._fused = {}
        for k, v in self.rules.items():
            self._fused[k] = fuse([[*r.match, r.when] for r in v])
            pause()
        self._quiet = {k: Verdict(k, name, revision, allowed=k != "share") for k in self.rules}
        # admit, reuse and place, the kinds on the hot paths, run as one generated function each.
        self._generated = {}
        for k in ("admit", "reuse", "place"):
            self._generated[k] = fused_rules.build(
                k, self.rules[k], policy=name, revision=revision, default_tier=self.default_tier,
                variables_class=self._vars[k], variables=variables[k], uses_now=self._uses_now[k],
                slow=lambda act, known, k=k: self._evaluate_activation(k, self._seeded(k, act, known)))
            pause()  # fmt: skip

    def rule_names(self, kind: str) -> list[str]:
        """Names of the rules of one kind, in evaluation order."""
        return [r.name for r in self.rules[kind]]

    def activation(self, kind: str, values: Mapping[str, Any]) -> dict[str, Any]:
        """The full activation of an evaluation: defaults for `node` / `now`, and lazy `variables`."""
        act = dict(values)
        if "node" not in act:
            act["node"] = ""
        if "now" not in act and self._uses_now[kind]:
            act["now"] = _dt.datetime.now(_dt.UTC)
        cls = self._vars[kind]
        if cls is not None:
            act["variables"] = cls(act)
        return act

    def evaluate(self, kind: str, values: Mapping[str, Any]) -> Verdict:
        """Evaluate every rule of `kind` against `values` and return the verdict (never raises on rule errors)."""
        gen = self._generated.get(kind)
        if gen is not None:
            return gen(values)
        if kind not in self._fast:
            raise ValueError(f"unknown rule kind {kind!r} (one of {', '.join(KINDS)})")
        return self._evaluate_activation(kind, self.activation(kind, values))

    def _seeded(self, kind: str, values: Mapping[str, Any], known: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
        """A full activation whose `variables` already hold what the generated fast path computed."""
        act = self.activation(kind, values)
        cached = act["variables"].__dict__ if "variables" in act else {}
        for name, value in known:
            if value is not fused_rules.UNSET:
                cached[name] = value
        return act

    def _evaluate_activation(self, kind: str, act: dict[str, Any]) -> Verdict:
        """Rule by rule, with each expression's exact CEL error semantics (and the `failure` settings)."""
        rules = self._fast[kind]
        if kind == "place":
            return self._place(act)
        if kind == "route":
            return self._route(act)
        flags = self._fused[kind](act)
        if flags is not None:
            if not any(flags):  # the common case: nothing fires, nothing to build
                return self._quiet[kind]
            rules = tuple(r for r, f in zip(rules, flags, strict=True) if f)
        deny = kind != "share"
        allowed = deny  # admit/reuse: allowed unless denied; share: denied unless granted
        cap: int | None = None
        deciding: list[str] = []
        fired: list[str] = []
        messages: list[str] = []
        warnings: list[str] = []
        audits: list[str] = []
        errors: list[str] = []
        for rule, matches, when, cap_fn, code in rules:
            if not deny and not _share_applies(rule, act):
                continue  # a grant names its readers and its scope: nobody else gets anything from it
            try:
                for m in matches if flags is None else ():
                    if not m(act):
                        break
                else:
                    if flags is None and not when(act):
                        continue
                    limit = int(cap_fn(act)) if cap_fn is not None else None  # type: ignore[call-overload]
                    fired.append(rule.name)
                    msg = _message(rule, act) if rule.message_fn is not None or rule.message else ""
                    if code == _DENY:
                        deciding.append(rule.name)
                        if msg:
                            messages.append(msg)
                        if limit is None:
                            allowed, cap = False, 0
                        else:
                            cap = max(0, limit) if cap is None else min(cap, max(0, limit))
                            if cap == 0:
                                allowed = False
                    elif code == _WARN:
                        warnings.append(f"{rule.name}: {msg}" if msg else rule.name)
                    elif code == _AUDIT:
                        audits.append(f"{rule.name}: {msg}" if msg else rule.name)
                    else:  # share grant
                        allowed = True
                        deciding.append(rule.name)
            except CelEvalError as exc:
                errors.append(f"{rule.name}: {exc}")
                log.warning("policy rule failed", policy=self.name, rule=rule.name, kind=kind, error=str(exc),
                            failure=rule.failure.value)  # fmt: skip
                if rule.failure is Failure.DENY and deny:
                    allowed, cap = False, 0
                    deciding.append(rule.name)
                    messages.append(f"{rule.name}: evaluation failed ({exc}); failing safe")
        return _new(Verdict, (kind, self.name, self.revision, allowed, cap, tuple(deciding), tuple(fired),
                              tuple(messages), tuple(warnings), tuple(audits), tuple(errors), None, None))  # fmt: skip

    def _route(self, act: dict[str, Any]) -> Verdict:
        """Every firing rule counts.

        An `exclude` (or a failed rule with `failure = "deny"`) rules the node out, each `weight` multiplies its
        predicted TTFT, audits are recorded.
        """
        allowed, weight = True, None
        deciding: list[str] = []
        fired: list[str] = []
        messages: list[str] = []
        audits: list[str] = []
        errors: list[str] = []
        for rule, matches, when, _, code in self._fast["route"]:
            try:
                if not all(m(act) for m in matches) or not when(act):
                    continue
                w = None
                if code == _WEIGHT:  # only a weight rule's multiplier is computed (and can fail)
                    w = float(rule.weight_fn.fn(act)) if rule.weight_fn is not None else rule.weight  # type: ignore[arg-type]
                    if w is None or not 0.0 < w < math.inf:
                        raise CelEvalError(f"weight must be a finite number > 0, got {w!r}")
            except CelEvalError as exc:
                errors.append(f"{rule.name}: {exc}")
                log.warning("policy rule failed", policy=self.name, rule=rule.name, kind="route", error=str(exc),
                            failure=rule.failure.value)  # fmt: skip
                if rule.failure is Failure.DENY:
                    allowed = False
                    deciding.append(rule.name)
                    messages.append(f"{rule.name}: evaluation failed ({exc}); node excluded")
                continue
            fired.append(rule.name)
            text = f"{rule.name}: {rule.message}" if rule.message else rule.name
            if code == _AUDIT:
                audits.append(text)
            elif code == _WEIGHT:
                weight = (weight or 1.0) * w  # type: ignore[operator]
                deciding.append(rule.name)
                messages.append(f"{text} (x{w:g})")
            else:
                allowed = False
                deciding.append(rule.name)
                messages.append(text)
        return Verdict("route", self.name, self.revision, allowed, None, tuple(deciding), tuple(fired),
                       tuple(messages), (), tuple(audits), tuple(errors), None, weight)  # fmt: skip

    def _place(self, act: dict[str, Any]) -> Verdict:
        fired: list[str] = []
        audits: list[str] = []
        errors: list[str] = []
        flags = self._fused["place"](act)
        for i, (rule, matches, when, _, code) in enumerate(self._fast["place"]):
            try:
                if flags is not None:
                    if not flags[i]:
                        continue
                elif not all(m(act) for m in matches) or not when(act):
                    continue
                tier = rule.tier_fn.fn(act) if rule.tier_fn is not None else rule.tier
                ttl = rule.ttl_fn.fn(act).total_seconds() if rule.ttl_fn is not None else rule.ttl_s  # type: ignore[attr-defined]
                prio = float(rule.priority_fn.fn(act)) if rule.priority_fn is not None else rule.priority  # type: ignore[arg-type]
            except CelEvalError as exc:
                errors.append(f"{rule.name}: {exc}")
                log.warning("policy rule failed", policy=self.name, rule=rule.name, kind="place", error=str(exc))
                continue  # a broken place rule never decides: the next rule or the default applies
            fired.append(rule.name)
            if code == _AUDIT:
                audits.append(f"{rule.name}: would place in {tier} (ttl {ttl}, priority {prio})")
                continue
            where = _new(Placement, (tier or self.default_tier or None, ttl, prio))
            return _new(Verdict, ("place", self.name, self.revision, True, None, (rule.name,), tuple(fired), (), (),
                                  tuple(audits), tuple(errors), where, None))  # fmt: skip
        return Verdict("place", self.name, self.revision, True, None, (), tuple(fired), (), (), tuple(audits),
                       tuple(errors), Placement(self.default_tier or None))  # fmt: skip

    def grants(self, reader: str) -> list[tuple[str, str]]:
        """`(rule, scope)` of share rules that name `reader` (or `*`); `share_granted` decides per request."""
        return [(r.name, r.scope) for r in self.rules["share"] if reader in r.tenants or "*" in r.tenants]

    def share_granted(self, request: Request, owner: str, scope: str, blocks: int, now: Any = None) -> bool:
        """True when these (the owner's) `share` rules grant `request` the first `blocks` blocks of `scope`.

        `now`: the time the rules see (default: the clock; a replay passes the recorded time).
        """
        view = Candidate(tokens=blocks * request.layout.page_size, blocks=blocks, owner=owner, scope=scope,
                         shared=True, kind=request.layout.kind)  # fmt: skip
        values = {"request": request, "match": view} if now is None else {"request": request, "match": view,
                                                                          "now": now}  # fmt: skip
        return self.evaluate("share", values).allowed


def _share_applies(rule: CompiledRule, act: Mapping[str, Any]) -> bool:
    """Whether a share rule is about this reader (`request.tenant`) and this candidate's scope (`match.scope`)."""
    reader = getattr(act.get("request"), "tenant", None)
    scope = getattr(act.get("match"), "scope", None)
    return (reader in rule.tenants or "*" in rule.tenants) and scope == rule.scope


def _fires(rule: CompiledRule, act: dict[str, Any]) -> bool:
    for m in rule.match:
        if not m(act):
            return False
    return bool(rule.when(act))


def _message(rule: CompiledRule, act: dict[str, Any]) -> str:
    if rule.message_fn is not None:
        try:
            return str(rule.message_fn(act))
        except CelEvalError as exc:
            return f"{rule.message} (message_expr failed: {exc})".strip()
    return rule.message


def _uses(rule: CompiledRule, name: str) -> bool:
    fns = [*rule.match, rule.when, rule.message_fn, rule.max_tokens, rule.tier_fn, rule.ttl_fn, rule.priority_fn,
           rule.weight_fn]
    return any(f is not None and re.search(rf"\b{name}\b", f.source) for f in fns)
