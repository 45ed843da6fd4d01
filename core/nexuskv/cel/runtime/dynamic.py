"""Runtime helpers of the compiled CEL code, part three: containers, CEL's error-absorbing logic and dyn dispatch.

Helpers named `d_*` run where the checker could only say `dyn`: they dispatch on the run-time kinds of their
operands and raise `CelEvalError` for a combination CEL does not define.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from nexuskv.cel.runtime.conversions import tadd, tsub
from nexuskv.cel.runtime.core import (
    MISSING,
    NUMERIC,
    CelEvalError,
    err,
    fdiv,
    iadd,
    idiv,
    imod,
    imul,
    ineg,
    isub,
    kind,
    map_find,
    uadd,
    udiv,
    umod,
    umul,
    usub,
)
from nexuskv.cel.runtime.stdlib import opt_index, opt_select
from nexuskv.cel.values import MixedKeyMap

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
    """Map literal; duplicate keys are an error (`true` and `1` are different keys: see `MixedKeyMap`)."""
    out: dict[Any, Any] = {}
    pairs = list(items)
    for k, v in pairs:
        if k is None:
            err("map keys must not be null", pos)
        if isinstance(k, float):
            err("map keys must be int, uint, bool or string", pos)
        if k in out:
            if any(key == k and isinstance(key, bool) != isinstance(k, bool) for key in out):
                try:
                    return MixedKeyMap.of(pairs)
                except KeyError as exc:
                    err(f"duplicate map key {exc.args[0]!r}", pos)
            err(f"duplicate map key {k!r}", pos)
        out[k] = v
    return out


def eq(a: Any, b: Any) -> bool:
    """CEL equality on any values: numbers compare by value across int/uint/double, other kinds must match."""
    ka, kb = kind(a), kind(b)
    if ka != kb:
        if ka in NUMERIC and kb in NUMERIC:
            return float(a) == float(b) if "double" in (ka, kb) else a == b
        return False
    if ka == "optional":
        return a.present == b.present and (not a.present or eq(a.value, b.value))
    if ka == "list":
        return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))
    if ka == "map":
        if len(a) != len(b):
            return False
        for k, v in a.items():
            found = map_find(b, k)
            if found is MISSING or not eq(v, found):
                return False
        return True
    if ka == "message":
        if type(a) is not type(b):
            return False
        return all(eq(getattr(a, f.name), getattr(b, f.name)) for f in attrs.fields(type(a)))
    return bool(a == b)


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

MAX_DYN_CONCAT = 1 << 20
"""The longest string or bytes (characters) or list (items) `+` builds from dyn operands (about 1 Mi, as `replace`,
`format` and `join`): the static cost bound sees no size through `dyn`, so `dyn(s) + dyn(s)` chained through
`cel.bind` could otherwise double a string per step at a cost of a few units."""


def d_arith(op: str, a: Any, b: Any, pos: int = -1) -> Any:
    """Arithmetic on dyn operands, dispatching on the run-time kinds."""
    ka, kb = kind(a), kind(b)
    if ka == kb == "int":
        return {"+": iadd, "-": isub, "*": imul, "/": idiv, "%": imod}[op](a, b, pos)
    if ka == kb == "uint":
        return {"+": uadd, "-": usub, "*": umul, "/": udiv, "%": umod}[op](a, b, pos)
    if ka == kb == "double" and op != "%":
        if op == "/":
            return fdiv(a, b, pos)
        return a + b if op == "+" else a - b if op == "-" else a * b
    if op == "+":  # dyn operands carry no static size bound: the result is bounded here (issue 29)
        if (ka == kb and ka in ("string", "bytes")) or ka == kb == "list":
            if len(a) + len(b) > MAX_DYN_CONCAT:
                err(f"+: a {ka} of {len(a) + len(b)} {'items' if ka == 'list' else 'characters'}, over the size "
                    f"limit of {MAX_DYN_CONCAT}", pos)  # fmt: skip
            return [*a, *b] if ka == "list" else a + b
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


_ORDERED = ("int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration")


def d_cmp(op: str, a: Any, b: Any, pos: int = -1) -> bool:
    """Ordering on dyn operands: the same orderable kind, or numbers of any kinds (compared by value)."""
    ka, kb = kind(a), kind(b)
    if ka != kb:
        if not (ka in NUMERIC and kb in NUMERIC):
            err(f"no such overload: {ka} {op} {kb}", pos)
        if "double" in (ka, kb):  # int / uint against double: compared as doubles, as cel-go does
            a, b = float(a), float(b)
    elif ka not in _ORDERED:
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
        return map_find(container, x) is not MISSING
    err(f"no such overload: in {k}", pos)


def d_index(c: Any, i: Any, pos: int = -1) -> Any:
    """`c[i]` for a dyn container."""
    k = kind(c)
    if k == "optional":
        return opt_index(c, i, pos)
    if k == "list":
        ki = kind(i)
        if ki == "double" and i == int(i):
            i = int(i)
        elif ki not in ("int", "uint"):
            err(f"list index must be int, got {ki}", pos)
        return lidx(c, int(i), pos)
    if k == "map":
        found = map_find(c, i)
        if found is MISSING:
            err(f"no such key: {i!r}", pos)
        return found
    err(f"cannot index {k}", pos)


def d_select(obj: Any, name: str, pos: int = -1) -> Any:
    """`obj.name` for a dyn value: a map key or a message field."""
    k = kind(obj)
    if k == "optional":
        return opt_select(obj, name, pos)
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
    if k == "optional":
        return opt_select(obj, name, pos).present
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


def call_plugin(fn: Callable[..., Any], name: str, pos: int, *args: Any) -> Any:
    """Call a plugin function, turning any exception into a CelEvalError."""
    try:
        return fn(*args)
    except CelEvalError:
        raise
    except Exception as exc:
        err(f"{name}() failed: {type(exc).__name__}: {exc}", pos)
