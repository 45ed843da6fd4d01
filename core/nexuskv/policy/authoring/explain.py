"""`nexuskv policy explain`: which rules of a policy fire for an input, and the value of every sub-expression."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from attrs import define

from nexuskv.cel import CelError, CelEvalError, Compiled, FunctionDecl, compile_expr, record_type, subexpressions
from nexuskv.policy.policyset import PolicySet, _share_applies, kind_env
from nexuskv.policy.verdict import Verdict

__all__ = ["ExprTrace", "RuleTrace", "explain", "render"]


@define(frozen=True)
class ExprTrace:
    """One expression of a rule: its value (or error) and the value of each sub-expression."""

    label: str
    source: str
    value: str
    steps: tuple[tuple[str, str], ...]


@define(frozen=True)
class RuleTrace:
    """One rule: did it fire, and why."""

    name: str
    effect: str
    fired: bool
    error: str
    expressions: tuple[ExprTrace, ...]
    skipped: str = ""
    """Why `evaluate` does not count the rule, whatever its expressions say: a `share` grant naming other readers
    or another scope, a `place` rule after the one that decided; empty when it counts."""


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _run(fn: Compiled, act: Mapping[str, Any]) -> tuple[Any, str]:
    try:
        return fn(act), ""
    except CelEvalError as exc:
        return None, f"error: {exc.message if hasattr(exc, 'message') else exc}"


_NAME_OR_CALL = re.compile(r"\.?[A-Za-z_][A-Za-z0-9_.]*\s*(\(.*)?", re.DOTALL)


def _literal(text: str) -> bool:
    """Whether an expression is a literal (`1`, `"a"`, `b"x"`, `true`, `null`, `[]`).

    A literal has no sub-expressions of its own and is neither a name nor a call (`"a" + x` and `"k" in m` are not
    literals, though they start with one).
    """
    return text in ("true", "false", "null") or (_NAME_OR_CALL.fullmatch(text) is None
                                                 and len(subexpressions(text)) == 1)  # fmt: skip


def _trace(label: str, fn: Compiled, act: Mapping[str, Any], env: Any) -> ExprTrace:
    value, err = _run(fn, act)
    steps: list[tuple[str, str]] = []
    for text in subexpressions(fn.source)[1:]:
        try:
            sub = compile_expr(text, env, cost_limit=10**9)
        except CelError:
            continue  # a fragment (comprehension variable, operator) that is not an expression on its own
        if _literal(text):
            continue  # literals explain nothing
        v, e = _run(sub, act)
        steps.append((text, e or _show(v)))
    return ExprTrace(label, fn.source, err or _show(value), tuple(steps))


def explain(
    ps: PolicySet, kind: str, values: Mapping[str, Any], functions: Mapping[str, FunctionDecl] | None = None
) -> tuple[list[RuleTrace], Verdict]:
    """Trace every rule of `kind` for `values`, and the verdict `evaluate` gives for the same input."""
    act = ps.activation(kind, values)
    env = kind_env(kind, functions).extend(
        {"variables": record_type("variables", {k: f.type for k, f in ps.variables[kind].items()})}
    )
    traces = []
    placed = ""  # the place rule that decided: the first that fires (audits aside) and computes its placement
    for rule in ps.rules[kind]:
        exprs: list[ExprTrace] = [_trace(f"match[{i}]", m, act, env) for i, m in enumerate(rule.match)]
        exprs.append(_trace("when", rule.when, act, env))
        for label in ("max_tokens", "message_fn", "tier_fn", "ttl_fn", "priority_fn", "weight_fn"):
            fn = getattr(rule, label)
            if fn is not None:
                exprs.append(_trace(label.removesuffix("_fn") + ("_expr" if label.endswith("_fn") else ""), fn,
                                    act, env))  # fmt: skip
        error = next((e.value for e in exprs if e.value.startswith("error:")), "")
        skipped = ""
        if kind == "share" and not _share_applies(rule, act):
            skipped = _not_for(rule, act)
        elif placed:
            skipped = f"{placed} fired first, and the first place rule to fire decides"
        fired = not error and not skipped and all(e.value == "true" for e in exprs
                                                  if e.label.startswith(("match", "when")))  # fmt: skip
        if kind == "place" and fired and rule.effect != "audit":
            placed = rule.name
        traces.append(RuleTrace(rule.name, rule.effect, fired, error, tuple(exprs), skipped))
    return traces, ps.evaluate(kind, values)


def _not_for(rule: Any, act: Mapping[str, Any]) -> str:
    """Why a share grant says nothing about this reader and candidate (what `evaluate` skips it for)."""
    reader = getattr(act.get("request"), "tenant", None)
    scope = getattr(act.get("match"), "scope", None)
    return (f"it grants scope {_show(rule.scope)} to {', '.join(map(_show, rule.tenants)) or 'nobody'}, not to "
            f"tenant {_show(reader)} reading scope {_show(scope)}")  # fmt: skip


def render(ps: PolicySet, kind: str, traces: list[RuleTrace], verdict: Verdict) -> str:
    """Human-readable explanation."""
    lines = [f"policy {ps.name} (revision {ps.revision}), {kind} rules, files: {', '.join(ps.files)}"]
    for t in traces:
        state = "FIRED" if t.fired else ("ERROR" if t.error else "no")
        why = t.error or (f"skipped: {t.skipped}" if t.skipped else "")
        lines.append(f"\nrule {t.name} [{t.effect}]: {state}{' (' + why + ')' if why else ''}")
        for e in t.expressions:
            lines.append(f"  {e.label}: {e.source}  =>  {e.value}")
            lines.extend(f"      {text}  =>  {value}" for text, value in e.steps)
    log = verdict.to_log()
    lines.append("\nverdict: " + ", ".join(f"{k}={v}" for k, v in log.items() if k not in ("kind", "policy")))
    return "\n".join(lines)
