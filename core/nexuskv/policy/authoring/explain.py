"""`nexuskv policy explain`: which rules of a policy fire for an input, and the value of every sub-expression."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import define

from nexuskv.cel import CelError, CelEvalError, Compiled, FunctionDecl, compile_expr, record_type, subexpressions
from nexuskv.policy.policyset import PolicySet, kind_env
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


def _trace(label: str, fn: Compiled, act: Mapping[str, Any], env: Any) -> ExprTrace:
    value, err = _run(fn, act)
    steps: list[tuple[str, str]] = []
    for text in subexpressions(fn.source)[1:]:
        if text[:1] in "\"'0123456789" or text in ("true", "false", "null"):
            continue  # literals explain nothing
        try:
            sub = compile_expr(text, env, cost_limit=10**9)
        except CelError:
            continue  # a fragment (comprehension variable, operator) that is not an expression on its own
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
    for rule in ps.rules[kind]:
        exprs: list[ExprTrace] = [_trace(f"match[{i}]", m, act, env) for i, m in enumerate(rule.match)]
        exprs.append(_trace("when", rule.when, act, env))
        for label in ("max_tokens", "message_fn", "tier_fn", "ttl_fn", "priority_fn"):
            fn = getattr(rule, label)
            if fn is not None:
                exprs.append(_trace(label.removesuffix("_fn") + ("_expr" if label.endswith("_fn") else ""), fn,
                                    act, env))  # fmt: skip
        error = next((e.value for e in exprs if e.value.startswith("error:")), "")
        fired = not error and all(e.value == "true" for e in exprs if e.label.startswith(("match", "when")))
        traces.append(RuleTrace(rule.name, rule.effect, fired, error, tuple(exprs)))
    return traces, ps.evaluate(kind, values)


def render(ps: PolicySet, kind: str, traces: list[RuleTrace], verdict: Verdict) -> str:
    """Human-readable explanation."""
    lines = [f"policy {ps.name} (revision {ps.revision}), {kind} rules, files: {', '.join(ps.files)}"]
    for t in traces:
        state = "FIRED" if t.fired else ("ERROR" if t.error else "no")
        lines.append(f"\nrule {t.name} [{t.effect}]: {state}{' (' + t.error + ')' if t.error else ''}")
        for e in t.expressions:
            lines.append(f"  {e.label}: {e.source}  =>  {e.value}")
            lines.extend(f"      {text}  =>  {value}" for text, value in e.steps)
    log = verdict.to_log()
    lines.append("\nverdict: " + ", ".join(f"{k}={v}" for k, v in log.items() if k not in ("kind", "policy")))
    return "\n".join(lines)
