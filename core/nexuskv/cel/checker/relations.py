"""Relations between CEL types used by the checker: compatibility, the join of two types, size bounds.

`compat` says whether a value of one type may stand where another is expected (`dyn` fits everything);
`join` is the common type of list elements, map entries and `?:` branches (None when there is none);
`FREE` is the element type of an empty literal, which takes the type it is joined with. Size bounds (`slen`,
`items`) fall back to the defaults of the cost model where a type declares none; a join or a concatenation
keeps a bound that is larger than that default.
"""

from __future__ import annotations

from nexuskv.cel.types import DEFAULT_MAX_LIST, DEFAULT_MAX_STRING, DYN, CelType, list_of, map_of, optional_of

__all__ = ["FREE", "compat", "items", "join", "nullable_eq", "size_bound", "slen", "sum_size"]


def compat(a: CelType, b: CelType) -> bool:
    """Whether a value of type `a` may stand where `b` is expected (dyn is compatible with everything)."""
    if a.kind == "dyn" or b.kind == "dyn":
        return True
    if a.kind != b.kind:
        return False
    if a.kind == "type":
        return True
    if a.kind in ("message", "param"):
        return a == b
    if a.kind == "abstract" and a.name != b.name:
        return False
    return all(compat(x, y) for x, y in zip(a.params, b.params, strict=True))


FREE = CelType("dyn", free=True)
"""The element type of an empty list or map literal: dyn, but joined with T it gives T."""


def join(a: CelType, b: CelType) -> CelType | None:
    """The common type of two branches / elements, or None."""
    if a.free:
        return b
    if b.free:
        return a
    if a.kind == "null" and b.kind != "null":
        return b.as_nullable()
    if b.kind == "null" and a.kind != "null":
        return a.as_nullable()
    if not compat(a, b):
        return None
    nullable = a.nullable or b.nullable
    if a.kind == "dyn" or b.kind == "dyn":
        return DYN
    size = None if a.max_size is None and b.max_size is None else max(size_bound(a), size_bound(b))
    if a.kind == "list":
        inner = join(a.elem, b.elem)
        assert inner is not None
        return list_of(inner, size).as_nullable(nullable)
    if a.kind == "map":
        k, v = join(a.key, b.key), join(a.elem, b.elem)
        assert k is not None and v is not None
        return map_of(k, v, size).as_nullable(nullable)
    if a.kind == "optional":
        inner = join(a.elem, b.elem)
        return optional_of(DYN if inner is None else inner)
    if a.kind == "abstract":
        joined = [join(x, y) for x, y in zip(a.params, b.params, strict=True)]
        return CelType("abstract", tuple(DYN if j is None else j for j in joined), name=a.name)
    return a.with_size(size).as_nullable(nullable)


def nullable_eq(a: CelType, b: CelType) -> bool:
    """`x == null` is allowed when x may be null (optional fields, messages, dyn)."""
    if a.kind == "null":
        a, b = b, a
    return b.kind == "null" and (a.nullable or a.kind in ("null", "dyn", "message"))


def slen(t: CelType) -> int:
    """The length bound of a string or bytes type (the default when none is declared)."""
    return t.max_size if t.max_size is not None and t.kind in ("string", "bytes") else DEFAULT_MAX_STRING


def items(t: CelType) -> int:
    """The item bound of a list or map type (the default when none is declared)."""
    return t.max_size if t.max_size is not None and t.kind in ("list", "map") else DEFAULT_MAX_LIST


def size_bound(t: CelType) -> int:
    """The size bound of a string, bytes, list or map type: characters, bytes or items (the default if none)."""
    return slen(t) if t.kind in ("string", "bytes") else items(t)


def sum_size(a: CelType, b: CelType) -> int:
    """The size bound of a concatenation `a + b`: the sum of both bounds (defaults where none is declared)."""
    return size_bound(a) + size_bound(b)
