"""Name resolution for the CEL checker: qualified identifiers, the container, type names and namespaced calls.

CEL names may contain dots: a variable `a.b.c` is written like field selections on `a`, and a `container`
(a namespace such as `x.y`) makes `c` resolve to `x.y.c`, then `x.c`, then `c`: the most qualified declared
name wins, and a name bound by a comprehension shadows them all. Type names (`int`, `list`,
`google.protobuf.Timestamp`...) are values of type `type`; `math.greatest(...)` is a function whose name has
a namespace, not a method of a variable `math`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from nexuskv.cel.runtime.core import KIND_TYPE_NAMES
from nexuskv.cel.syntax.parser import Node
from nexuskv.cel.types import (
    BOOL,
    BYTES,
    DOUBLE,
    DURATION,
    DYN,
    INT,
    NULL,
    STRING,
    TIMESTAMP,
    UINT,
    CelType,
    list_of,
    map_of,
    optional_of,
    type_of,
)
from nexuskv.cel.values import TypeValue

__all__ = [
    "TYPE_NAMES", "candidates", "dotted", "namespace_of", "namespaced_call", "qualify", "static_type_name",
    "to_type_literal",
]  # fmt: skip

TYPE_NAMES: dict[str, CelType] = {
    "int": INT, "uint": UINT, "double": DOUBLE, "bool": BOOL, "string": STRING, "bytes": BYTES,
    "list": list_of(DYN), "map": map_of(DYN, DYN), "null_type": NULL, "type": type_of(DYN),
    "google.protobuf.Timestamp": TIMESTAMP, "google.protobuf.Duration": DURATION,
    "optional_type": optional_of(DYN),
}  # fmt: skip
"""Type names usable as values, and the type each denotes."""

def static_type_name(t: CelType) -> str | None:
    """The name `type(x)` gives every value of static type `t` (None when only the run time can say)."""
    if t.kind == "dyn" or t.nullable:
        return None
    if t.kind == "message":
        return str(t)
    return KIND_TYPE_NAMES.get(t.kind, t.kind)


def candidates(name: str, container: str) -> list[str]:
    """The names `name` may resolve to in `container`, most qualified first (`.name` is absolute)."""
    if name.startswith("."):
        return [name[1:]]
    out = []
    parts = container.split(".") if container else []
    for i in range(len(parts), 0, -1):
        out.append(".".join(parts[:i]) + "." + name)
    out.append(name)
    return out


def dotted(n: Node) -> list[Node] | None:
    """The chain of nodes of a qualified name `a.b.c` (ident first), or None when `n` is not one."""
    chain = []
    while n.op == "select":
        chain.append(n)
        n = n.args[0]
    if n.op != "ident":
        return None
    chain.append(n)
    return chain[::-1]


def qualify(
    n: Node, scope: Mapping[str, CelType], declared: Callable[[str], bool], container: str
) -> bool:
    """Rewrite the longest prefix of the select chain `n` that names a declared variable or type into one ident.

    Returns whether anything was rewritten. A chain whose first name is bound in `scope` is left alone.
    """
    chain = dotted(n)
    if chain is None or chain[0].value in scope:
        return False
    names = [chain[0].value] + [c.value for c in chain[1:]]
    for i in range(len(names), 0, -1):
        text = ".".join(names[:i])
        for full in candidates(text, container):
            if declared(full) or (i > 1 and full in TYPE_NAMES):
                target = chain[i - 1]
                if i == 1 and full == chain[0].value:
                    return False
                absolute = chain[0].value.startswith(".")
                target.op, target.args, target.value, target.method = "ident", [], full, absolute
                if full in TYPE_NAMES and not declared(full):
                    to_type_literal(target, full)
                return True
    return False


def to_type_literal(n: Node, name: str) -> None:
    """Make `n` the literal type value `name` (of type `type(T)`)."""
    n.op, n.args, n.value = "lit", [], TypeValue(name)
    n.t = type_of(TYPE_NAMES[name])


def namespace_of(n: Node, scope: Mapping[str, CelType], declared: Callable[[str], bool]) -> str | None:
    """`ns` when the call `n` is `ns.fn(args)` with a qualified name `ns` that names no variable, else None."""
    if not n.method or not n.args:
        return None
    chain = dotted(n.args[0])
    if chain is None or chain[0].value in scope:
        return None
    ns = ".".join([chain[0].value] + [c.value for c in chain[1:]])
    if any(declared(".".join(ns.split(".")[:i])) for i in range(1, ns.count(".") + 2)):
        return None
    return ns


def namespaced_call(n: Node, scope: Mapping[str, CelType], declared: Callable[[str], bool],
                    is_function: Callable[[str], bool]) -> bool:  # fmt: skip
    """Turn the method call `ns.fn(args)` into the function call `ns.fn(args)` when `ns` is no variable."""
    ns = namespace_of(n, scope, declared)
    if ns is None:
        return False
    name = f"{ns}.{n.value}"
    if not is_function(name):
        return False
    n.value, n.args, n.method = name, n.args[1:], False
    return True
