"""Run-time values CEL has and Python lacks: `Uint`, `TypeValue`, `OptionalValue`, `MixedKeyMap`.

`TypeValue` is a type used as a value; `MixedKeyMap` a map with both `true` and `1` as keys.

`as_uint` / `uint_deep` tag the uints of a value whose static type says uint (activation values may be plain
ints), following the shape `uint_shape` derives from the type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from nexuskv.cel.types import CelType

__all__ = ["NONE", "MixedKeyMap", "OptionalValue", "TypeValue", "Uint", "as_uint", "uint_deep", "uint_shape"]


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


class _BoolKey:
    """A bool as a key of a `MixedKeyMap`: never equal to 0 or 1."""

    __slots__ = ("value",)

    def __init__(self, value: bool) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BoolKey) and other.value is self.value

    def __hash__(self) -> int:
        return hash((_BoolKey, self.value))


def _wrap(k: Any) -> Any:
    return _BoolKey(k) if isinstance(k, bool) else k


def _unwrap(k: Any) -> Any:
    return k.value if isinstance(k, _BoolKey) else k


class MixedKeyMap(dict):  # type: ignore[type-arg]
    """A CEL map with a bool key beside a number Python deems equal (`{1: 'a', true: 'b'}`).

    Python's dict makes `true` and `1` one key; CEL does not. Bool keys are stored wrapped; lookups, iteration,
    `keys()` and `items()` see the plain values. Only map literals that need it are built as one.
    """

    def __getitem__(self, k: Any) -> Any:
        """The value at CEL key `k`."""
        return dict.__getitem__(self, _wrap(k))

    def __contains__(self, k: object) -> bool:
        """Whether CEL key `k` is present."""
        return dict.__contains__(self, _wrap(k))

    def get(self, k: Any, default: Any = None) -> Any:
        """The value at `k`, or `default`."""
        return dict.get(self, _wrap(k), default)

    def __iter__(self) -> Any:
        """The keys, plain."""
        return (_unwrap(k) for k in dict.__iter__(self))

    def keys(self) -> Any:
        """The keys, plain."""
        return [_unwrap(k) for k in dict.keys(self)]

    def items(self) -> Any:
        """(key, value) pairs, keys plain."""
        return [(_unwrap(k), v) for k, v in dict.items(self)]

    def __repr__(self) -> str:
        """Like a dict's."""
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self.items()) + "}"

    @classmethod
    def of(cls, items: Any) -> MixedKeyMap:
        """A map of (key, value) pairs; a repeated key raises KeyError."""
        out = cls()
        for k, v in items:
            w = _wrap(k)
            if dict.__contains__(out, w):
                raise KeyError(k)
            dict.__setitem__(out, w, v)
        return out
