"""The CEL pipeline end to end: parse (cel-python's grammar, extended), type-check, bound the cost, compile.

`compile_expr` turns an expression into a `Compiled` callable that evaluates over native Python values (the
dialect, its standard functions and extensions are listed in docs/policies.md). The checked tree is translated
to one Python expression (plain operators where the static types make them exact, run-time helpers where CEL
semantics need them) and compiled once. `&&`, `||`, `all` and `exists` run as
Python's short-circuit operators; when that fast code raises, the expression is re-evaluated by an exact
variant that implements CEL's error-absorbing logic, so both agree wherever the fast code succeeds.

Cost model (a static upper bound, like Kubernetes CEL): every node costs 1; string and bytes comparisons,
`contains`, `indexOf`, `lastIndexOf`, `startsWith` (the prefix), `endsWith`, `matches` (text and pattern) and
string conversions add 0.1 per character of the maximum length; `in` on a list and list / map equality add the
maximum number of items; a comprehension costs its range plus (maximum items) x (body + 1). What an expression
builds is charged by the size bound of the result (`checker/sizes.py`): 0.1 per character for concatenation,
`replace`, `format`, `join`, `lowerAscii`, `upperAscii`, `trim`, `reverse`, `substring`, `strings.quote`,
`base64.*` and `bytes()`; 1 per item for list concatenation and `split`. A result type carries its bound
(`s.replace(old, new)`: len(s) + (len(s) + 1) x len(new); `format`: the format string plus each clause's longest
text, a literal precision included), so chained builders compound. Lengths are declared (`maxLength`,
`maxItems`), read from literals, or the defaults (4096 characters, 1,000,000 items). The limit is checked before
constant folding, so folding never does more work than the budget allows; a `CelCostError` points at the
smallest sub-expression over the budget. `Compiled.cost` is the bound of what is left after folding.
"""

from __future__ import annotations

import functools
import io
import tokenize
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nexuskv.cel.checker.check import Checker, compat
from nexuskv.cel.checker.cost import cost_of, describe, over_budget
from nexuskv.cel.codegen.folding import fold, runtime_globals
from nexuskv.cel.codegen.generator import Gen
from nexuskv.cel.runtime.core import CelEvalError
from nexuskv.cel.syntax.parser import (
    CelCostError,
    CelError,
    CelSyntaxError,
    CelTypeError,
    Node,
    parse,
)
from nexuskv.cel.syntax.subexpressions import subexpressions
from nexuskv.cel.types import CelType, Env

__all__ = [
    "CelCostError",
    "CelError",
    "CelEvalError",
    "CelSyntaxError",
    "CelTypeError",
    "Compiled",
    "compile_expr",
    "fuse",
    "subexpressions",
]


# --------------------------------------------------------------------------------------------- compile


class Compiled:
    """A compiled CEL expression: call it with an activation (variable name -> native value).

    `source` is the expression text, `type` the checked result type, `cost` the static cost bound and
    `python` the generated fast code (for debugging).
    """

    __slots__ = ("_exact", "_fast", "_parts", "cost", "python", "source", "type")

    def __init__(
        self,
        source: str,
        type_: CelType,
        cost: int,
        python: str,
        fast: Callable[[Mapping[str, object]], object],
        exact: Callable[[Mapping[str, object]], object],
    ) -> None:
        """Wrap the generated functions (use `compile_expr` to make one)."""
        self.source = source
        self.type = type_
        self.cost = cost
        self.python = python
        self._fast = fast
        self._exact = exact
        self._parts: tuple[str, dict[str, str], dict[str, Any]] | None = None  # fast code, hoists, constants

    def __call__(self, activation: Mapping[str, object]) -> object:
        """Evaluate; returns a native value or raises CelEvalError."""
        return self._fast(activation)

    @property
    def fn(self) -> Callable[[Mapping[str, object]], object]:
        """The generated function itself (what `__call__` calls), for hot loops that skip the method frame."""
        return self._fast

    def evaluate_exact(self, activation: Mapping[str, object]) -> object:
        """Evaluate with the exact (slow, error-absorbing) variant only; for tests and debugging."""
        return self._exact(activation)

    def __repr__(self) -> str:
        """Source, type and cost."""
        return f"<Compiled {self.source!r}: {self.type} cost={self.cost}>"


def compile_expr(
    source: str,
    env: Env,
    *,
    expect: CelType | None = None,
    cost_limit: int = 10_000,
    container: str = "",
    checked: bool = True,
    macros: bool = True,
    strict_literals: bool = False,
) -> Compiled:
    """Parse, type-check, bound the cost of and compile a CEL expression.

    `container` is the namespace names resolve in (`c` in container `a.b` tries `a.b.c`, `a.c`, `c`);
    `checked=False` is CEL's parse-only mode (what the checker would reject fails when evaluated instead);
    `macros=False` parses `has`, `all`, `exists`... as plain calls. A malformed literal `duration("1x")` or
    `timestamp("nope")` is an evaluation error, as the spec has it; `strict_literals=True` (policies) refuses it
    at compile time instead, as a located CelTypeError. Raises CelSyntaxError, CelTypeError (also when the result
    type is not `expect`) or CelCostError.
    """
    if not isinstance(source, str):
        raise TypeError(f"CEL source must be a string, not {type(source).__name__}")
    try:
        return _compile(source, env, expect, cost_limit, container, checked, macros, strict_literals)
    except RecursionError:
        raise CelSyntaxError("expression is nested too deeply", 1, 1, source) from None


def _compile(
    source: str, env: Env, expect: CelType | None, cost_limit: int, container: str, checked: bool, macros: bool,
    strict_literals: bool = False,
) -> Compiled:
    root = parse(source, macros=macros)
    checker = Checker(env, source, container, checked)
    result = checker.check(root, {})
    if expect is not None and not compat(result, expect):
        line, col = _first_position(source)
        raise CelTypeError(
            f"expression must evaluate to {expect}, but its type is {result}", line, col, source
        )
    cost = cost_of(root, env)  # before folding too: folding does the work it bounds, at load time
    if cost > cost_limit:
        raise _cost_error(root, env, cost, cost_limit, source)
    try:
        root = fold(root, env, source, strict_literals)
    except CelTypeError as exc:
        exc.source = source
        raise
    cost = cost_of(root, env)  # what is left for run time
    consts: dict[str, Any] = {}
    positions: list[tuple[int, int]] = []
    try:
        fast_gen = Gen(env, False, consts, positions)
        fast_code = fast_gen.g(root, {})
        exact_gen = Gen(env, True, consts, positions)
        exact_code = exact_gen.g(root, {})
    except CelTypeError as exc:
        exc.source = source
        raise
    fast_code, exact_code = _wrap_result(result, expect, fast_code), _wrap_result(result, expect, exact_code)
    hoist = "".join(f"        {py} = A[{name!r}]\n" for name, py in fast_gen.hoisted.items())
    python = (
        "def _exact_raw(A):\n"
        f"    return {exact_code}\n"
        "def _fast(A):\n"
        "    try:\n"
        f"{hoist}"
        f"        return {fast_code}\n"
        "    except Exception:\n"
        "        pass\n"
        "    return _exact(A)\n"
    )
    g = runtime_globals(consts)
    exact_fn = _exact_wrapper(g, positions, source)
    g["_exact"] = exact_fn
    try:
        code = compile(python, f"<cel {source[:40]!r}>", "exec")
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise CelSyntaxError(f"expression too complex to compile: {exc}", 1, 1, source) from None
    exec(code, g)
    compiled = Compiled(source, result, cost, python, g["_fast"], exact_fn)
    compiled._parts = (fast_code, dict(fast_gen.hoisted), dict(consts))
    return compiled


def _renamed(code: str, prefix: str, names: set[str]) -> str:
    """`code` with the NAME tokens in `names` prefixed (string literals and attributes are left alone)."""
    return _renamed_cached(code, prefix, frozenset(names))


@functools.lru_cache(maxsize=4096)
def _renamed_cached(code: str, prefix: str, names: frozenset[str]) -> str:
    """`_renamed`, remembered: a reload inlines mostly the same expressions at the same places again."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        text = tok.string
        if tok.type == tokenize.NAME and text in names:
            text = prefix + text
        out.append((tok.type, text))
    return tokenize.untokenize(out).strip()


def inline(c: Compiled, prefix: str) -> tuple[str, list[str], dict[str, Any]]:
    """The fast code of `c` for inlining into generated code: (expression, hoist statements, constants).

    Its hoisted variables and constants are renamed with `prefix` so that several expressions can share one
    Python frame; hoist statements read `A[...]` and may raise (the generated code must fall back then).
    The expression's globals are `helper_globals(constants)`.
    """
    if c._parts is None:
        raise ValueError(f"{c!r} was not built by compile_expr")
    code, hoisted, kconsts = c._parts
    names = set(hoisted.values()) | set(kconsts)
    expr = f"({_renamed(code, prefix, names) if names else code})"
    hoists = [f"{prefix}{py} = A[{name!r}]" for name, py in hoisted.items()]
    return expr, hoists, {prefix + k: v for k, v in kconsts.items()}


def helper_globals(consts: Mapping[str, Any]) -> dict[str, Any]:
    """Globals for code built from `inline` pieces: the runtime helpers plus the given constants."""
    return runtime_globals(consts)


def fuse(groups: Sequence[Sequence[Compiled]]) -> Callable[[Mapping[str, object]], tuple[object, ...] | None]:
    """One function evaluating many conjunctions at once.

    `f(A)` returns, per group, the value of `c0 and c1 and ...` (each group's expressions in order,
    short-circuiting like the separate calls would). It runs every expression's fast code inline in one
    Python frame (no call per expression); when anything raises it returns None, and the caller evaluates
    group by group with each `Compiled` (exact CEL error semantics).
    """
    hoists: list[str] = []
    terms: list[str] = []
    consts: dict[str, Any] = {}
    i = 0
    for group in groups:
        parts = []
        for c in group:
            if c._parts is None:
                raise ValueError(f"{c!r} was not built by compile_expr")
            code, hoisted, kconsts = c._parts
            prefix = f"_e{i}"
            i += 1
            names = set(hoisted.values()) | set(kconsts)
            parts.append(f"({_renamed(code, prefix, names) if names else code})")
            hoists.extend(f"        {prefix}{py} = A[{name!r}]\n" for name, py in hoisted.items())
            consts.update({prefix + k: v for k, v in kconsts.items()})
        terms.append(" and ".join(parts) if parts else "True")
    body = "".join(f"            {t},\n" for t in terms)
    python = (
        "def _fused(A):\n"
        "    try:\n"
        f"{''.join(hoists)}"
        "        return (\n"
        f"{body}"
        "        )\n"
        "    except Exception:\n"
        "        return None\n"
    )
    g = runtime_globals(consts)
    exec(compile(python, "<cel fused>", "exec"), g)
    fn: Callable[[Mapping[str, object]], tuple[object, ...] | None] = g["_fused"]
    return fn


def _wrap_result(result: CelType, expect: CelType | None, code: str) -> str:
    if expect is None:
        return code
    if result.kind == "dyn" and expect.kind != "dyn":
        return f"_d_expect({code}, {expect.kind!r})"
    if result.nullable:
        return f"_nn({code})"
    return code


def _exact_wrapper(
    g: dict[str, Any], positions: list[tuple[int, int]], source: str
) -> Callable[[Mapping[str, object]], object]:
    def exact(activation: Mapping[str, object]) -> object:
        try:
            return g["_exact_raw"](activation)
        except CelEvalError as exc:
            if exc.line is None and 0 <= exc.pos < len(positions):
                exc.line, exc.column = positions[exc.pos]
            exc.source = source
            raise
        except RecursionError:
            raise CelEvalError("expression nested too deeply", source=source) from None
        except Exception as exc:
            raise CelEvalError(f"{type(exc).__name__}: {exc}", source=source) from exc

    return exact


def _cost_error(root: Node, env: Env, cost: int, limit: int, source: str) -> CelCostError:
    """The error for a tree over its budget, located at the smallest sub-expression over it, which it names."""
    culprit, part = over_budget(root, env, limit)
    where = "" if culprit is root else f"; {describe(culprit)} at {culprit.line}:{culprit.col} alone costs {part}"
    t = culprit.t
    if culprit is root:
        line, col = _first_position(source)
    else:
        line, col = culprit.line, culprit.col
    built = ""
    if t.max_size is not None and t.kind in ("string", "bytes", "list") and culprit.op in ("call", "+"):
        unit = "items" if t.kind == "list" else "characters" if t.kind == "string" else "bytes"
        built = f"; it may build a {t.kind} of up to {t.max_size} {unit}"
    return CelCostError(
        f"estimated cost {cost} exceeds the limit {limit}{where}{built} (bound list sizes and string lengths "
        "with maxItems / maxLength, or avoid iterating large lists and building large strings or lists)",
        line,
        col,
        source,
    )


def _first_position(source: str) -> tuple[int, int]:
    stripped = len(source) - len(source.lstrip())
    line = source.count("\n", 0, stripped) + 1
    col = stripped - (source.rfind("\n", 0, stripped) + 1) + 1
    return line, col
