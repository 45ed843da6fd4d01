"""Implementations of CEL's standard extensions: strings, math and encoders (as cel-go's `ext` package defines).

String indexes count Unicode code points. Errors (an index out of range, a negative shift, an integer
overflow, a bad format clause) raise `CelEvalError` through `err`.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Sequence
from typing import Any

from nexuskv.cel.runtime.conversions import format_double, string_of_duration, string_of_timestamp
from nexuskv.cel.runtime.core import IMAX, IMIN, UMAX, err, kind
from nexuskv.cel.values import Uint

# --------------------------------------------------------------------------------------------- strings


def char_at(s: str, i: int) -> str:
    """`s.charAt(i)`: the code point at i, "" at the end."""
    if not 0 <= i <= len(s):
        err(f"index out of range: {i}")
    return s[i : i + 1]


def index_of(s: str, sub: str, start: int = 0) -> int:
    """`s.indexOf(sub[, start])`: the first index of sub at or after start, or -1."""
    if not 0 <= start <= len(s):
        err(f"index out of range: {start}")
    return s.find(sub, start)


def last_index_of(s: str, sub: str, start: int | None = None) -> int:
    """`s.lastIndexOf(sub[, start])`: the last index of sub starting at or before start, or -1."""
    if start is None:
        return s.rfind(sub)
    if not 0 <= start <= len(s):
        err(f"index out of range: {start}")
    return s.rfind(sub, 0, start + len(sub))


def lower_ascii(s: str) -> str:
    """`s.lowerAscii()`: only A-Z change."""
    return s.translate(_LOWER)


def upper_ascii(s: str) -> str:
    """`s.upperAscii()`: only a-z change."""
    return s.translate(_UPPER)


_LOWER = {c: c + 32 for c in range(65, 91)}
_UPPER = {c: c - 32 for c in range(97, 123)}


MAX_STRING_CHARS = 1 << 20
"""The longest string `replace`, `format` and `join` build (about 1 Mi characters); a longer one is an error,
never a stall: checked before it is built."""
SIZE_LIMIT = "over the size limit"
MAX_PRECISION = 1000
"""The largest precision of a `format` clause (`%.1000f`)."""


def _bounded(size: int, what: str) -> None:
    if size > MAX_STRING_CHARS:
        err(f"{what}: a string of {size} characters, {SIZE_LIMIT} of {MAX_STRING_CHARS}")


def replace(s: str, old: str, new: str, n: int = -1) -> str:
    """`s.replace(old, new[, n])`: at most n replacements (all when n < 0); the result is size-bounded."""
    if len(new) > len(old):
        count = len(s) + 1 if old == "" else s.count(old)
        if n >= 0:
            count = min(count, n)
        _bounded(len(s) + count * (len(new) - len(old)), "replace()")
    return s.replace(old, new, n if n >= 0 else -1)


def split(s: str, sep: str, n: int = -1) -> list[str]:
    """`s.split(sep[, n])`: at most n parts (no limit when n < 0, none when n == 0)."""
    if n == 0:
        return []
    if sep == "":
        chars = list(s)
        if 0 < n < len(chars):
            return [*chars[: n - 1], "".join(chars[n - 1 :])]
        return chars
    return s.split(sep, n - 1 if n > 0 else -1)


def substring(s: str, start: int, end: int | None = None) -> str:
    """`s.substring(start[, end])` by code points."""
    stop = len(s) if end is None else end
    if not 0 <= start <= len(s) or not 0 <= stop <= len(s):
        err(f"index out of range: {start if not 0 <= start <= len(s) else stop}")
    if stop < start:
        err(f"invalid substring range. start: {start}, end: {stop}")
    return s[start:stop]


_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
         "\u2028\u2029\u202f\u205f\u3000"  # fmt: skip


def trim(s: str) -> str:
    """`s.trim()`: Unicode white space off both ends."""
    return s.strip(_SPACE)


def reverse(s: str) -> str:
    """`s.reverse()` by code points."""
    return s[::-1]


def join(items: Sequence[Any], sep: str = "") -> str:
    """`list.join([sep])` of a list of strings."""
    for item in items:
        if not isinstance(item, str):
            err(f"join(): list elements must be strings, got {kind(item)}")
    _bounded(sum(map(len, items)) + len(sep) * max(len(items) - 1, 0), "join()")
    return sep.join(items)


_QUOTE = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v",
          "\\": "\\\\", '"': '\\"'}  # fmt: skip


def quote(s: str) -> str:
    """`strings.quote(s)`: s in double quotes with C escapes."""
    return '"' + "".join(_QUOTE.get(c, c) for c in s) + '"'


_CLAUSE = re.compile(r"%(?:\.(\d+))?(.)?", re.S)


def format_(fmt: str, args: Sequence[Any]) -> str:
    """`fmt.format(args)`: %s %d %f %e %b %o %x %X with optional precision, %% for a percent sign."""
    out: list[str] = []
    pos = size = 0
    i = 0
    for m in _CLAUSE.finditer(fmt):
        out.append(fmt[pos : m.start()])
        pos = m.end()
        prec, verb = m.groups()
        if verb == "%" and prec is None:
            out.append("%")
            continue
        if verb not in ("s", "d", "f", "e", "b", "o", "x", "X"):
            err(f"could not parse formatting clause: unrecognized formatting clause {verb!r}")
        if i >= len(args):
            err(f"index {i} out of range")
        if prec is not None and (len(prec) > 4 or int(prec) > MAX_PRECISION):
            err(f"format(): precision {prec} is {SIZE_LIMIT} of {MAX_PRECISION}")
        out.append(_clause(verb, None if prec is None else int(prec), args[i]))
        size += len(out[-1])
        _bounded(size + len(fmt), "format()")
        i += 1
    out.append(fmt[pos:])
    return "".join(out)


def _special(x: float) -> str | None:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return None


def _clause(verb: str, prec: int | None, v: Any) -> str:
    k = kind(v)
    if verb == "s":
        if k in ("list", "map"):  # a container's text is counted before it is built: nested lists multiply it
            _bounded(_text_size(v), "format()")
        return _as_string(v)
    if verb == "d":
        if k in ("int", "uint"):
            return str(int(v))
        if k == "double" and _special(v):
            return _special(v)  # type: ignore[return-value]
        err(f"error during formatting: decimal clause can only be used on integers, was given {k}")
    if verb in ("f", "e"):
        if k not in ("int", "uint", "double"):
            what = "fixed-point" if verb == "f" else "scientific"
            err(f"error during formatting: {what} clause can only be used on doubles, was given {k}")
        x = float(v)
        return _special(x) or f"{x:.{6 if prec is None else prec}{verb}}"
    if k == "bool" and verb in "box":
        v, k = int(v), "int"
    if k in ("int", "uint"):
        return format(int(v), verb)
    if verb in "xX" and k in ("string", "bytes"):
        data = v.encode("utf-8") if k == "string" else bytes(v)
        text = data.hex()
        return text.upper() if verb == "X" else text
    if verb == "o":
        err(f"error during formatting: octal clause can only be used on integers, was given {k}")
    err(f"error during formatting: only integers, byte buffers, and strings can be formatted as hex, was given {k}")


def _text_size(v: Any, limit: int = MAX_STRING_CHARS) -> int:
    """At least how long `_as_string(v)` is, counted without building it (stops once past `limit`)."""
    k = kind(v)
    if k in ("string", "bytes"):
        return len(v)
    if k not in ("list", "map"):
        return 1  # a scalar's text is short
    size = 2
    for item in (v if k == "list" else (x for pair in v.items() for x in pair)):
        size += 2 + _text_size(item, limit - size)
        if size > limit:
            break
    return size


def _as_string(v: Any) -> str:
    k = kind(v)
    if k == "null":
        return "null"
    if k == "bool":
        return "true" if v else "false"
    if k in ("int", "uint"):
        return str(int(v))
    if k == "double":
        return _special(v) or format_double(v)
    if k == "string":
        return v
    if k == "bytes":
        return bytes(v).decode("utf-8", "replace")
    if k == "timestamp":
        return string_of_timestamp(v)
    if k == "duration":
        return string_of_duration(v)
    if k == "type":
        return str(v.name)
    if k == "list":
        return "[" + ", ".join(_as_string(x) for x in v) + "]"
    if k == "map":
        items = sorted((_as_string(a), _as_string(b)) for a, b in v.items())
        return "{" + ", ".join(f"{a}: {b}" for a, b in items) + "}"
    err(f"error during formatting: string clause can only be used on strings, bools, bytes, ints, doubles, maps, "
        f"lists, types, durations, and timestamps, was given {k}")  # fmt: skip


# --------------------------------------------------------------------------------------------- math


def _extreme(args: tuple[Any, ...], pick: Any) -> Any:
    items = list(args[0]) if len(args) == 1 and kind(args[0]) == "list" else list(args)
    if not items:
        err("math.greatest() / math.least() need at least one value")
    for x in items:
        if kind(x) not in ("int", "uint", "double"):
            err(f"no such overload: math function applied to {kind(x)}")
    best = items[0]
    for x in items[1:]:
        if pick(x, best):
            best = x
    return best


def greatest(*args: Any) -> Any:
    """`math.greatest(a, b, ...)` or `math.greatest(list)` of numbers of any kinds."""
    return _extreme(args, lambda x, best: x > best)


def least(*args: Any) -> Any:
    """`math.least(a, b, ...)` or `math.least(list)`."""
    return _extreme(args, lambda x, best: x < best)


def ceil(x: float) -> float:
    """`math.ceil(double)`."""
    return float(math.ceil(x)) if math.isfinite(x) else x


def floor(x: float) -> float:
    """`math.floor(double)`."""
    return float(math.floor(x)) if math.isfinite(x) else x


def round_(x: float) -> float:
    """`math.round(double)`: half away from zero."""
    if not math.isfinite(x):
        return x
    r = math.floor(abs(x) + 0.5)
    return math.copysign(float(r), x)


def trunc(x: float) -> float:
    """`math.trunc(double)`."""
    return float(math.trunc(x)) if math.isfinite(x) else x


def is_nan(x: float) -> bool:
    """`math.isNaN(double)`."""
    return math.isnan(x)


def is_inf(x: float) -> bool:
    """`math.isInf(double)`."""
    return math.isinf(x)


def is_finite(x: float) -> bool:
    """`math.isFinite(double)`."""
    return math.isfinite(x)


def abs_(x: Any) -> Any:
    """`math.abs(x)`; `math.abs(-2^63)` overflows."""
    if isinstance(x, float):
        return abs(x)
    if x == IMIN:
        err("integer overflow in math.abs()")
    return Uint(x) if isinstance(x, Uint) else abs(x)


def sign(x: Any) -> Any:
    """`math.sign(x)`: -1, 0 or 1 of x's kind (NaN for NaN)."""
    if isinstance(x, float):
        return x if math.isnan(x) else float((x > 0) - (x < 0))
    s = (x > 0) - (x < 0)
    return Uint(s) if isinstance(x, Uint) else s


def sqrt(x: Any) -> float:
    """`math.sqrt(number)`: NaN for negative numbers."""
    x = float(x)
    return math.sqrt(x) if x >= 0 else math.nan


def _signed(v: int) -> int:
    v &= UMAX
    return v - (1 << 64) if v > IMAX else v


def _bits(a: Any, value: int) -> Any:
    return Uint(value & UMAX) if isinstance(a, Uint) else _signed(value)


def unsigned(fn: Any) -> Any:
    """The uint overload of an int function: arguments and result are uints, whatever their Python type."""

    def wrapped(*args: Any) -> Uint:
        return Uint(int(fn(Uint(args[0]), *args[1:])) & UMAX)

    wrapped.__name__ = f"{fn.__name__}_uint"
    return wrapped


def bit_and(a: int, b: int) -> Any:
    """`math.bitAnd(a, b)`."""
    return _bits(a, a & b)


def bit_or(a: int, b: int) -> Any:
    """`math.bitOr(a, b)`."""
    return _bits(a, a | b)


def bit_xor(a: int, b: int) -> Any:
    """`math.bitXor(a, b)`."""
    return _bits(a, a ^ b)


def bit_not(a: int) -> Any:
    """`math.bitNot(a)`."""
    return _bits(a, ~a)


def shift_left(a: int, n: int) -> Any:
    """`math.bitShiftLeft(a, n)`: 0 from 64 bits on; a negative n is an error."""
    if n < 0:
        err(f"math.bitShiftLeft() negative offset: {n}")
    return _bits(a, (a << n) if n < 64 else 0)


def shift_right(a: int, n: int) -> Any:
    """`math.bitShiftRight(a, n)`: a logical shift (the sign bit is not kept)."""
    if n < 0:
        err(f"math.bitShiftRight() negative offset: {n}")
    return _bits(a, ((a & UMAX) >> n) if n < 64 else 0)


# --------------------------------------------------------------------------------------------- encoders


def base64_encode(b: bytes) -> str:
    """`base64.encode(bytes)`: standard alphabet with padding."""
    return base64.b64encode(bytes(b)).decode("ascii")


def base64_decode(s: str) -> bytes:
    """`base64.decode(string)`: padding optional."""
    try:
        return base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        err(f"base64.decode(): {exc}")

