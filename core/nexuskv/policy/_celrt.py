"""Runtime helpers of the compiled CEL code: checked arithmetic, conversions, dyn dispatch and `CelEvalError`.

Every helper works on native Python values. `pos` arguments index the position table of the compiled
expression (-1 = unknown); the compiled wrapper turns them into line and column.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any, NoReturn

import attrs

from nexuskv.units import parse_bytes

IMIN = -(1 << 63)
IMAX = (1 << 63) - 1
UMAX = (1 << 64) - 1
MAX_DURATION_S = 315_576_000_000
"""CEL's duration range: about +-10000 years."""
MAX_DURATION = _dt.timedelta(seconds=MAX_DURATION_S)
EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_SECOND = _dt.timedelta(seconds=1)


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
    """The CEL kind of a native value (Python ints are `int`: uint is not distinguishable at run time)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
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
        return "timestamp"
    if isinstance(v, _dt.timedelta):
        return "duration"
    if attrs.has(type(v)):
        return "message"
    return type(v).__name__


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
        return r
    err(f"uint overflow: {a}u + {b}u", pos)


def usub(a: int, b: int, pos: int = -1) -> int:
    """uint - uint with overflow check."""
    r = a - b
    if r >= 0:
        return r
    err(f"uint overflow: {a}u - {b}u", pos)


def umul(a: int, b: int, pos: int = -1) -> int:
    """uint * uint with overflow check."""
    r = a * b
    if r <= UMAX:
        return r
    err(f"uint overflow: {a}u * {b}u", pos)


def udiv(a: int, b: int, pos: int = -1) -> int:
    """uint / uint."""
    if b == 0:
        err("division by zero", pos)
    return a // b


def umod(a: int, b: int, pos: int = -1) -> int:
    """uint % uint."""
    if b == 0:
        err("modulus by zero", pos)
    return a % b


def fdiv(a: float, b: float, pos: int = -1) -> float:
    """double / double with IEEE semantics (x / 0.0 is +-inf, 0.0 / 0.0 is NaN)."""
    try:
        return a / b
    except ZeroDivisionError:
        if a != a or a == 0:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


# --------------------------------------------------------------------------------------------- time


def _check_duration(d: _dt.timedelta, pos: int) -> _dt.timedelta:
    if -MAX_DURATION <= d <= MAX_DURATION:
        return d
    err("duration out of range", pos)


def tadd(a: Any, b: Any, pos: int = -1) -> Any:
    """timestamp + duration, duration + timestamp, duration + duration, with range checks."""
    try:
        r = a + b
    except OverflowError:
        err("timestamp out of range", pos)
    if isinstance(r, _dt.timedelta):
        return _check_duration(r, pos)
    return r


def tsub(a: Any, b: Any, pos: int = -1) -> Any:
    """timestamp - timestamp, timestamp - duration, duration - duration, with range checks."""
    try:
        r = a - b
    except OverflowError:
        err("timestamp out of range", pos)
    if isinstance(r, _dt.timedelta):
        return _check_duration(r, pos)
    return r


_DURATION_UNITS = {
    "ns": Decimal("0.000000001"), "us": Decimal("0.000001"), "µs": Decimal("0.000001"),
    "μs": Decimal("0.000001"), "ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600),
}  # fmt: skip
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_DURATION = re.compile(r"^[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+$")


def duration(text: str, pos: int = -1) -> _dt.timedelta:
    """Parse a Go-style duration (`30s`, `1.5h`, `-2m30s`, `100ms`); microsecond precision."""
    if text in ("0", "+0", "-0"):
        return _dt.timedelta(0)
    if not isinstance(text, str) or not _DURATION.match(text):
        err(f"invalid duration {text!r} (use e.g. 30s, 1.5h, 2m30s, 100ms)", pos)
    total = sum((Decimal(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text)), Decimal(0))
    if text.startswith("-"):
        total = -total
    if abs(total) > MAX_DURATION_S:
        err(f"duration out of range: {text!r}", pos)
    micros = int(total.scaleb(6).to_integral_value())
    return _dt.timedelta(microseconds=micros)


_TIMESTAMP = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))$"
)


def timestamp(text: str, pos: int = -1) -> _dt.datetime:
    """Parse an RFC 3339 timestamp into an aware UTC datetime (fractions truncated to microseconds)."""
    m = _TIMESTAMP.match(text) if isinstance(text, str) else None
    if m is None:
        err(f"invalid timestamp {text!r} (use RFC 3339, e.g. 2024-01-01T00:00:00Z)", pos)
    y, mo, d, h, mi, s, frac, z, sign, oh, om = m.groups()
    micros = int((frac or "").ljust(6, "0")[:6])
    try:
        tz = _dt.UTC
        if not z:
            off = _dt.timedelta(hours=int(oh), minutes=int(om))
            tz = _dt.timezone(-off if sign == "-" else off)
        value = _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), micros, tzinfo=tz)
        return value.astimezone(_dt.UTC)
    except (ValueError, OverflowError):
        err(f"invalid timestamp {text!r}", pos)


# --------------------------------------------------------------------------------------------- conversions


def int_of_double(x: float, pos: int = -1) -> int:
    """int(double): truncates toward zero; NaN, infinities and out-of-range values are errors."""
    if x != x or not (-9223372036854775808.0 <= x < 9223372036854775808.0):
        err(f"int({x!r}) out of range", pos)
    return int(x)


def int_of_uint(x: int, pos: int = -1) -> int:
    """int(uint)."""
    if x > IMAX:
        err(f"int({x}u) out of range", pos)
    return x


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
    return (t - EPOCH) // _SECOND


def uint_of_int(x: int, pos: int = -1) -> int:
    """uint(int)."""
    if x < 0:
        err(f"uint({x}) out of range", pos)
    return x


def uint_of_double(x: float, pos: int = -1) -> int:
    """uint(double): truncates toward zero."""
    if x != x or not (-1.0 < x < 18446744073709551616.0):
        err(f"uint({x!r}) out of range", pos)
    return int(x)


def uint_of_string(s: str, pos: int = -1) -> int:
    """uint(string): a decimal integer in uint64 range."""
    if not _UINT_TEXT.match(s):
        err(f"cannot convert {s!r} to uint", pos)
    v = int(s, 10)
    if v > UMAX:
        err(f"uint({s!r}) out of range", pos)
    return v


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
    """RFC 3339 in UTC with the shortest fraction, e.g. `2024-01-01T00:00:00Z`."""
    t = t.astimezone(_dt.UTC)
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if t.microsecond:
        text += "." + f"{t.microsecond:06d}".rstrip("0")
    return text + "Z"


def string_of_duration(d: _dt.timedelta, pos: int = -1) -> str:
    """Seconds with an `s` suffix and the shortest fraction, e.g. `30s`, `1.5s`."""
    micros = (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds
    text = f"{Decimal(micros).scaleb(-6):f}"
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
    if k == "int":
        return str(v)
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


_LOOKAROUND = re.compile(r"\(\?(?:=|!|<=|<!|P=)|\\[1-9]")


@functools.lru_cache(maxsize=256)
def compile_regex(pattern: str) -> re.Pattern[str]:
    """Compile an RE2-style pattern with Python `re` (no backreferences or lookaround; `$` = end of text)."""
    if _LOOKAROUND.search(pattern):
        raise ValueError("backreferences and lookaround are not supported (RE2 syntax)")
    out: list[str] = []
    i, in_class = 0, False
    multiline = re.search(r"\(\?[a-zA-Z]*m", pattern) is not None
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            out.append("\\Z" if nxt == "z" and not in_class else c + nxt)
            i += 2
            continue
        if in_class:
            in_class = c != "]" or out[-1] == "["
        elif c == "[":
            in_class = True
        elif c == "$" and not multiline:
            c = "\\Z"
        out.append(c)
        i += 1
    return re.compile("".join(out))


def matches(s: str, pattern: str, pos: int = -1) -> bool:
    """`s.matches(pattern)` with a pattern known only at run time (partial match, like RE2's)."""
    try:
        rx = compile_regex(pattern)
    except (re.error, ValueError) as exc:
        err(f"invalid regular expression {pattern!r}: {exc}", pos)
    return rx.search(s) is not None


# --------------------------------------------------------------------------------------------- containers


def lidx(seq: Any, i: int, pos: int = -1) -> Any:
    """list[i] (negative or too large indexes are errors)."""
    if 0 <= i < len(seq):
        return seq[i]
    err(f"index {i} out of range for a list of size {len(seq)}", pos)


def mget(m: Mapping[Any, Any], k: Any, pos: int = -1) -> Any:
    """map[k] / map.k: a missing key is an error."""
    try:
        return m[k]
    except KeyError:
        err(f"no such key: {k!r}", pos)
    except TypeError:
        err(f"invalid map key {k!r}", pos)


def sel(obj: Any, name: str, pos: int = -1) -> Any:
    """Field `name` of a message value."""
    if obj is None:
        err(f"cannot select field '{name}' of null", pos)
    try:
        return getattr(obj, name)
    except AttributeError:
        err(f"no such field '{name}' on {type(obj).__name__}", pos)


def mkmap(items: Iterable[tuple[Any, Any]], pos: int = -1) -> dict[Any, Any]:
    """Map literal; duplicate keys are an error."""
    out: dict[Any, Any] = {}
    for k, v in items:
        if k is None:
            err("map keys must not be null", pos)
        if isinstance(k, float):
            err("map keys must be int, uint, bool or string", pos)
        if k in out:
            err(f"duplicate map key {k!r}", pos)
        out[k] = v
    return out


def eq(a: Any, b: Any) -> bool:
    """CEL equality on any values: numbers compare by value across int/uint/double, other kinds must match."""
    ka, kb = kind(a), kind(b)
    if ka != kb:
        return ka in ("int", "double") and kb in ("int", "double") and a == b
    if ka == "list":
        return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))
    if ka == "map":
        if len(a) != len(b):
            return False
        for k, v in a.items():
            found = _map_find(b, k)
            if found is _MISSING or not eq(v, found):
                return False
        return True
    if ka == "message":
        if type(a) is not type(b):
            return False
        return all(eq(getattr(a, f.name), getattr(b, f.name)) for f in attrs.fields(type(a)))
    return bool(a == b)


_MISSING = object()


def _map_find(m: Mapping[Any, Any], k: Any) -> Any:
    kk = kind(k)
    for key, value in m.items():
        if kind(key) == kk and key == k:
            return value
    return _MISSING


def in_list(x: Any, seq: Iterable[Any]) -> bool:
    """`x in list` with CEL equality."""
    return any(eq(x, y) for y in seq)


# --------------------------------------------------------------------------------------------- logic


def _absorbing(items: Iterable[Any], f: Callable[[Any], Any], decisive: bool,
               bad: Callable[[Any], CelEvalError]) -> bool:  # fmt: skip
    """CEL's commutative, error-absorbing logic, shared by `&&`, `||`, `all` and `exists`.

    The first `decisive` operand decides; else the first error (a failing operand, or a non-bool made into
    `bad(value)`) is raised; else the result is `not decisive`.
    """
    error: BaseException | None = None
    for item in items:
        try:
            v = f(item)
        except Exception as exc:
            error = error or exc
            continue
        if v is decisive:
            return decisive
        if v is not (not decisive):
            error = error or bad(v)
    if error is not None:
        raise error
    return not decisive


def and_(fns: tuple[Callable[[], Any], ...], pos: int = -1) -> bool:
    """`a && b && ...` with CEL's error-absorbing, commutative semantics: any false operand makes it false."""
    return _absorbing(fns, operator.call, False, lambda v: _bad_logic("&&", v, pos))


def or_(fns: tuple[Callable[[], Any], ...], pos: int = -1) -> bool:
    """`a || b || ...` with CEL's error-absorbing, commutative semantics: any true operand makes it true."""
    return _absorbing(fns, operator.call, True, lambda v: _bad_logic("||", v, pos))


def _bad_logic(op: str, v: Any, pos: int) -> CelEvalError:
    e = CelEvalError(f"{op} expects bool operands, got {kind(v)}")
    e.pos = pos
    return e


def all_x(rng: Iterable[Any], f: Callable[[Any], Any], pos: int = -1) -> bool:
    """`all` macro: false if any element gives false (errors elsewhere are absorbed), else error or true."""
    return _absorbing(rng, f, False, lambda r: CelEvalError(f"all() predicate must be bool, got {kind(r)}"))


def exists_x(rng: Iterable[Any], f: Callable[[Any], Any], pos: int = -1) -> bool:
    """`exists` macro: true if any element gives true (errors elsewhere are absorbed), else error or false."""
    return _absorbing(rng, f, True, lambda r: CelEvalError(f"exists() predicate must be bool, got {kind(r)}"))


def as_bool(v: Any, pos: int = -1) -> bool:
    """A dyn value used as a condition must be a bool."""
    if v is True or v is False:
        return v
    err(f"expected bool, got {kind(v)}", pos)


# --------------------------------------------------------------------------------------------- dyn dispatch


def d_arith(op: str, a: Any, b: Any, pos: int = -1) -> Any:
    """Arithmetic on dyn operands, dispatching on the run-time kinds."""
    ka, kb = kind(a), kind(b)
    if ka == kb == "int":
        return {"+": iadd, "-": isub, "*": imul, "/": idiv, "%": imod}[op](a, b, pos)
    if ka == kb == "double" and op != "%":
        if op == "/":
            return fdiv(a, b, pos)
        return a + b if op == "+" else a - b if op == "-" else a * b
    if op == "+":
        if ka == kb and ka in ("string", "bytes"):
            return a + b
        if ka == kb == "list":
            return [*a, *b]
        if (ka, kb) in (("timestamp", "duration"), ("duration", "timestamp"), ("duration", "duration")):
            return tadd(a, b, pos)
    if op == "-" and (ka, kb) in (
        ("timestamp", "timestamp"), ("timestamp", "duration"), ("duration", "duration"),
    ):  # fmt: skip
        return tsub(a, b, pos)
    err(f"no such overload: {ka} {op} {kb}", pos)


def d_neg(a: Any, pos: int = -1) -> Any:
    """Unary minus on a dyn operand."""
    k = kind(a)
    if k == "int":
        return ineg(a, pos)
    if k == "double":
        return -a
    err(f"no such overload: -{k}", pos)


_ORDERED = ("int", "double", "string", "bytes", "bool", "timestamp", "duration")


def d_cmp(op: str, a: Any, b: Any, pos: int = -1) -> bool:
    """Ordering on dyn operands: both must have the same orderable kind."""
    ka, kb = kind(a), kind(b)
    if ka != kb or ka not in _ORDERED:
        err(f"no such overload: {ka} {op} {kb}", pos)
    if op == "<":
        return a < b
    if op == "<=":
        return a <= b
    if op == ">":
        return a > b
    return a >= b


def d_in(x: Any, container: Any, pos: int = -1) -> bool:
    """`x in c` for a dyn container: a list or the keys of a map."""
    k = kind(container)
    if k == "list":
        return in_list(x, container)
    if k == "map":
        return _map_find(container, x) is not _MISSING
    err(f"no such overload: in {k}", pos)


def d_index(c: Any, i: Any, pos: int = -1) -> Any:
    """`c[i]` for a dyn container."""
    k = kind(c)
    if k == "list":
        if kind(i) != "int":
            err(f"list index must be int, got {kind(i)}", pos)
        return lidx(c, i, pos)
    if k == "map":
        found = _map_find(c, i)
        if found is _MISSING:
            err(f"no such key: {i!r}", pos)
        return found
    err(f"cannot index {k}", pos)


def d_select(obj: Any, name: str, pos: int = -1) -> Any:
    """`obj.name` for a dyn value: a map key or a message field."""
    k = kind(obj)
    if k == "map":
        return mget(obj, name, pos)
    if k == "message":
        if name not in attrs.fields_dict(type(obj)):
            err(f"no such field '{name}' on {type(obj).__name__}", pos)
        return getattr(obj, name)
    err(f"cannot select field '{name}' of {k}", pos)


def d_has(obj: Any, name: str, pos: int = -1) -> bool:
    """`has(obj.name)` for a dyn value."""
    k = kind(obj)
    if k == "map":
        return name in obj
    if k == "message":
        return name in attrs.fields_dict(type(obj)) and getattr(obj, name) is not None
    err(f"has() needs a map or message, got {k}", pos)


def d_size(v: Any, pos: int = -1) -> int:
    """size() of a dyn value."""
    if kind(v) in ("string", "bytes", "list", "map"):
        return len(v)
    err(f"no such overload: size({kind(v)})", pos)


def d_iter(v: Any, pos: int = -1) -> Iterable[Any]:
    """The range of a comprehension over a dyn value: list items or map keys."""
    if kind(v) in ("list", "map"):
        return v
    err(f"cannot iterate over {kind(v)}", pos)


def d_str(v: Any, pos: int = -1) -> str:
    """A dyn value used where a string is required."""
    if isinstance(v, str):
        return v
    err(f"expected string, got {kind(v)}", pos)


def d_expect(v: Any, want: str, pos: int = -1) -> Any:
    """Check the run-time kind of a dyn result against the expected type."""
    k = kind(v)
    if k == want or (want == "uint" and k == "int" and v >= 0) or want == "dyn":
        return v
    if want == "message" and k == "message":
        return v
    err(f"expected a {want} result, got {k}", pos)


def d_conv(target: str, v: Any, pos: int = -1) -> Any:
    """int() / uint() / double() / string() of a dyn value."""
    k = kind(v)
    if target == "string":
        return string_of(v, pos)
    table: dict[tuple[str, str], Callable[..., Any]] = {
        ("int", "int"): lambda x, p: x,
        ("int", "double"): int_of_double,
        ("int", "string"): int_of_string,
        ("int", "timestamp"): int_of_timestamp,
        ("uint", "int"): uint_of_int,
        ("uint", "double"): uint_of_double,
        ("uint", "string"): uint_of_string,
        ("double", "int"): lambda x, p: float(x),
        ("double", "double"): lambda x, p: x,
        ("double", "string"): double_of_string,
    }
    fn = table.get((target, k))
    if fn is None:
        err(f"no such overload: {target}({k})", pos)
    return fn(v, pos)


def call_plugin(fn: Callable[..., Any], name: str, pos: int, *args: Any) -> Any:
    """Call a plugin function, turning any exception into a CelEvalError."""
    try:
        return fn(*args)
    except CelEvalError:
        raise
    except Exception as exc:
        err(f"{name}() failed: {type(exc).__name__}: {exc}", pos)
