"""The static cost bound of a checked CEL tree (the model is in `compiled.py`'s docstring).

Every node costs 1; string work adds 0.1 per character of the declared (or derived) maximum length, list and
map work the maximum number of items, and a comprehension its range plus (maximum items) x (body + 1). What a
call builds is charged by its result's size bound (`sizes.call_bound`): 0.1 per character of a built string,
1 per item of a built list, so chained builders compound. `over_budget` finds the smallest sub-expression
whose cost alone is over a limit, to locate a `CelCostError`.
"""

from __future__ import annotations

import math

from nexuskv.cel.checker.check import CONVERSIONS, FOLD_AT_COMPILE
from nexuskv.cel.checker.relations import items, slen
from nexuskv.cel.checker.sizes import LIST_BUILDERS, STRING_BUILDERS
from nexuskv.cel.syntax.parser import Node
from nexuskv.cel.types import CelType, Env

__all__ = ["cost_of", "describe", "over_budget"]

_SCANS = ("contains", "indexOf", "lastIndexOf")
_TEXT = ("string", "bytes")


def cost_of(n: Node, env: Env) -> int:
    """The static cost bound of a checked tree (the model is in `compiled.py`'s docstring)."""
    op = n.op
    if op in ("comp:optMap", "comp:optFlatMap"):  # the body runs at most once
        return 1 + sum(cost_of(a, env) for a in n.args)
    if op.startswith(("comp:", "comp2:")):
        rng = n.args[0]
        body = sum(cost_of(a, env) for a in n.args[1:])
        return 1 + cost_of(rng, env) + items(rng.t) * (body + 1)
    c = 1 + sum(cost_of(a, env) for a in n.args)
    args = [a.t for a in n.args]
    if op in ("==", "!=", "<", "<=", ">", ">="):
        a, b = args
        if a.kind in _TEXT or b.kind in _TEXT:
            c += math.ceil(0.1 * min(slen(a), slen(b)))
        elif a.kind in ("list", "map") or b.kind in ("list", "map"):
            c += min(items(a), items(b))
        elif a.kind == "message":
            c += len(a.fields())
    elif op == "in" and args[1].kind in ("list", "dyn"):
        c += items(args[1])
    elif op == "+":
        c += _concatenation(n, args)
    elif op == "call":
        name = n.value
        decl = env.functions.get(name)
        if decl is not None:
            c += decl.cost - 1
        elif name in STRING_BUILDERS and n.t.kind in _TEXT:
            c += math.ceil(0.1 * slen(n.t))
        elif name in LIST_BUILDERS and n.t.kind == "list":
            c += items(n.t)
        elif name in ("startsWith", "endsWith"):
            c += math.ceil(0.1 * slen(args[1]))
        elif name in _SCANS and args:
            c += math.ceil(0.1 * slen(args[0]))
        elif name == "matches":
            c += math.ceil(0.1 * slen(args[0])) + math.ceil(0.1 * slen(args[1]))
        elif (name in CONVERSIONS or name in FOLD_AT_COMPILE) and args[0].kind in (*_TEXT, "dyn"):
            c += math.ceil(0.1 * slen(args[0]))
    return c


def _concatenation(n: Node, args: list[CelType]) -> int:
    """What `a + b` adds: 0.1 per character of a string (bytes) result, 1 per item of a list result."""
    kinds = {t.kind for t in args}
    if n.t.kind in _TEXT:
        return math.ceil(0.1 * slen(n.t))
    if n.t.kind == "list":
        return items(n.t)
    if n.t.kind == "dyn" and "list" in kinds:  # dyn + list: a list of both sizes
        return sum(map(items, args))
    if n.t.kind == "dyn" and kinds & set(_TEXT):  # dyn + string: a string of both lengths
        return math.ceil(0.1 * sum(map(slen, args)))
    return 0


def over_budget(n: Node, env: Env, limit: int) -> tuple[Node, int]:
    """The smallest sub-expression of `n` whose cost alone exceeds `limit`, and that cost (`n` when none)."""
    cost = cost_of(n, env)
    while True:
        worst = max(((cost_of(a, env), a) for a in n.args), key=lambda pair: pair[0], default=None)
        if worst is None or worst[0] <= limit:
            return n, cost
        cost, n = worst


def describe(n: Node) -> str:
    """A short name for the node `over_budget` found: `replace()`, `all()`, `+`, `==`..."""
    op = n.op
    if op == "call":
        return f"{n.value}()"
    if op.startswith(("comp:", "comp2:")):
        return f"{op.partition(':')[2]}()"
    if op in ("list", "map"):
        return f"the {op} literal"
    return f"'{op}'" if not op.isalpha() else op
