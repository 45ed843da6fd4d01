"""The static cost bound of a checked CEL tree (the model is in `compiled.py`'s docstring).

Every node costs 1; string work adds 0.1 per character of the declared maximum length, list and map work the
maximum number of items, and a comprehension its range plus (maximum items) x (body + 1).
"""

from __future__ import annotations

import math

from nexuskv.cel.checker.check import CONVERSIONS, FOLD_AT_COMPILE
from nexuskv.cel.checker.relations import items, slen, sum_size
from nexuskv.cel.syntax.parser import Node
from nexuskv.cel.types import DEFAULT_MAX_STRING, Env

__all__ = ["cost_of"]

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
        if a.kind in ("string", "bytes") or b.kind in ("string", "bytes"):
            c += math.ceil(0.1 * min(slen(a), slen(b)))
        elif a.kind in ("list", "map") or b.kind in ("list", "map"):
            c += min(items(a), items(b))
        elif a.kind == "message":
            c += len(a.fields())
    elif op == "in" and args[1].kind in ("list", "dyn"):
        c += items(args[1])
    elif op == "+" and n.t.kind in ("string", "bytes", "list"):
        size = sum_size(args[0], args[1])
        c += math.ceil(0.1 * (size if size is not None else 2 * DEFAULT_MAX_STRING))
    elif op == "call":
        name = n.value
        decl = env.functions.get(name)
        if decl is not None:
            c += decl.cost - 1
        elif name in ("startsWith", "endsWith"):
            c += math.ceil(0.1 * slen(args[1]))
        elif name == "contains":
            c += math.ceil(0.1 * slen(args[0]))
        elif name == "matches":
            c += math.ceil(0.1 * slen(args[0])) + math.ceil(0.1 * slen(args[1]))
        elif (name in CONVERSIONS or name in FOLD_AT_COMPILE) and args[0].kind in (
            "string",
            "bytes",
            "dyn",
        ):
            c += math.ceil(0.1 * slen(args[0]))
    return c
