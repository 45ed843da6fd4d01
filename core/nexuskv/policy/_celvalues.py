"""Run-time values CEL has and Python lacks: `Uint`, `TypeValue` (a type used as a value) and `OptionalValue`."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["NONE", "OptionalValue", "TypeValue", "Uint"]


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
