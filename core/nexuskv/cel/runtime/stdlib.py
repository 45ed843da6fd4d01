"""Implementations of CEL's core standard functions that the overload table (`overloads.py`) dispatches to.

Conversions (`bool`, `bytes`, `timestamp(int)`, and the existing int / uint / double / string ones), `type()`,
the timestamp and duration accessors (with an optional IANA or `+hh:mm` time zone) and the optional-type
functions. Each works on native values and raises `CelEvalError` (via `err`) where CEL defines an error.
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
import zoneinfo
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from nexuskv.cel.runtime.conversions import (
    double_of_string,
    duration,
    int_of_double,
    int_of_string,
    int_of_timestamp,
    int_of_uint,
    string_of,
    timestamp,
    uint_of_double,
    uint_of_int,
    uint_of_string,
)
from nexuskv.cel.runtime.core import EPOCH, MISSING, err, map_find, type_name
from nexuskv.cel.runtime.timestamps import dur_ns
from nexuskv.cel.values import NONE, OptionalValue, TypeValue

__all__ = [
    "bool_of_string", "bytes_of_string", "double_of_string", "duration", "duration_part", "has_value",
    "identity", "int_of_double", "opt_entry", "opt_flat_map", "opt_has", "opt_index", "opt_items", "opt_map",
    "opt_select", "pairs", "Lazy", "entries", "int_of_string", "int_of_timestamp", "int_of_uint", "opt_or", "opt_value",
    "optional_none", "optional_of", "optional_of_non_zero", "or_value", "string_of", "time_part", "timestamp",
    "timestamp_of_int", "type_value", "uint_of_double", "uint_of_int", "uint_of_string",
]  # fmt: skip


def identity(v: Any) -> Any:
    """`dyn(x)`, `bool(bool)`, `timestamp(timestamp)`...: the value itself."""
    return v


def type_value(v: Any) -> TypeValue:
    """`type(x)` from the run-time value."""
    return TypeValue(type_name(v))


_TRUE = frozenset({"1", "t", "true", "TRUE", "True"})
_FALSE = frozenset({"0", "f", "false", "FALSE", "False"})


def bool_of_string(s: str) -> bool:
    """`bool(string)`: `true`, `True`, `TRUE`, `t`, `1` and their false counterparts."""
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    err(f"cannot convert {s!r} to bool")


def bytes_of_string(s: str) -> bytes:
    """`bytes(string)`: the UTF-8 encoding."""
    return s.encode("utf-8")


_MIN_TS = _dt.datetime(1, 1, 1, tzinfo=_dt.UTC)


def timestamp_of_int(seconds: int) -> _dt.datetime:
    """`timestamp(int)`: seconds since the Unix epoch, within years 1 to 9999."""
    try:
        return EPOCH + _dt.timedelta(seconds=seconds)
    except OverflowError:
        err(f"timestamp({seconds}) out of range")


_OFFSET = re.compile(r"^([+-]?)(\d{1,2}):(\d{2})$")


@functools.lru_cache(maxsize=128)
def _zone(name: str) -> _dt.tzinfo:
    m = _OFFSET.match(name)
    if m is not None:
        off = _dt.timedelta(hours=int(m.group(2)), minutes=int(m.group(3)))
        return _dt.timezone(-off if m.group(1) == "-" else off)
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        err(f"unknown time zone {name!r}")


_PARTS: dict[str, Callable[[_dt.datetime], int]] = {
    "getFullYear": lambda t: t.year,
    "getMonth": lambda t: t.month - 1,
    "getDate": lambda t: t.day,
    "getDayOfMonth": lambda t: t.day - 1,
    "getDayOfWeek": lambda t: (t.weekday() + 1) % 7,
    "getDayOfYear": lambda t: t.timetuple().tm_yday - 1,
    "getHours": lambda t: t.hour,
    "getMinutes": lambda t: t.minute,
    "getSeconds": lambda t: t.second,
    "getMilliseconds": lambda t: t.microsecond // 1000,
}


def time_part(name: str) -> Callable[..., int]:
    """The accessor `name` of a timestamp, in UTC or in the time zone given as a second argument."""
    part = _PARTS[name]

    def accessor(t: _dt.datetime, zone: str | None = None) -> int:
        if type(t) is not _dt.datetime:  # a NanoTimestamp: its arithmetic is UTC's, which zoneinfo's fromutc undid
            t = _dt.datetime(t.year, t.month, t.day, t.hour, t.minute, t.second, t.microsecond, tzinfo=t.tzinfo)
        local = t.astimezone(_zone(zone)) if zone is not None else t.astimezone(_dt.UTC)
        return part(local)

    accessor.__name__ = name
    return accessor


def duration_part(name: str) -> Callable[[_dt.timedelta], int]:
    """The accessor `name` of a duration: whole hours, minutes or seconds, or the milliseconds part."""

    def accessor(d: _dt.timedelta) -> int:
        ns = dur_ns(d)
        sign = -1 if ns < 0 else 1
        micros = abs(ns) // 1000
        if name == "getHours":
            return sign * (micros // 3_600_000_000)
        if name == "getMinutes":
            return sign * (micros // 60_000_000)
        if name == "getSeconds":
            return sign * (micros // 1_000_000)
        return sign * ((micros // 1000) % 1000)

    accessor.__name__ = name
    return accessor


# --------------------------------------------------------------------------------------------- optionals


def optional_of(v: Any) -> OptionalValue:
    """`optional.of(v)`."""
    return OptionalValue(True, v)


def optional_none() -> OptionalValue:
    """`optional.none()`."""
    return NONE


def _is_zero(v: Any) -> bool:
    if v is None or v is False:
        return True
    if isinstance(v, int | float | str | bytes | list | tuple | Mapping):
        return not v
    if isinstance(v, _dt.timedelta):
        return v == _dt.timedelta(0)
    if isinstance(v, _dt.datetime):
        return v == EPOCH
    return False


def optional_of_non_zero(v: Any) -> OptionalValue:
    """`optional.ofNonZeroValue(v)`: none for null, false, 0, "", empty lists and maps, else `of(v)`."""
    return NONE if _is_zero(v) else OptionalValue(True, v)


def has_value(o: OptionalValue) -> bool:
    """`o.hasValue()`."""
    return o.present


def opt_value(o: OptionalValue) -> Any:
    """`o.value()`: an error on `optional.none()`."""
    if not o.present:
        err("optional.none() has no value")
    return o.value


def or_value(o: OptionalValue, default: Any) -> Any:
    """`o.orValue(default)`."""
    return o.value if o.present else default


def opt_or(o: OptionalValue, other: OptionalValue) -> OptionalValue:
    """`o.or(other)`."""
    return o if o.present else other


def _unwrap(obj: Any) -> tuple[bool, Any]:
    if isinstance(obj, OptionalValue):
        return obj.present, obj.value
    return True, obj


def opt_select(obj: Any, field: str, pos: int = -1) -> OptionalValue:
    """`obj.?field` (and `obj.field` on an optional): the field or key if present, else `optional.none()`."""
    present, obj = _unwrap(obj)
    if not present:
        return NONE
    if isinstance(obj, Mapping):
        return OptionalValue(True, obj[field]) if field in obj else NONE
    if attrs.has(type(obj)):
        if field not in attrs.fields_dict(type(obj)):
            err(f"no such field '{field}' on {type(obj).__name__}", pos)
        value = getattr(obj, field)
        return NONE if value is None else OptionalValue(True, value)
    err(f"cannot select field '{field}' of {type_name(obj)}", pos)


def opt_index(obj: Any, key: Any, pos: int = -1) -> OptionalValue:
    """`obj[?key]` (and `obj[key]` on an optional): the item if present, else `optional.none()`."""
    present, obj = _unwrap(obj)
    if not present:
        return NONE
    if isinstance(obj, list | tuple):
        if isinstance(key, float) and key.is_integer():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int):
            err(f"list index must be int, got {type_name(key)}", pos)
        return OptionalValue(True, obj[key]) if 0 <= key < len(obj) else NONE
    if isinstance(obj, Mapping):
        found = map_find(obj, key)
        return NONE if found is MISSING else OptionalValue(True, found)
    err(f"cannot index {type_name(obj)}", pos)


def opt_has(obj: Any, field: str, pos: int = -1) -> bool:
    """`has(o.field)` on an optional: present, with that field or key."""
    return opt_select(obj, field, pos).present


def opt_items(o: Any, pos: int = -1) -> tuple[Any, ...]:
    """`?x` in a list literal: (value,) or ()."""
    if not isinstance(o, OptionalValue):
        err(f"?x in a list needs an optional value, got {type_name(o)}", pos)
    return (o.value,) if o.present else ()


def opt_entry(key: Any, o: Any, pos: int = -1) -> tuple[tuple[Any, Any], ...]:
    """`?k: x` in a map literal: ((k, value),) or ()."""
    if not isinstance(o, OptionalValue):
        err(f"?k: x in a map needs an optional value, got {type_name(o)}", pos)
    return ((key, o.value),) if o.present else ()


def opt_map(o: Any, f: Callable[[Any], Any], pos: int = -1) -> OptionalValue:
    """`o.optMap(x, expr)`: `optional.of(expr)` over the value, none stays none."""
    if not isinstance(o, OptionalValue):
        err(f"optMap() needs an optional, got {type_name(o)}", pos)
    return OptionalValue(True, f(o.value)) if o.present else NONE


def opt_flat_map(o: Any, f: Callable[[Any], Any], pos: int = -1) -> OptionalValue:
    """`o.optFlatMap(x, expr)`: expr (an optional) over the value, none stays none."""
    if not isinstance(o, OptionalValue):
        err(f"optFlatMap() needs an optional, got {type_name(o)}", pos)
    if not o.present:
        return NONE
    r = f(o.value)
    if not isinstance(r, OptionalValue):
        err(f"optFlatMap() expression must give an optional, got {type_name(r)}", pos)
    return r


class Lazy:
    """A value computed on first call and remembered (`cel.bind`); a failure is raised again on each call."""

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        """Wrap the computation."""
        self._fn = fn
        self._value: Any = _UNSET

    def __call__(self) -> Any:
        """The value."""
        if self._value is _UNSET:
            self._value = self._fn()
        return self._value


_UNSET = object()


def entries(v: Any, pos: int = -1) -> Any:
    """The (key, value) pairs of a map made by `transformMapEntry`'s expression."""
    if not isinstance(v, Mapping):
        err(f"transformMapEntry() expression must give a map, got {type_name(v)}", pos)
    return v.items()


def pairs(v: Any, pos: int = -1) -> Any:
    """The (index, item) pairs of a list or the (key, value) pairs of a map, for two-variable comprehensions."""
    if isinstance(v, list | tuple):
        return enumerate(v)
    if isinstance(v, Mapping):
        return v.items()
    err(f"cannot iterate over {type_name(v)}", pos)
