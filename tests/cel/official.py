"""Google's own CEL (cel-cpp, through its Python binding `cel-expr-python`) as a reference for NexusKV's CEL.

Shared by tests/cel/test_official.py (hypothesis, in `make test`) and bench/cel_official.py (10,000+ generated
expressions, `RESULT cel.official_disagreements`). The expressions and bindings are tests/cel/test_differential.py's
grammar (typed variables i, j, u, v, f, g, b, s, t, li, ls, m) plus forms cel-python lacks: the global
`matches(string, string)` and trailing commas in list literals.
"""

from __future__ import annotations

from typing import Any

from cel_expr_python import cel
from hypothesis import strategies as st

from tests.cel.test_differential import REGEXES, expr, from_native, run_ours, same

T = cel.Type
OFFICIAL = cel.NewEnv(variables={
    "i": T.INT, "j": T.INT, "u": T.UINT, "v": T.UINT, "f": T.DOUBLE, "g": T.DOUBLE, "b": T.BOOL, "s": T.STRING,
    "t": T.STRING, "li": T.List(T.INT), "ls": T.List(T.STRING), "m": T.Map(T.STRING, T.INT)})  # fmt: skip
KINDS = ("int", "uint", "double", "bool", "string", "list_int")
_TYPE_NAMES = {"INT": "int", "UINT": "uint", "DOUBLE": "double", "BOOL": "bool", "STRING": "string"}


def expressions(kind: str, depth: int = 3) -> st.SearchStrategy[str]:
    """Well-typed expressions of `kind`: the differential grammar and the forms only the official CEL shares."""
    base = expr(kind, depth)
    if kind == "bool":
        extra = st.tuples(expr("string", depth - 1), REGEXES).map(lambda x: f"matches({x[0]}, {x[1]})")
        return st.one_of(base, extra)
    if kind == "list_int":
        extra = st.tuples(expr("int", depth - 1), expr("int", depth - 1)).map(lambda x: f"[{x[0]}, {x[1]},]")
        return st.one_of(base, extra)
    return base


def run_official(source: str, kind: str, act: dict[str, Any]) -> tuple[str, Any]:
    """("value", normalised value), ("error", None) for an evaluation error, ("invalid", message) when it is refused."""
    try:
        program = OFFICIAL.compile(source)
    except Exception as exc:  # the binding raises its own status errors
        return ("invalid", str(exc))
    value = program.eval(data=act)
    name = value.type().name()
    if name == "ERROR":
        return ("error", None)
    native = kind.split("_")[0] if not kind.startswith("list") else kind
    scalar = _TYPE_NAMES.get(name)
    if scalar is not None and scalar != native:
        return ("value", (scalar, value.plain_value()))  # a type the expression should not have: a disagreement
    return ("value", from_native(value.plain_value(), native))


def disagreement(source: str, kind: str, act: dict[str, Any]) -> str | None:
    """Why NexusKV and the official CEL answer `source` differently under `act` (None when they agree)."""
    try:
        ours, message = run_ours(source, kind, act)
    except Exception as exc:  # refused at compile time here
        ours, message = ("invalid", str(exc).splitlines()[0]), ""
    theirs = run_official(source, kind, act)
    if ours[0] != theirs[0]:
        return f"{source!r} with {act}: ours={ours} {message} official={theirs}"
    if ours[0] == "value" and not same(ours[1], theirs[1]):
        return f"{source!r} with {act}: ours={ours} official={theirs}"
    return None


KNOWN = {
    "empty-list element type": ("[][", "found no matching overload"),
}
"""Disagreements docs/cel.md lists (spec's answer, reason), by kind: (a text of the expression, of cel-cpp's answer).

- empty-list element type: the element type of `[]` is free; cel-cpp's checker binds it through the first `_+_`
  overload (int) and then refuses, say, `size([][1] + [][1])` (no `size(int)`), where NexusKV keeps it `dyn` and
  evaluates it (here: an index error). The spec leaves the choice to the checker's inference.
"""


def known_reason(why: str) -> str | None:
    """The kind of a listed disagreement `why` is (None: not listed)."""
    for name, (in_expr, in_answer) in KNOWN.items():
        if in_expr in why and in_answer in why:
            return name
    return None
