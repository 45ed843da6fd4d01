"""Type parameters in function declarations: `first(list(T)) -> T`, `tuple(T, U) -> tuple(T, U)`.

A declared argument type may contain type parameters (`param` types, e.g. `T`) and abstract types
(`abstract`, e.g. `tuple(T, U)`). `unify` binds the parameters to the argument types of a call (a parameter
met with two different types becomes `dyn`, the most general binding); `substitute` writes the result type
with the bindings (an unbound parameter is `dyn`).
"""

from __future__ import annotations

from collections.abc import Callable

from nexuskv.cel.types import DYN, CelType

__all__ = ["is_generic", "substitute", "unify"]

Join = Callable[[CelType, CelType], "CelType | None"]


def is_generic(t: CelType) -> bool:
    """Whether `t` mentions a type parameter."""
    return t.kind == "param" or any(is_generic(p) for p in t.params)


def unify(want: CelType, have: CelType, bindings: dict[str, CelType], join: Join,
          compat: Callable[[CelType, CelType], bool]) -> bool:  # fmt: skip
    """Whether `have` fits `want`, binding `want`'s parameters in `bindings` as a side effect."""
    if want.kind == "param":
        bound = bindings.get(want.name)
        if bound is None:
            bindings[want.name] = have.as_nullable(False).with_size(None)
        else:
            joined = join(bound, have)
            bindings[want.name] = DYN if joined is None else joined
        return True
    if have.kind == "dyn" or want.kind == "dyn":
        for p in _params(want):
            bindings.setdefault(p, DYN)
        return True
    if want.kind != have.kind or len(want.params) != len(have.params):
        return False
    if want.kind == "abstract" and want.name != have.name:
        return False
    if not want.params:
        return compat(have, want)
    return all(unify(w, h, bindings, join, compat) for w, h in zip(want.params, have.params, strict=True))


def _params(t: CelType) -> list[str]:
    if t.kind == "param":
        return [t.name]
    return [name for p in t.params for name in _params(p)]


def substitute(t: CelType, bindings: dict[str, CelType]) -> CelType:
    """`t` with every parameter replaced by its binding (dyn when unbound)."""
    if t.kind == "param":
        return bindings.get(t.name, DYN)
    if not t.params:
        return t
    return CelType(t.kind, tuple(substitute(p, bindings) for p in t.params), t.cls, t.name, t.record)
