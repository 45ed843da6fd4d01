"""Run-time values CEL has and Python lacks: `Uint`, `TypeValue` (a type used as a value) and `OptionalValue`.

`type_name` is the name `type(x)` gives a native value: `int`, `uint`, `double`, `bool`, `string`, `bytes`,
`null_type`, `list`, `map`, `google.protobuf.Timestamp`, `google.protobuf.Duration`, `type`, `optional_type`,
or a message's name.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["NONE", "OptionalValue", "TypeValue", "Uint", "type_name"]


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


def type_name(v: object) -> str:
    """The CEL type name of a native value, as `type(v)` reports it."""
    if v is None:
        return "null_type"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, Uint):
        return "uint"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "double"
    if isinstance(v, str):
        return "string"
    if isinstance(v, bytes | bytearray):
        return "bytes"
    if isinstance(v, list | tuple):
        return "list"
    if isinstance(v, Mapping):
        return "map"
    if isinstance(v, _dt.datetime):
        return "google.protobuf.Timestamp"
    if isinstance(v, _dt.timedelta):
        return "google.protobuf.Duration"
    if isinstance(v, TypeValue):
        return "type"
    if isinstance(v, OptionalValue):
        return "optional_type"
    return type(v).__name__
