"""The overload table of CEL's standard functions and extensions, and their run-time dispatch.

Each function name (`bool`, `charAt`, `math.greatest`, `getFullYear`...) has overloads: whether it is called
as a method, the kinds of its arguments (`dyn` matches anything; `num` any of int, uint, double; `*num` any
number of numbers), the result type (or a function of the argument types) and the implementation over native
values. The checker picks the overloads that the static argument types allow (`candidates`); when exactly one
fits exactly the generated code calls its implementation directly, otherwise it calls `dispatch`, which picks
by the run-time kinds. Implementations live in `stdlib.py` (core functions, time) and `extensions.py` (strings,
math, encoders extensions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from nexuskv.cel.runtime import extensions as ext
from nexuskv.cel.runtime import stdlib as lib
from nexuskv.cel.runtime.core import NUMERIC, err, kind
from nexuskv.cel.types import (
    BOOL,
    BYTES,
    DOUBLE,
    DURATION,
    DYN,
    INT,
    STRING,
    TIMESTAMP,
    UINT,
    CelType,
    list_of,
    optional_of,
    type_of,
)

__all__ = ["FUNCTIONS", "Overload", "candidates", "dispatch", "is_function", "result_of"]

Result = CelType | Callable[[Sequence[CelType]], CelType]


@attrs.frozen
class Overload:
    """One overload: method or function, argument kinds (receiver first), result, implementation."""

    method: bool
    args: tuple[str, ...]
    result: Result
    impl: Callable[..., Any] = attrs.field(eq=False)

    def arity_ok(self, n: int) -> bool:
        """Whether `n` arguments (receiver included) fit."""
        if self.args and self.args[-1].startswith("*"):
            return n >= len(self.args)
        return n == len(self.args)

    def kinds(self, n: int) -> tuple[str, ...]:
        """The kind wanted for each of `n` arguments (a variadic last kind repeats)."""
        if self.args and self.args[-1].startswith("*"):
            head, rest = self.args[:-1], self.args[-1][1:]
            return (*head, *([rest] * (n - len(head))))
        return self.args


def _fits(want: str, have: str) -> bool:
    return want == "dyn" or have == "dyn" or want == have or (want == "num" and have in NUMERIC)


def _exact(want: str, have: str) -> bool:
    return want == have or want == "dyn" or (want == "num" and have in NUMERIC)


def candidates(name: str, method: bool, args: Sequence[CelType]) -> tuple[list[Overload], bool]:
    """Overloads of `name` that the static argument types allow, and whether the first one fits exactly."""
    found = []
    exact = False
    for ov in FUNCTIONS.get(name, ()):
        if ov.method != method or not ov.arity_ok(len(args)):
            continue
        kinds = ov.kinds(len(args))
        if all(_fits(w, a.kind) for w, a in zip(kinds, args, strict=True)):
            if not found:
                exact = all(_exact(w, a.kind) for w, a in zip(kinds, args, strict=True))
            found.append(ov)
    return found, exact and len(found) == 1


def result_of(overloads: Sequence[Overload], args: Sequence[CelType]) -> CelType:
    """The result type of a call that may resolve to any of `overloads` (dyn when they differ)."""
    results = {str(r := (ov.result(args) if callable(ov.result) else ov.result)): r for ov in overloads}
    return next(iter(results.values())) if len(results) == 1 else DYN


def is_function(name: str, method: bool) -> bool:
    """Whether `name` has an overload called this way."""
    return any(ov.method == method for ov in FUNCTIONS.get(name, ()))


def dispatch(name: str, method: bool, pos: int, *args: Any) -> Any:
    """Call the overload of `name` that the run-time kinds of `args` select."""
    kinds = [kind(a) for a in args]
    for ov in FUNCTIONS.get(name, ()):
        if (
            ov.method == method
            and ov.arity_ok(len(args))
            and all(_exact(w, k) for w, k in zip(ov.kinds(len(args)), kinds, strict=True))
        ):
            return ov.impl(*args)
    err(f"no such overload: {name}({', '.join(kinds)})", pos)


def _elem(args: Sequence[CelType]) -> CelType:
    t = args[0]
    return t.elem if t.kind in ("list", "optional") else DYN


def _same(i: int) -> Callable[[Sequence[CelType]], CelType]:
    return lambda args: args[i].as_nullable(False).with_size(None)


def _numbers(args: Sequence[CelType]) -> CelType:
    kinds = {a.elem.kind if a.kind == "list" else a.kind for a in args}
    return CelType(kinds.pop()) if len(kinds) == 1 and not kinds & {"dyn"} else DYN


def _F(*overloads: tuple[bool, tuple[str, ...], Result, Callable[..., Any]]) -> list[Overload]:
    return [Overload(m, a, r, f) for m, a, r, f in overloads]


_TIME_PARTS = ("getFullYear", "getMonth", "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear")

FUNCTIONS: dict[str, list[Overload]] = {
    "dyn": _F((False, ("dyn",), DYN, lib.identity)),
    "type": _F((False, ("dyn",), lambda a: type_of(a[0]), lib.type_value)),
    "bool": _F((False, ("bool",), BOOL, lib.identity), (False, ("string",), BOOL, lib.bool_of_string)),
    "bytes": _F((False, ("bytes",), BYTES, lib.identity), (False, ("string",), BYTES, lib.bytes_of_string)),
    "int": _F((False, ("int",), INT, lib.identity), (False, ("uint",), INT, lib.int_of_uint),
              (False, ("double",), INT, lib.int_of_double), (False, ("string",), INT, lib.int_of_string),
              (False, ("timestamp",), INT, lib.int_of_timestamp)),
    "uint": _F((False, ("uint",), UINT, lib.identity), (False, ("int",), UINT, lib.uint_of_int),
               (False, ("double",), UINT, lib.uint_of_double), (False, ("string",), UINT, lib.uint_of_string)),
    "double": _F((False, ("double",), DOUBLE, lib.identity), (False, ("int",), DOUBLE, float),
                 (False, ("uint",), DOUBLE, float), (False, ("string",), DOUBLE, lib.double_of_string)),
    "string": _F(*((False, (k,), STRING, lib.string_of) for k in
                   ("string", "int", "uint", "double", "bool", "bytes", "timestamp", "duration"))),
    "timestamp": _F((False, ("string",), TIMESTAMP, lib.timestamp), (False, ("timestamp",), TIMESTAMP,
                    lib.identity), (False, ("int",), TIMESTAMP, lib.timestamp_of_int)),
    "duration": _F((False, ("string",), DURATION, lib.duration), (False, ("duration",), DURATION, lib.identity)),
    **{name: _F((True, ("timestamp",), INT, lib.time_part(name)),
                (True, ("timestamp", "string"), INT, lib.time_part(name))) for name in _TIME_PARTS},
    **{name: _F((True, ("timestamp",), INT, lib.time_part(name)),
                (True, ("timestamp", "string"), INT, lib.time_part(name)),
                (True, ("duration",), INT, lib.duration_part(name)))
       for name in ("getHours", "getMinutes", "getSeconds", "getMilliseconds")},
    # strings extension
    "charAt": _F((True, ("string", "int"), STRING, ext.char_at)),
    "indexOf": _F((True, ("string", "string"), INT, ext.index_of), (True, ("string", "string", "int"), INT,
                  ext.index_of)),
    "lastIndexOf": _F((True, ("string", "string"), INT, ext.last_index_of),
                      (True, ("string", "string", "int"), INT, ext.last_index_of)),
    "lowerAscii": _F((True, ("string",), STRING, ext.lower_ascii)),
    "upperAscii": _F((True, ("string",), STRING, ext.upper_ascii)),
    "replace": _F((True, ("string", "string", "string"), STRING, ext.replace),
                  (True, ("string", "string", "string", "int"), STRING, ext.replace)),
    "split": _F((True, ("string", "string"), list_of(STRING), ext.split),
                (True, ("string", "string", "int"), list_of(STRING), ext.split)),
    "substring": _F((True, ("string", "int"), STRING, ext.substring),
                    (True, ("string", "int", "int"), STRING, ext.substring)),
    "trim": _F((True, ("string",), STRING, ext.trim)),
    "reverse": _F((True, ("string",), STRING, ext.reverse)),
    "join": _F((True, ("list",), STRING, ext.join), (True, ("list", "string"), STRING, ext.join)),
    "format": _F((True, ("string", "list"), STRING, ext.format_)),
    "strings.quote": _F((False, ("string",), STRING, ext.quote)),
    # math extension
    "math.greatest": _F((False, ("*num",), _numbers, ext.greatest), (False, ("list",), _elem, ext.greatest)),
    "math.least": _F((False, ("*num",), _numbers, ext.least), (False, ("list",), _elem, ext.least)),
    **{f"math.{name}": _F((False, ("double",), DOUBLE, fn)) for name, fn in (
        ("ceil", ext.ceil), ("floor", ext.floor), ("round", ext.round_), ("trunc", ext.trunc))},
    **{f"math.{name}": _F((False, ("double",), BOOL, fn)) for name, fn in (
        ("isNaN", ext.is_nan), ("isInf", ext.is_inf), ("isFinite", ext.is_finite))},
    "math.abs": _F((False, ("int",), INT, ext.abs_), (False, ("uint",), UINT, ext.unsigned(ext.abs_)),
                   (False, ("double",), DOUBLE, ext.abs_)),
    "math.sign": _F((False, ("int",), INT, ext.sign), (False, ("uint",), UINT, ext.unsigned(ext.sign)),
                    (False, ("double",), DOUBLE, ext.sign)),
    "math.sqrt": _F((False, ("num",), DOUBLE, ext.sqrt)),
    **{f"math.{name}": _F((False, ("int", "int"), INT, fn), (False, ("uint", "uint"), UINT, ext.unsigned(fn)))
       for name, fn in (("bitAnd", ext.bit_and), ("bitOr", ext.bit_or), ("bitXor", ext.bit_xor))},
    "math.bitNot": _F((False, ("int",), INT, ext.bit_not), (False, ("uint",), UINT, ext.unsigned(ext.bit_not))),
    "math.bitShiftLeft": _F((False, ("int", "int"), INT, ext.shift_left), (False, ("uint", "int"), UINT,
                            ext.unsigned(ext.shift_left))),
    "math.bitShiftRight": _F((False, ("int", "int"), INT, ext.shift_right), (False, ("uint", "int"), UINT,
                             ext.unsigned(ext.shift_right))),
    # encoders extension
    "base64.encode": _F((False, ("bytes",), STRING, ext.base64_encode)),
    "base64.decode": _F((False, ("string",), BYTES, ext.base64_decode)),
    # optional types
    "optional.of": _F((False, ("dyn",), lambda a: optional_of(a[0]), lib.optional_of)),
    "optional.ofNonZeroValue": _F((False, ("dyn",), lambda a: optional_of(a[0]), lib.optional_of_non_zero)),
    "optional.none": _F((False, (), optional_of(CelType("dyn", free=True)), lib.optional_none)),
    "hasValue": _F((True, ("optional",), BOOL, lib.has_value)),
    "value": _F((True, ("optional",), _elem, lib.opt_value)),
    "orValue": _F((True, ("optional", "dyn"), lambda a: _elem(a) if a[0].kind == "optional" else DYN,
                   lib.or_value)),
    "or": _F((True, ("optional", "optional"), _same(0), lib.opt_or)),
}  # fmt: skip
