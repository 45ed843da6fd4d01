"""Compiling policy files: an `extends` chain of parsed files becomes one `PolicySet`, or a list of problems.

Every expression (variables, `match`, `when`, `message_expr`, `max_tokens`, the place rule's `*_expr`) is
type-checked against its rule kind's environment and cost-bounded; every problem is reported with its file,
rule and exact line and column in the TOML file (escapes and multi-line strings mapped character by character).
A child's rule or variable of the same name replaces its parent's.
"""

from __future__ import annotations

import collections
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nexuskv.cel import (
    BOOL,
    DOUBLE,
    DURATION,
    INT,
    STRING,
    CelError,
    CelEvalError,
    CelType,
    Compiled,
    Env,
    FunctionDecl,
    compile_expr,
    parse_duration,
    record_type,
)
from nexuskv.policy import positions
from nexuskv.policy.model import Failure
from nexuskv.policy.pause import pause
from nexuskv.policy.policyset import KINDS, CompiledRule, PolicySet, RuleSource, kind_env

__all__ = ["DEFAULT_COST_LIMIT", "compile_policy"]

DEFAULT_COST_LIMIT = 10_000
_VAR_REF = re.compile(r"\bvariables\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")



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
    base_line, base_col = positions.file_position(text, pos)
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
    scan = positions.Strings(text)
    block = (positions.table_block(scan, "variables") if kind == "variables"
             else positions.rule_block(scan, kind, rule, occurrence))  # fmt: skip
    if block is None:
        return _locate_text(text, rule, expr, line, col)
    if key is None:
        pos = positions.key_offset(scan, "name", *block)
        return positions.file_position(text, pos if pos is not None else block[0])
    start = positions.key_value(scan, key, *block, index=index)
    if start is None:  # a defaulted key (a place rule's `when`): the rule itself
        pos = positions.key_offset(scan, key, *block)
        pos = pos if pos is not None else positions.key_offset(scan, "name", *block)
        return positions.file_position(text, pos if pos is not None else block[0])
    decoded = positions.value_offsets(text, start)
    if decoded is None or (expr and decoded[0] != expr):
        return positions.file_position(text, start)
    offs = decoded[1]
    i = _expr_index(decoded[0], line, col)
    return positions.file_position(text, offs[max(0, min(i, len(offs) - 1))])


_CACHE: collections.OrderedDict[tuple[Any, ...], Compiled | CelError] = collections.OrderedDict()
_CACHE_SIZE = 4096
_CACHE_LOCK = threading.Lock()


def _compile_cached(expr: str, env: Env, expect: CelType | None, cost_limit: int) -> Compiled:
    """`compile_expr`, remembered: a reload recompiles only the expressions that changed.

    Compiled expressions are immutable, so policy sets share them. The key holds everything the result depends
    on: the source, every declaration's type (by its rendering) and every plugin function (the declaration and
    its implementation, kept alive by the key so their identity cannot be reused), the expected type and the
    cost limit. A failure is remembered too (a variable that cannot compile in some rule kinds fails on every
    load), and raised again as the same error.
    """
    key = (expr, tuple(sorted((k, _type_key(t)) for k, t in env.variables.items())),
           tuple(sorted(((k, d, d.impl, tuple(map(_type_key, d.args)), _type_key(d.result))
                         for k, d in env.functions.items()), key=lambda x: x[0])),
           None if expect is None else _type_key(expect), cost_limit)  # fmt: skip
    with _CACHE_LOCK:
        got = _CACHE.get(key)
        if got is not None:
            _CACHE.move_to_end(key)
    if got is None:
        try:
            got = compile_expr(expr, env, expect=expect, cost_limit=cost_limit, strict_literals=True)
        except CelError as exc:
            got = exc
        _remember(key, got)
    if isinstance(got, CelError):
        raise got.with_traceback(None)
    return got


def _remember(key: tuple[Any, ...], got: Compiled | CelError) -> None:
    with _CACHE_LOCK:
        _CACHE[key] = got
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)


def _type_key(t: CelType) -> tuple[Any, ...]:
    """Every attribute of a type, refinements (`max_size`, `nullable`) included: they change what checks."""
    return (t.kind, tuple(map(_type_key, t.params)), t.cls, t.name,
            tuple((n, _type_key(f)) for n, f in t.record), t.max_size, t.nullable, t.free)  # fmt: skip


def _duration_text(text: str) -> float:
    return parse_duration(text).total_seconds()


def compile_policy(
    chain: Sequence[RuleSource], functions: Mapping[str, FunctionDecl] | None = None
) -> tuple[PolicySet | None, list[dict[str, Any]]]:
    """Compile an `extends` chain (child first) into a `PolicySet`; return it (None on problems) and problems.

    Each problem is a dict of `PolicyProblem`'s fields and `cel`: True when a CEL expression itself is wrong.
    """
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
        problems.append({"file": src.path, "rule": rule, "message": msg, "line": line, "column": col,
                         "cel": isinstance(exc, CelError)})  # the loader tells an expression's own problems apart

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
                fns[vname] = _compile_cached(expr, env, None, cost_limit)
                pause()
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

    rules: dict[str, list[CompiledRule]] = {k: [] for k in KINDS}
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
                pause()
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
) -> CompiledRule | None:
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
            return _compile_cached(expr, env, expect, cost_limit)
        except CelError as exc:
            problem(src, rule.name, exc, where(key, index), expr, what=what)
            ok = False
            return None

    match = tuple(comp(m, f"match[{i}]", BOOL, "match", i) for i, m in enumerate(rule.match))
    when = comp(rule.when, "when", BOOL, "when")
    extra: dict[str, Any] = {}
    def number(expr: str, what: str) -> Compiled | None:
        """A CEL expression that must evaluate to int or double (a priority, a weight)."""
        nonlocal ok
        fn = comp(expr, what, None, what)
        if fn is not None and fn.type not in (INT, DOUBLE):
            problem(src, rule.name, f"expression must evaluate to int or double, but its type is {fn.type}",
                    where(what), expr, what=what)  # fmt: skip
            ok = False
        return fn

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
            extra["priority_fn"] = number(rule.priority_expr, "priority_expr")
        if not (rule.tier or rule.tier_expr or rule.ttl or rule.ttl_expr or rule.priority is not None
                or rule.priority_expr):  # fmt: skip
            problem(src, rule.name, "a place rule must set at least one of tier, ttl, priority (or their _expr)",
                    where(None))  # fmt: skip
            ok = False
    if kind == "route":
        extra["weight"] = rule.weight
        if rule.weight_expr:
            extra["weight_fn"] = number(rule.weight_expr, "weight_expr")
        elif rule.effect.value == "weight" and rule.weight is None:
            problem(src, rule.name, "a weight rule must set weight or weight_expr", where(None))
            ok = False
        if rule.effect.value != "weight" and (rule.weight is not None or rule.weight_expr):
            problem(src, rule.name, f"weight and weight_expr apply to weight rules only (this one is "
                    f"{rule.effect.value})", where("weight_expr" if rule.weight_expr else "weight"))  # fmt: skip
            ok = False
        if rule.weight is not None and not rule.weight < math.inf:
            problem(src, rule.name, "weight must be finite", where("weight"))
            ok = False
    if kind == "share":
        extra["scope"] = rule.scope
        extra["tenants"] = tuple(rule.tenants)
    if not ok or when is None:
        return None
    return CompiledRule(name=rule.name, kind=kind, file=src.path, match=match, when=when,  # type: ignore[arg-type]
                 effect=rule.effect.value, failure=rule.failure or failure,
                 message=getattr(rule, "message", ""), **extra)  # fmt: skip
