"""Runtime helpers of the compiled CEL code, part two: timestamps and durations, conversions, regular expressions.

Conversions follow CEL's range and format rules (int / uint / double / string / bytes / timestamp / duration),
raising `CelEvalError` where the spec says a conversion fails.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import re
from decimal import Decimal
from typing import Any

import re2

from nexuskv.cel.runtime.core import (
    EPOCH,
    IMAX,
    IMIN,
    MAX_DURATION,
    MAX_DURATION_S,
    MAX_TIME_DIFFERENCE,
    SECOND,
    UMAX,
    err,
    kind,
)
from nexuskv.cel.runtime.timestamps import dur_ns, frac_digits, make_dur, make_ts, ts_ns
from nexuskv.cel.values import Uint
from nexuskv.units import parse_bytes

# --------------------------------------------------------------------------------------------- time


def _check_duration(d: _dt.timedelta, pos: int) -> _dt.timedelta:
    if -MAX_DURATION <= d <= MAX_DURATION:
        return d
    err("duration out of range", pos)


_MAX_DURATION_NS = MAX_DURATION_S * 1_000_000_000
_MAX_DIFFERENCE_NS = dur_ns(MAX_TIME_DIFFERENCE)


def _timestamp_of(ns: int, pos: int) -> _dt.datetime:
    try:
        return make_ts(ns)
    except OverflowError:
        err("timestamp out of range", pos)


_PLAIN = (_dt.datetime, _dt.timedelta)


def _sum_of_durations(ns: int, pos: int) -> _dt.timedelta:
    """A duration made by adding or subtracting durations, which must fit int64 nanoseconds.

    cel-cpp and cel-go compute it so and report an overflow, though a literal may reach the protobuf range of
    10,000 years.
    """
    if -(1 << 63) <= ns <= (1 << 63) - 1:
        return make_dur(ns)
    err("duration arithmetic overflows int64 nanoseconds", pos)


def tadd(a: Any, b: Any, pos: int = -1) -> Any:
    """timestamp + duration, duration + timestamp, duration + duration, to the nanosecond, range-checked."""
    if isinstance(a, _dt.timedelta) and isinstance(b, _dt.timedelta):
        return _sum_of_durations(dur_ns(a) + dur_ns(b), pos)
    if type(a) in _PLAIN and type(b) in _PLAIN:  # whole microseconds: Python's own arithmetic is exact
        try:
            r = a + b
        except OverflowError:
            err("timestamp out of range", pos)
        return _check_duration(r, pos) if isinstance(r, _dt.timedelta) else r
    if isinstance(a, _dt.datetime) or isinstance(b, _dt.datetime):
        t, d = (a, b) if isinstance(a, _dt.datetime) else (b, a)
        return _timestamp_of(ts_ns(t) + dur_ns(d), pos)
    return _sum_of_durations(dur_ns(a) + dur_ns(b), pos)


def tsub(a: Any, b: Any, pos: int = -1) -> Any:
    """timestamp - timestamp, timestamp - duration, duration - duration, to the nanosecond, range-checked.

    A difference of timestamps must fit int64 nanoseconds (about 292 years), as in cel-go.
    """
    if isinstance(a, _dt.datetime):
        if isinstance(b, _dt.datetime):
            ns = ts_ns(a) - ts_ns(b)
            if not -_MAX_DIFFERENCE_NS <= ns <= _MAX_DIFFERENCE_NS:
                err("timestamp difference out of range", pos)
            return make_dur(ns)
        if type(a) in _PLAIN and type(b) in _PLAIN:
            try:
                return a - b
            except OverflowError:
                err("timestamp out of range", pos)
        return _timestamp_of(ts_ns(a) - dur_ns(b), pos)
    return _sum_of_durations(dur_ns(a) - dur_ns(b), pos)


_DURATION_UNITS = {
    "ns": Decimal("0.000000001"), "us": Decimal("0.000001"), "µs": Decimal("0.000001"),
    "μs": Decimal("0.000001"), "ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600),
}  # fmt: skip
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(r"^[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+$")


def duration(text: str, pos: int = -1) -> _dt.timedelta:
    """Parse a Go-style duration (`30s`, `1.5h`, `-2m30s`, `100ms`, `1ns`) to the nanosecond."""
    if text in ("0", "+0", "-0"):
        return _dt.timedelta(0)
    if not isinstance(text, str) or not _DURATION.match(text):
        err(f"invalid duration {text!r} (use e.g. 30s, 1.5h, 2m30s, 100ms)", pos)
    total = sum((Decimal(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text)), Decimal(0))
    if text.startswith("-"):
        total = -total
    if abs(total) > MAX_DURATION_S:
        err(f"duration out of range: {text!r}", pos)
    return make_dur(int(total.scaleb(9)))  # finer than a nanosecond: truncated, as Go's ParseDuration


_TIMESTAMP = re.compile(
    r"^(\d{4,})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))$"
)


def timestamp(text: str, pos: int = -1) -> _dt.datetime:
    """Parse an RFC 3339 timestamp into an aware UTC datetime (NanoTimestamp for sub-microsecond fractions)."""
    m = _TIMESTAMP.match(text) if isinstance(text, str) else None
    if m is None:
        err(f"invalid timestamp {text!r} (use RFC 3339, e.g. 2024-01-01T00:00:00Z)", pos)
    y, mo, d, h, mi, s, frac, z, sign, oh, om = m.groups()
    nanos = int((frac or "").ljust(9, "0"))
    micros, rest = divmod(nanos, 1000)
    if not 1 <= int(y) <= 9999:
        err(f"timestamp out of range: {text!r}", pos)
    try:
        tz = _dt.UTC
        if not z:
            off = _dt.timedelta(hours=int(oh), minutes=int(om))
            tz = _dt.timezone(-off if sign == "-" else off)
        value = _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), micros, tzinfo=tz)
    except (ValueError, OverflowError):
        err(f"invalid timestamp {text!r}", pos)
    try:
        utc = value.astimezone(_dt.UTC)
    except OverflowError:
        err(f"timestamp out of range: {text!r}", pos)
    return make_ts(ts_ns(utc) + rest) if rest else utc


# --------------------------------------------------------------------------------------------- conversions


def int_of_double(x: float, pos: int = -1) -> int:
    """int(double): truncates toward zero; NaN, infinities and out-of-range values are errors."""
    if x != x or not (-9223372036854775808.0 < x < 9223372036854775808.0):  # both ends excluded, as cel-go
        err(f"int({x!r}) out of range", pos)
    return int(x)


def int_of_uint(x: int, pos: int = -1) -> int:
    """int(uint)."""
    if x > IMAX:
        err(f"int({x}u) out of range", pos)
    return int(x)


_INT_TEXT = re.compile(r"^[+-]?[0-9]+$")
_UINT_TEXT = re.compile(r"^[0-9]+$")
_DOUBLE_TEXT = re.compile(
    r"^[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|(?i:inf|infinity|nan))$"
)


def int_of_string(s: str, pos: int = -1) -> int:
    """int(string): a decimal integer in int64 range."""
    if not _INT_TEXT.match(s):
        err(f"cannot convert {s!r} to int", pos)
    v = int(s, 10)
    if not IMIN <= v <= IMAX:
        err(f"int({s!r}) out of range", pos)
    return v


def int_of_timestamp(t: _dt.datetime, pos: int = -1) -> int:
    """int(timestamp): seconds since the Unix epoch."""
    return (t - EPOCH) // SECOND


def uint_of_int(x: int, pos: int = -1) -> int:
    """uint(int)."""
    if x < 0:
        err(f"uint({x}) out of range", pos)
    return Uint(x)


def uint_of_double(x: float, pos: int = -1) -> int:
    """uint(double): truncates toward zero."""
    if x != x or not (-1.0 < x < 18446744073709551616.0):
        err(f"uint({x!r}) out of range", pos)
    return Uint(int(x))


def uint_of_string(s: str, pos: int = -1) -> int:
    """uint(string): a decimal integer in uint64 range."""
    if not _UINT_TEXT.match(s):
        err(f"cannot convert {s!r} to uint", pos)
    v = int(s, 10)
    if v > UMAX:
        err(f"uint({s!r}) out of range", pos)
    return Uint(v)


def double_of_string(s: str, pos: int = -1) -> float:
    """double(string): a decimal floating-point literal, `inf` or `nan`."""
    if not _DOUBLE_TEXT.match(s):
        err(f"cannot convert {s!r} to double", pos)
    v = float(s)
    if math.isinf(v) and "n" not in s.lower():
        err(f"double({s!r}) out of range", pos)
    return v


def format_double(x: float, pos: int = -1) -> str:
    """Go's `%g` with the shortest representation (what cel-go's string(double) prints)."""
    if x != x:
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "-0" if math.copysign(1.0, x) < 0 else "0"
    if 1e-4 <= abs(x) < 1e6:  # fast path: Python's shortest repr is plain decimal here, as Go's %g is
        text = repr(float(x))
        return text[:-2] if text.endswith(".0") else text
    sign, digits, exp = Decimal(repr(float(x))).normalize().as_tuple()
    assert isinstance(exp, int)
    ds = "".join(map(str, digits))
    nd = len(ds)
    point = nd + exp
    e = point - 1
    head = "-" if sign else ""
    if e < -4 or e >= 6:
        mant = ds[0] + ("." + ds[1:] if nd > 1 else "")
        return f"{head}{mant}e{'-' if e < 0 else '+'}{abs(e):02d}"
    if point <= 0:
        return f"{head}0.{'0' * -point}{ds}"
    if point >= nd:
        return f"{head}{ds}{'0' * (point - nd)}"
    return f"{head}{ds[:point]}.{ds[point:]}"


def string_of_bytes(b: bytes, pos: int = -1) -> str:
    """string(bytes): UTF-8 decoding; invalid UTF-8 is an error."""
    try:
        return bytes(b).decode("utf-8")
    except UnicodeDecodeError:
        err("string(bytes): invalid UTF-8", pos)


def string_of_timestamp(t: _dt.datetime, pos: int = -1) -> str:
    """RFC 3339 in UTC with the shortest fraction, e.g. `2024-01-01T00:00:00Z`, `...:00.000000001Z`."""
    ns = t.microsecond * 1000 + getattr(t, "ns", 0)
    t = t.astimezone(_dt.UTC)
    text = f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}"
    if ns:
        text += "." + frac_digits(ns)
    return text + "Z"


def string_of_duration(d: _dt.timedelta, pos: int = -1) -> str:
    """Seconds with an `s` suffix and the shortest fraction, e.g. `30s`, `1.5s`."""
    text = f"{Decimal(dur_ns(d)).scaleb(-9):f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text + "s"


def string_of(v: Any, pos: int = -1) -> str:
    """string(x) for any scalar (dispatching on the run-time kind)."""
    k = kind(v)
    if k == "string":
        return v
    if k == "bool":
        return "true" if v else "false"
    if k in ("int", "uint"):
        return str(int(v))
    if k == "double":
        return format_double(v)
    if k == "bytes":
        return string_of_bytes(v, pos)
    if k == "timestamp":
        return string_of_timestamp(v, pos)
    if k == "duration":
        return string_of_duration(v, pos)
    err(f"no string() conversion for {k}", pos)


def bytes_of(v: str | int, pos: int = -1) -> int:
    """bytes_of("4GiB") -> 4294967296 (see `nexuskv.units.parse_bytes`)."""
    try:
        return parse_bytes(v)
    except (ValueError, TypeError) as exc:
        err(f"bytes_of(): {exc}", pos)


# --------------------------------------------------------------------------------------------- regex


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is a located policy error, not a line on stderr
_RE2_OPTIONS.never_capture = True  # matches() asks only whether there is a match
_RE2_OPTIONS.max_mem = 1 << 20  # a compiled pattern's automata stay within 1 MiB (RE2 refuses what does not fit)
MAX_PATTERN_CHARS = 4096
"""The longest pattern `matches` compiles: a longer one is an invalid regular expression, never a slow compile."""
RegexError = re2.error
"""What `compile_regex` raises for a pattern RE2 refuses (backreferences, lookaround, bad syntax)."""


@functools.lru_cache(maxsize=256)
def compile_regex(pattern: str) -> Any:
    r"""Compile a pattern with RE2 (google-re2): CEL's regex dialect, matched in time linear in the text.

    RE2 has no backreferences or lookaround (a `RegexError`); `$` is the end of the text unless `(?m)`; `\d`, `\w`
    and `\s` are ASCII, `\pL` and POSIX classes (`[[:alpha:]]`) work, as in cel-go and cel-cpp.
    """
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RegexError(f"pattern of {len(pattern)} characters: at most {MAX_PATTERN_CHARS}")
    return re2.compile(pattern, _RE2_OPTIONS)


def matches(s: str, pattern: str, pos: int = -1) -> bool:
    """`s.matches(pattern)` with a pattern known only at run time (partial match, like RE2's)."""
    try:
        rx = compile_regex(pattern)
    except RegexError as exc:
        err(f"invalid regular expression {pattern!r}: {regex_problem(exc)}", pos)
    return rx.search(s) is not None


def regex_problem(exc: BaseException) -> str:
    """RE2's message for a refused pattern, as text."""
    msg = exc.args[0] if exc.args else exc
    text = msg.decode(errors="replace") if isinstance(msg, bytes) else str(msg)
    return text if text.startswith("pattern of ") else f"{text} (RE2 syntax: no backreferences or lookaround)"
