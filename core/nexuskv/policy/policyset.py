"""A tenant's compiled policy: rules of its file and its parents, type-checked, evaluated into a `Verdict`.

Each rule kind sees its own variables (`state`, `request`, `match`, `tier`, `node`, `cost`, `now`, and the
policy's named `variables`, evaluated lazily and at most once per evaluation). Evaluation errors follow the
rule's `failure` setting; the safe default turns an error into an enforced deny (no store, no reuse).
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import define

from nexuskv.contracts import Predicted, Request, StateDescriptor
from nexuskv.logs import get_logger
from nexuskv.policy import _fastpath, _tomlpos
from nexuskv.policy.cel import CelError, CelEvalError, Compiled, compile_expr, fuse
from nexuskv.policy.model import (
    Candidate,
    Failure,
    PolicyFile,
)
from nexuskv.policy.types import (
    BOOL,
    DOUBLE,
    DURATION,
    INT,
    STRING,
    TIMESTAMP,
    CelType,
    Env,
    FunctionDecl,
    message_type,
    record_type,
)
from nexuskv.policy.verdict import Placement, Verdict

__all__ = ["KINDS", "PolicySet", "RuleSource", "compile_policy", "kind_env"]

log = get_logger(__name__)

KINDS = ("admit", "reuse", "place", "share")
DEFAULT_COST_LIMIT = 10_000

_COMMON: dict[str, CelType] = {"request": message_type(Request), "node": STRING, "now": TIMESTAMP}
_PER_KIND: dict[str, dict[str, CelType]] = {
    "admit": {"state": message_type(StateDescriptor)},
    "place": {"state": message_type(StateDescriptor)},
    "reuse": {"match": message_type(Candidate), "tier": STRING, "cost": message_type(Predicted)},
    "share": {"match": message_type(Candidate)},
}
_VAR_REF = re.compile(r"\bvariables\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")


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


_DENY, _WARN, _AUDIT, _ALLOW = 0, 1, 2, 3
_new = tuple.__new__  # builds a Verdict without the NamedTuple constructor's Python frame
_EFFECT_CODE = {"deny": _DENY, "warn": _WARN, "audit": _AUDIT, "allow": _ALLOW, "apply": _DENY}


@define(frozen=True)
class _Rule:
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


class PolicySet:
    """The compiled rules of one policy (a tenant's file plus everything it extends)."""

    def __init__(
        self,
        name: str,
        revision: str,
        rules: Mapping[str, Sequence[_Rule]],
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
        self._fused = {k: fuse([[*r.match, r.when] for r in v]) for k, v in self.rules.items()}
        self._quiet = {k: Verdict(k, name, revision, allowed=k != "share") for k in self.rules}
        # admit, reuse and place, the kinds on the hot paths, run as one generated function each.
        self._generated = {
            k: _fastpath.build(k, self.rules[k], policy=name, revision=revision, default_tier=self.default_tier,
                               variables_class=self._vars[k], variables=variables[k], uses_now=self._uses_now[k],
                               slow=lambda act, known, k=k: self._evaluate_activation(k, self._seeded(k, act, known)))
            for k in ("admit", "reuse", "place")
        }  # fmt: skip

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
            if value is not _fastpath.UNSET:
                cached[name] = value
        return act

    def _evaluate_activation(self, kind: str, act: dict[str, Any]) -> Verdict:
        """Rule by rule, with each expression's exact CEL error semantics (and the `failure` settings)."""
        rules = self._fast[kind]
        if kind == "place":
            return self._place(act)
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
                              tuple(messages), tuple(warnings), tuple(audits), tuple(errors), None))  # fmt: skip

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
                                  tuple(audits), tuple(errors), where))  # fmt: skip
        return Verdict("place", self.name, self.revision, True, None, (), tuple(fired), (), (), tuple(audits),
                       tuple(errors), Placement(self.default_tier or None))  # fmt: skip

    def grants(self, reader: str) -> list[tuple[str, str]]:
        """`(rule, scope)` of share rules that name `reader` (or `*`); `evaluate("share", ...)` decides."""
        return [(r.name, r.scope) for r in self.rules["share"] if reader in r.tenants or "*" in r.tenants]


def _share_applies(rule: _Rule, act: Mapping[str, Any]) -> bool:
    """Whether a share rule is about this reader (`request.tenant`) and this candidate's scope (`match.scope`)."""
    reader = getattr(act.get("request"), "tenant", None)
    scope = getattr(act.get("match"), "scope", None)
    return (reader in rule.tenants or "*" in rule.tenants) and scope == rule.scope


def _fires(rule: _Rule, act: dict[str, Any]) -> bool:
    for m in rule.match:
        if not m(act):
            return False
    return bool(rule.when(act))


def _message(rule: _Rule, act: dict[str, Any]) -> str:
    if rule.message_fn is not None:
        try:
            return str(rule.message_fn(act))
        except CelEvalError as exc:
            return f"{rule.message} (message_expr failed: {exc})".strip()
    return rule.message


def _uses(rule: _Rule, name: str) -> bool:
    fns = [*rule.match, rule.when, rule.message_fn, rule.max_tokens, rule.tier_fn, rule.ttl_fn, rule.priority_fn]
    return any(f is not None and re.search(rf"\b{name}\b", f.source) for f in fns)


# ------------------------------------------------------------------------------------------------ compiling


def _locate_text(text: str, rule: str, expr: str, line: int | None, col: int | None) -> tuple[int | None, int | None]:
    """Fallback position (inline tables, unusual layouts): the expression's first line after the rule's name."""
    start = 0
    if rule:
        m = re.search(rf"""^\s*name\s*=\s*["']{re.escape(rule)}["']""", text, re.M)
        if m:
            start = m.start()
    first = expr.splitlines()[0] if expr else ""
    pos = text.find(first, start) if first else -1
    if pos < 0:
        pos = text.find(first) if first else -1
    if pos < 0:
        return (text.count("\n", 0, start) + 1 if rule else None), None
    base_line, base_col = _tomlpos.file_position(text, pos)
    line = line or 1
    if line == 1:
        return base_line, base_col + (col or 1) - 1
    return base_line + line - 1, col


def _expr_index(expr: str, line: int | None, col: int | None) -> int:
    """Character index in `expr` of the 1-based (line, col) of a CEL error (0 when unknown)."""
    if line is None:
        return 0
    lines = expr.split("\n")
    return sum(len(ln) + 1 for ln in lines[: line - 1]) + (col or 1) - 1


def _locate(
    text: str,
    where: tuple[str, str, str | None, int | None, int],
    expr: str = "",
    line: int | None = None,
    col: int | None = None,
) -> tuple[int | None, int | None]:
    """File line and column of position (line, col) inside `expr`, the value of a key of a rule or variable.

    `where` is (kind, rule, key, index, occurrence): the `occurrence`-th `[[kind]]` table named `rule`, its `key`
    (its `index`-th item for `match`), or with kind "variables" the variable `key`. Without a key: the rule's
    `name`. The TOML string is decoded character by character, so escapes and `'''` strings map exactly.
    """
    kind, rule, key, index, occurrence = where
    scan = _tomlpos.Strings(text)
    block = (_tomlpos.table_block(scan, "variables") if kind == "variables"
             else _tomlpos.rule_block(scan, kind, rule, occurrence))  # fmt: skip
    if block is None:
        return _locate_text(text, rule, expr, line, col)
    if key is None:
        pos = _tomlpos.key_offset(scan, "name", *block)
        return _tomlpos.file_position(text, pos if pos is not None else block[0])
    start = _tomlpos.key_value(scan, key, *block, index=index)
    if start is None:  # a defaulted key (a place rule's `when`): the rule itself
        pos = _tomlpos.key_offset(scan, key, *block)
        pos = pos if pos is not None else _tomlpos.key_offset(scan, "name", *block)
        return _tomlpos.file_position(text, pos if pos is not None else block[0])
    decoded = _tomlpos.value_offsets(text, start)
    if decoded is None or (expr and decoded[0] != expr):
        return _tomlpos.file_position(text, start)
    offs = decoded[1]
    i = _expr_index(decoded[0], line, col)
    return _tomlpos.file_position(text, offs[max(0, min(i, len(offs) - 1))])


def _duration_text(text: str) -> float:
    from nexuskv.policy._celrt import duration

    return duration(text).total_seconds()


def compile_policy(
    chain: Sequence[RuleSource], functions: Mapping[str, FunctionDecl] | None = None
) -> tuple[PolicySet | None, list[dict[str, Any]]]:
    """Compile an `extends` chain (child first) into a `PolicySet`; return it (None on problems) and problems."""
    problems: list[dict[str, Any]] = []
    child = chain[0]

    def setting(name: str, default: Any) -> Any:
        for src in chain:
            value = getattr(src.model, name)
            if value not in (None, ""):
                return value
        return default

    failure = child.model.failure
    cost_limit = setting("max_cost", DEFAULT_COST_LIMIT)
    settings = {"failure": failure, "min_gain_ms": setting("min_gain_ms", 0.0),
                "default_tier": setting("default_tier", "")}  # fmt: skip

    # Variables: ancestors first; a child's variable of the same name replaces the parent's.
    var_src: dict[str, tuple[str, RuleSource]] = {}
    for src in reversed(chain):
        for vname, expr in src.model.variables.items():
            var_src.pop(vname, None)
            var_src[vname] = (expr, src)

    def problem(
        src: RuleSource,
        rule: str,
        exc: CelError | str,
        where: tuple[str, str, str | None, int | None, int],
        expr: str = "",
        what: str = "",
        at: tuple[int | None, int | None] | None = None,
    ) -> None:
        """Record a problem; `where` locates it (see `_locate`), `at` is a position inside `expr`."""
        if isinstance(exc, CelError):
            line, col = _locate(src.text, where, expr, exc.line, exc.column)
            msg = f"{what}: {exc.message}" if what else exc.message
        else:
            line, col = _locate(src.text, where, expr, *(at or (None, None)))
            msg = f"{what}: {exc}" if what else exc
        problems.append({"file": src.path, "rule": rule, "message": msg, "line": line, "column": col})

    funcs = dict(functions or {})
    compiled_vars: dict[str, dict[str, Compiled]] = {}
    var_errors: dict[str, dict[str, tuple[CelError, str, RuleSource]]] = {}
    for kind in KINDS:
        fns: dict[str, Compiled] = {}
        errs: dict[str, tuple[CelError, str, RuleSource]] = {}
        for vname, (expr, src) in var_src.items():
            env = kind_env(kind, funcs).extend({"variables": record_type("variables", {k: f.type for k, f in
                                                                                          fns.items()})})  # fmt: skip
            try:
                fns[vname] = compile_expr(expr, env, cost_limit=cost_limit)
            except CelError as exc:
                errs[vname] = (exc, expr, src)
        compiled_vars[kind] = fns
        var_errors[kind] = errs
    # A variable that compiles in no kind is wrong wherever it is; one that fails only in some kinds is an
    # error only where a rule of such a kind uses it.
    broken = {vname for vname in var_src if all(vname in var_errors[k] for k in KINDS)}
    for vname in broken:
        exc, expr, src = var_errors["admit"][vname]
        problem(src, "", exc, ("variables", "", vname, None, 0), expr, what=f"variable {vname!r}")

    rules: dict[str, list[_Rule]] = {k: [] for k in KINDS}
    for kind in KINDS:
        seen: set[str] = set()
        env = kind_env(kind, funcs).extend({"variables": record_type("variables", {k: f.type for k, f in
                                                                                     compiled_vars[kind].items()})})
        for src in chain:
            names_here: dict[str, int] = {}
            for rule in getattr(src.model, kind):
                if rule.name in names_here:
                    names_here[rule.name] += 1
                    problem(src, rule.name, f"duplicate {kind} rule name {rule.name!r}",
                            (kind, rule.name, None, None, names_here[rule.name]))  # fmt: skip
                    continue
                names_here[rule.name] = 0
                if rule.name in seen:
                    continue  # overridden by a descendant
                seen.add(rule.name)
                built = _compile_rule(kind, rule, src, env, cost_limit, failure, var_errors[kind], broken, problem)
                if built is not None:
                    rules[kind].append(built)
    if problems:
        return None, problems
    revision = chain[0].revision if len(chain) == 1 else _combine([s.revision for s in chain])
    return PolicySet(child.model.name, revision, rules, compiled_vars, settings, [s.path for s in chain]), []


def _combine(revisions: Sequence[str]) -> str:
    import hashlib

    return hashlib.sha256("/".join(revisions).encode()).hexdigest()[:16]


def _compile_rule(
    kind: str,
    rule: Any,
    src: RuleSource,
    env: Env,
    cost_limit: int,
    failure: Failure,
    var_errors: Mapping[str, tuple[CelError, str, RuleSource]],
    broken: set[str],
    problem: Callable[..., None],
) -> _Rule | None:
    ok = True

    def where(key: str | None, index: int | None = None) -> tuple[str, str, str | None, int | None, int]:
        return (kind, rule.name, key, index, 0)

    def comp(expr: str, what: str, expect: CelType | None, key: str, index: int | None = None) -> Compiled | None:
        nonlocal ok
        for ref in _VAR_REF.finditer(expr):
            name = ref.group(1)
            if name in broken:  # reported once, at the variable
                ok = False
                return None
            if name in var_errors:
                # The variable is fine where its inputs exist; the problem is this rule's use of it.
                exc, _, vsrc = var_errors[name]
                vline, vcol = _locate(vsrc.text, ("variables", "", name, None, 0), var_errors[name][1],
                                      exc.line, exc.column)  # fmt: skip
                at = (expr.count("\n", 0, ref.start()) + 1, ref.start() - (expr.rfind("\n", 0, ref.start()) + 1) + 1)
                vat = ":".join(str(x) for x in (vsrc.path, vline, vcol) if x is not None)
                problem(src, rule.name, f"variable {name!r} cannot be used in a {kind} rule: {exc.message} "
                        f"(variable at {vat})", where(key, index), expr, what, at)  # fmt: skip
                ok = False
                return None
        try:
            return compile_expr(expr, env, expect=expect, cost_limit=cost_limit)
        except CelError as exc:
            problem(src, rule.name, exc, where(key, index), expr, what=what)
            ok = False
            return None

    match = tuple(comp(m, f"match[{i}]", BOOL, "match", i) for i, m in enumerate(rule.match))
    when = comp(rule.when, "when", BOOL, "when")
    extra: dict[str, Any] = {}
    if getattr(rule, "message_expr", ""):
        extra["message_fn"] = comp(rule.message_expr, "message_expr", STRING, "message_expr")
    if kind == "reuse" and rule.max_tokens:
        extra["max_tokens"] = comp(rule.max_tokens, "max_tokens", INT, "max_tokens")
    if kind == "place":
        extra["tier"] = rule.tier or None
        if rule.tier_expr:
            extra["tier_fn"] = comp(rule.tier_expr, "tier_expr", STRING, "tier_expr")
        if rule.ttl:
            try:
                extra["ttl_s"] = _duration_text(rule.ttl)
            except CelEvalError as exc:
                problem(src, rule.name, f"{rule.ttl!r}: {exc}", where("ttl"), rule.ttl, what="ttl")
                ok = False
        if rule.ttl_expr:
            extra["ttl_fn"] = comp(rule.ttl_expr, "ttl_expr", DURATION, "ttl_expr")
        extra["priority"] = rule.priority
        if rule.priority_expr:
            fn = comp(rule.priority_expr, "priority_expr", None, "priority_expr")
            if fn is not None and fn.type not in (INT, DOUBLE):
                problem(src, rule.name, f"expression must evaluate to int or double, but its type is {fn.type}",
                        where("priority_expr"), rule.priority_expr, what="priority_expr")  # fmt: skip
                ok = False
            extra["priority_fn"] = fn
        if not (rule.tier or rule.tier_expr or rule.ttl or rule.ttl_expr or rule.priority is not None
                or rule.priority_expr):  # fmt: skip
            problem(src, rule.name, "a place rule must set at least one of tier, ttl, priority (or their _expr)",
                    where(None))  # fmt: skip
            ok = False
    if kind == "share":
        extra["scope"] = rule.scope
        extra["tenants"] = tuple(rule.tenants)
    if not ok or when is None:
        return None
    return _Rule(name=rule.name, kind=kind, file=src.path, match=match, when=when,  # type: ignore[arg-type]
                 effect=rule.effect.value, failure=rule.failure or failure,
                 message=getattr(rule, "message", ""), **extra)  # fmt: skip


_TYPE_NAMES: dict[str, CelType] = {"int": INT, "double": DOUBLE, "string": STRING, "bool": BOOL,
                                   "duration": DURATION, "timestamp": TIMESTAMP}  # fmt: skip


def plugin_functions(registrations: Mapping[str, Any]) -> tuple[dict[str, FunctionDecl], list[str]]:
    """FunctionDecls from `nexuskv_register_cel_functions` registrations `(fn, arg_types, result_type)`.

    Returns the declarations and a problem per registration that could not be used (bad type name, shape).
    """
    from nexuskv.policy import types as t

    names = {**_TYPE_NAMES, "uint": t.UINT, "bytes": t.BYTES, "dyn": t.DYN,
             "list": t.list_of(t.DYN), "map": t.map_of(STRING, t.DYN)}  # fmt: skip
    out: dict[str, FunctionDecl] = {}
    problems: list[str] = []
    for name, reg in registrations.items():
        try:
            fn, args, result = reg
            decl = FunctionDecl(name=name, args=tuple(names[a] for a in args), result=names[result], impl=fn)
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"CEL function {name!r}: bad registration ({exc!r}); expected "
                            f"register(name, fn, [arg type names], result type name)")  # fmt: skip
            continue
        out[name] = decl
    return out, problems
