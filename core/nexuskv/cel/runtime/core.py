"""Runtime helpers of the compiled CEL code, part one: `CelEvalError`, value kinds and checked int / uint arithmetic.

Every helper works on native Python values. `pos` arguments index the position table of the compiled
expression (-1 = unknown); the compiled wrapper turns them into line and column. Time and conversions are in
`conversions.py`, containers, logic and dyn dispatch in `dynamic.py`; the code generator takes its helpers from all
three.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from typing import Any, NoReturn

import attrs

from nexuskv.cel.values import OptionalValue, TypeValue, Uint

IMIN = -(1 << 63)
IMAX = (1 << 63) - 1
UMAX = (1 << 64) - 1
MAX_DURATION_S = 315_576_000_000
"""CEL's duration range: about +-10000 years."""
MAX_DURATION = _dt.timedelta(seconds=MAX_DURATION_S)
MAX_TIME_DIFFERENCE = _dt.timedelta(microseconds=9_223_372_036_854_775)
"""The largest `timestamp - timestamp` CEL computes: int64 nanoseconds, about +-292 years (as cel-go)."""
EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
SECOND = _dt.timedelta(seconds=1)


class CelEvalError(Exception):
    """A CEL runtime error: division by zero, overflow, missing key, bad conversion, null value...

    `line` and `column` (1-based) locate the failing sub-expression when known; `source` is the expression.
    """

    def __init__(
        self, message: str, line: int | None = None, column: int | None = None, source: str | None = None
    ) -> None:
        """Create the error; `pos` (internal) is filled in by the helpers."""
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self.source = source
        self.pos = -1

    def __str__(self) -> str:
        """The message, prefixed with `line:column` when known."""
        if self.line is not None:
            return f"{self.line}:{self.column}: {self.message}"
        return self.message


def err(message: str, pos: int = -1) -> NoReturn:
    """Raise a CelEvalError for the node at `pos`."""
    e = CelEvalError(message)
    e.pos = pos
    raise e


# --------------------------------------------------------------------------------------------- kinds


def kind(v: object) -> str:
    """The CEL kind of a native value (a plain Python int is `int`; a `Uint` is `uint`)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "uint" if isinstance(v, Uint) else "int"
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
        return "timestamp"
    if isinstance(v, _dt.timedelta):
        return "duration"
    if isinstance(v, TypeValue):
        return "type"
    if isinstance(v, OptionalValue):
        return "optional"
    if attrs.has(type(v)):
        return "message"
    return type(v).__name__


KIND_TYPE_NAMES = {"null": "null_type", "timestamp": "google.protobuf.Timestamp",
                   "duration": "google.protobuf.Duration", "optional": "optional_type"}  # fmt: skip
"""The name `type(x)` gives a kind, where it is not the kind itself."""


def type_name(v: object) -> str:
    """The name `type(v)` gives a native value: `int`, `uint`, `null_type`, `google.protobuf.Timestamp`..."""
    k = kind(v)
    return type(v).__name__ if k == "message" else KIND_TYPE_NAMES.get(k, k)


NUMERIC = frozenset({"int", "uint", "double"})
"""The number kinds: CEL compares and orders them with each other."""
MISSING = object()
"""What `map_find` returns for a key the map does not hold."""


def map_find(m: Mapping[Any, Any], k: Any) -> Any:
    """m[k] by CEL equality: numeric keys match across int, uint and double; bool never matches a number."""
    kk = kind(k)
    numeric = kk in NUMERIC
    for key, value in m.items():
        kkey = kind(key)
        if (kkey == kk or (numeric and kkey in NUMERIC)) and key == k:
            return value
    return MISSING


def nn(v: Any, pos: int = -1) -> Any:
    """`v`, or an error when it is null (an unset optional field used where a value is needed)."""
    if v is None:
        err("null value where a value is required (use has() or `!= null` first)", pos)
    return v


def var(a: Mapping[str, Any], name: str, pos: int = -1) -> Any:
    """The activation's value of a variable."""
    try:
        return a[name]
    except KeyError:
        err(f"no value for variable '{name}' in the activation", pos)


# --------------------------------------------------------------------------------------------- int / uint


def iadd(a: int, b: int, pos: int = -1) -> int:
    """int + int with overflow check."""
    r = a + b
    if IMIN <= r <= IMAX:
        return r
    err(f"int overflow: {a} + {b}", pos)


def isub(a: int, b: int, pos: int = -1) -> int:
    """int - int with overflow check."""
    r = a - b
    if IMIN <= r <= IMAX:
        return r
    err(f"int overflow: {a} - {b}", pos)


def imul(a: int, b: int, pos: int = -1) -> int:
    """int * int with overflow check."""
    r = a * b
    if IMIN <= r <= IMAX:
        return r
    err(f"int overflow: {a} * {b}", pos)


def idiv(a: int, b: int, pos: int = -1) -> int:
    """int / int, truncating toward zero."""
    if b == 0:
        err("division by zero", pos)
    q = abs(a) // abs(b)
    if (a < 0) != (b < 0):
        q = -q
    if q > IMAX:
        err(f"int overflow: {a} / {b}", pos)
    return q


def imod(a: int, b: int, pos: int = -1) -> int:
    """int % int; the result has the sign of the dividend."""
    if b == 0:
        err("modulus by zero", pos)
    if a == IMIN and b == -1:
        err(f"int overflow: {a} % {b}", pos)
    r = abs(a) % abs(b)
    return -r if a < 0 else r


def ineg(a: int, pos: int = -1) -> int:
    """-int with overflow check."""
    if a == IMIN:
        err(f"int overflow: -({a})", pos)
    return -a


def uadd(a: int, b: int, pos: int = -1) -> int:
    """uint + uint with overflow check."""
    r = a + b
    if r <= UMAX:
        return Uint(r)
    err(f"uint overflow: {a}u + {b}u", pos)


def usub(a: int, b: int, pos: int = -1) -> int:
    """uint - uint with overflow check."""
    r = a - b
    if r >= 0:
        return Uint(r)
    err(f"uint overflow: {a}u - {b}u", pos)


def umul(a: int, b: int, pos: int = -1) -> int:
    """uint * uint with overflow check."""
    r = a * b
    if r <= UMAX:
        return Uint(r)
    err(f"uint overflow: {a}u * {b}u", pos)


def udiv(a: int, b: int, pos: int = -1) -> int:
    """uint / uint."""
    if b == 0:
        err("division by zero", pos)
    return Uint(a // b)


def umod(a: int, b: int, pos: int = -1) -> int:
    """uint % uint."""
    if b == 0:
        err("modulus by zero", pos)
    return Uint(a % b)


def fdiv(a: float, b: float, pos: int = -1) -> float:
    """double / double with IEEE semantics (x / 0.0 is +-inf, 0.0 / 0.0 is NaN)."""
    try:
        return a / b
    except ZeroDivisionError:
        if a != a or a == 0:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
