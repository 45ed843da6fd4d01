"""Run-time values CEL has and Python lacks: `Uint`, `TypeValue` (a type used as a value) and `OptionalValue`.

`as_uint` / `uint_deep` tag the uints of a value whose static type says uint (activation values may be plain
ints), following the shape `uint_shape` derives from the type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from nexuskv.policy.types import CelType

__all__ = ["NONE", "OptionalValue", "TypeValue", "Uint", "as_uint", "uint_deep", "uint_shape"]


class Uint(int):
    """A CEL `uint` at run time: an int that remembers it is unsigned (arithmetic on it gives plain ints).

    Values whose static type is uint may be plain ints; where the checker only knows `dyn`, a `Uint` is how
    a value is known to be unsigned.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        """`5u`, CEL's spelling."""
        return f"{int(self)}u"

    __str__ = int.__repr__


@attrs.frozen(repr=False)
class TypeValue:
    """A CEL type used as a value (`type(1) == int`): compared by its name."""

    name: str

    def __repr__(self) -> str:
        """The type's name."""
        return self.name


@attrs.frozen(repr=False)
class OptionalValue:
    """An `optional(T)` value: `present` with a `value`, or `optional.none()`."""

    present: bool
    value: Any = None

    def __repr__(self) -> str:
        """`optional.of(v)` or `optional.none()`."""
        return f"optional.of({self.value!r})" if self.present else "optional.none()"


NONE = OptionalValue(False)
"""`optional.none()`."""


# --------------------------------------------------------------------------------------------- uint tagging


def as_uint(v: Any) -> Any:
    """A value of static type uint as a `Uint` (a plain int from the activation is tagged; None passes)."""
    return Uint(v) if type(v) is int else v


def uint_deep(v: Any, shape: Any) -> Any:
    """`v` with every uint inside tagged, following `shape` (see `uint_shape`)."""
    if v is None or shape is None:
        return v
    if shape == "u":
        return as_uint(v)
    tag = shape[0]
    if tag == "l" and isinstance(v, list | tuple):
        return [uint_deep(x, shape[1]) for x in v]
    if tag == "m" and isinstance(v, Mapping):
        return {uint_deep(k, shape[1]): uint_deep(x, shape[2]) for k, x in v.items()}
    if tag == "o" and isinstance(v, OptionalValue) and v.present:
        return OptionalValue(True, uint_deep(v.value, shape[1]))
    return v


def uint_shape(t: CelType) -> Any:
    """Where a value of type `t` holds uints: "u", ("l", elem), ("m", key, value), ("o", inner), or None."""
    if t.kind == "uint":
        return "u"
    if t.kind in ("list", "optional"):
        inner = uint_shape(t.elem)
        return None if inner is None else ("l" if t.kind == "list" else "o", inner)
    if t.kind == "map":
        k, v = uint_shape(t.key), uint_shape(t.elem)
        return None if k is None and v is None else ("m", k, v)
    return None
