"""cel-cpp (Google's CEL, through `cel-expr-python`) evaluating NexusKV's policy rules: bench/policy_eval.py's baseline.

`celcpp_env` / `celcpp_activation`: messages as cel-cpp reads plain Python values (`map(string, dyn)`), converted
into an Activation once. `CelCppPolicy`: a tenant policy's admit, reuse and place rules as cel-cpp programs, each
compiled once, under the least glue that assembles the same decisions as `PolicySet.evaluate`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
from cel_expr_python import cel

import nexuskv as c
from nexuskv import parse_bytes

if TYPE_CHECKING:  # the compiled rules' shapes; read, never built here
    from nexuskv.cel import Compiled

__all__ = ["CelCppPolicy", "celcpp_activation", "celcpp_data", "celcpp_env"]

_MESSAGE = cel.Type.Map(cel.Type.STRING, cel.Type.DYN)  # a message as cel-cpp reads a dict: map(string, dyn)
_CELCPP_TYPES = {"state": _MESSAGE, "request": _MESSAGE, "match": _MESSAGE, "cost": _MESSAGE,
                 "node": cel.Type.STRING}  # fmt: skip


def celcpp_env(names: tuple[str, ...]) -> cel.Env:
    """A cel-cpp environment declaring `names` (messages as `map(string, dyn)`, `node` a string): type-checked."""
    return cel.NewEnv(variables={n: _CELCPP_TYPES[n] for n in names})


def celcpp_activation(env: cel.Env, values: Mapping[str, object]) -> cel.Activation:
    """`values` as cel-cpp reads them: attrs objects as plain dicts, converted into an Activation (once)."""
    return env.Activation(data=celcpp_data(values))


def celcpp_data(values: Mapping[str, object]) -> dict[str, object]:
    """`values` with every attrs object (descriptor, request, candidate, prediction) as a plain dict."""
    return {k: c.to_dict(v) if attrs.has(type(v)) else v for k, v in values.items()}


_VARIABLE = re.compile(r"\bvariables\.(\w+)")
_BYTES_OF = re.compile(r'bytes_of\("([^"]*)"\)')


def celcpp_source(source: str, variables: Mapping[str, Compiled]) -> str:
    """A policy expression as cel-cpp compiles it: `variables.x` inlined, `bytes_of("64MiB")` folded.

    Both are NexusKV's own (policy variables, the `bytes_of` extension); what is left is standard CEL.
    """
    inlined = _VARIABLE.sub(lambda m: f"({variables[m.group(1)].source})", source)
    return _BYTES_OF.sub(lambda m: str(parse_bytes(m.group(1))), inlined)


@attrs.define(frozen=True)
class CelCppRule:
    """One policy rule as cel-cpp programs: its `match` and `when` as one condition, and each value expression."""

    name: str
    effect: str
    when: cel.Expression
    message: str
    message_expr: cel.Expression | None
    max_tokens: cel.Expression | None
    tier: str | None
    ttl_s: float | None
    priority: float | None
    priority_expr: cel.Expression | None


Decision = tuple[bool, int | None, list[str], list[str], list[str]]
"""allowed, max_tokens, deciding, messages, warnings: what an admit or reuse verdict says."""


class CelCppPolicy:
    """A tenant policy's admit, reuse and place rules evaluated by cel-cpp, each expression compiled once.

    Two ways, both the least a caller of cel-cpp would write for these rules (the `chat` policy's: deny and warn
    rules, static tiers and TTLs; no audit or route rules): rule by rule, one program per rule's condition; and
    fused, the conditions of a kind in one list program per evaluation (as NexusKV fuses them), going rule by
    rule only when that list is an error. The message, cap and priority of a rule that fires are programs of
    their own either way. No error handling beyond that, so it flatters cel-cpp.
    """

    def __init__(self, ps: Any, values: Mapping[str, object]) -> None:
        """Compile every admit / reuse / place rule; `values` (descriptor, request...) become the activation."""
        env = celcpp_env(tuple(values))
        self.activation = celcpp_activation(env, values)
        self.rules: dict[str, list[CelCppRule]] = {}
        self.fused: dict[str, cel.Expression] = {}
        for kind in ("admit", "reuse", "place"):
            variables = ps.variables[kind]
            conditions = [celcpp_source(" && ".join(f"({e.source})" for e in (*r.match, r.when)), variables)
                          for r in ps.rules[kind]]  # fmt: skip
            self.rules[kind] = [self._rule(env, r, when, variables) for r, when in zip(ps.rules[kind], conditions,
                                                                                        strict=True)]  # fmt: skip
            self.fused[kind] = env.compile(f"[{', '.join(conditions)}]")

    @staticmethod
    def _rule(env: cel.Env, r: Any, when: str, variables: Mapping[str, Compiled]) -> CelCppRule:
        """cel-cpp's form of `r`, a PolicySet's compiled rule (read by attribute: its module is not public)."""
        assert r.tier_fn is None and r.ttl_fn is None and r.weight_fn is None, f"{r.name}: not in this glue"
        assert r.effect in (("apply",) if r.kind == "place" else ("deny", "warn")), f"{r.name}: not in this glue"

        def compiled(expr: Compiled | None) -> cel.Expression | None:
            return None if expr is None else env.compile(celcpp_source(expr.source, variables))

        condition = env.compile(when)
        assert condition.return_type() == cel.Type.BOOL, r.name
        return CelCppRule(name=r.name, effect=r.effect, when=condition, message=r.message,
                          message_expr=compiled(r.message_fn), max_tokens=compiled(r.max_tokens), tier=r.tier,
                          ttl_s=r.ttl_s, priority=r.priority, priority_expr=compiled(r.priority_fn))  # fmt: skip

    def _fires(self, kind: str, fused: bool) -> list[tuple[CelCppRule, bool]]:
        act = self.activation
        if fused:
            flags = self.fused[kind].eval(activation=act).plain_value()
            if type(flags) is list:  # an error comes back as its message (a str): then rule by rule
                return list(zip(self.rules[kind], flags, strict=True))
        return [(r, r.when.eval(activation=act).value()) for r in self.rules[kind]]

    def decide(self, kind: str, fused: bool) -> Decision:
        """An admit or reuse decision: every rule whose condition holds denies (or caps) or warns."""
        act = self.activation
        allowed, cap = True, None
        deciding: list[str] = []
        messages: list[str] = []
        warnings: list[str] = []
        for r, fires in self._fires(kind, fused):
            if not fires:
                continue
            msg = r.message_expr.eval(activation=act).value() if r.message_expr is not None else r.message
            if r.effect == "warn":
                warnings.append(f"{r.name}: {msg}" if msg else r.name)
                continue
            deciding.append(r.name)
            if msg:
                messages.append(msg)
            if r.max_tokens is None:
                allowed, cap = False, 0
            else:
                limit = max(0, r.max_tokens.eval(activation=act).value())
                cap = limit if cap is None else min(cap, limit)
                allowed = allowed and cap != 0
        return allowed, cap, deciding, messages, warnings

    def place(self, fused: bool) -> tuple[str | None, float | None, float | None, str]:
        """The first place rule whose condition holds: (tier, ttl_s, priority, rule)."""
        act = self.activation
        rules = self._fires("place", True) if fused else ((r, None) for r in self.rules["place"])
        for r, fires in rules:
            if fires if fused else r.when.eval(activation=act).value():  # rule by rule: stop at the first
                prio = r.priority_expr.eval(activation=act).value() if r.priority_expr is not None else r.priority
                return r.tier, r.ttl_s, prio, r.name
        raise AssertionError("no place rule holds (the chat policy ends with one that always does)")
