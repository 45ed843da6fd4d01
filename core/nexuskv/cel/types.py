"""The CEL type system: `CelType`, message types derived from attrs classes, and `Env`.

`Env` declares the variables and plugin functions a policy expression may use; `nexuskv.cel.compiled` checks
expressions against it.
"""

from __future__ import annotations

import datetime as _dt
import enum
import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "BOOL",
    "BUILTIN_FUNCTIONS",
    "BYTES",
    "DEFAULT_MAX_LIST",
    "DEFAULT_MAX_STRING",
    "DOUBLE",
    "DURATION",
    "DYN",
    "INT",
    "NULL",
    "STRING",
    "TIMESTAMP",
    "UINT",
    "CelType",
    "Env",
    "FunctionDecl",
    "list_of",
    "map_of",
    "message_fields",
    "abstract_type",
    "message_type",
    "optional_of",
    "plugin_functions",
    "record_type",
    "type_of",
    "type_param",
]

DEFAULT_MAX_LIST = 1_000_000
"""Size bound the cost estimate assumes for a list or map whose type declares none."""
DEFAULT_MAX_STRING = 4096
"""Length bound the cost estimate assumes for a string or bytes value whose type declares none."""

BUILTIN_FUNCTIONS = frozenset({
    "has", "all", "exists", "exists_one", "map", "filter", "size", "startsWith", "endsWith", "contains",
    "matches", "int", "uint", "double", "string", "duration", "timestamp", "bytes_of",
})  # fmt: skip
"""Names of the built-in functions and macros; plugin functions may not reuse them."""
_MAP_KEYS = ("int", "uint", "bool", "string", "dyn")


@attrs.frozen(repr=False)
class CelType:
    """A CEL type: a scalar kind, `list(T)`, `map(K, V)` or a message type backed by an attrs class.

    `max_size` (lists, maps: items; strings, bytes: length) and `nullable` (the value may be `None`) refine a
    type without changing its identity: they are ignored by `==` and `hash`; so is `free`, which marks the
    `dyn` element type of an empty literal (`[]`), that takes the type it is joined with.
    """

    kind: str
    params: tuple[CelType, ...] = ()
    cls: type | None = None
    name: str = ""
    record: tuple[tuple[str, CelType], ...] = ()
    max_size: int | None = attrs.field(default=None, eq=False)
    nullable: bool = attrs.field(default=False, eq=False)
    free: bool = attrs.field(default=False, eq=False)

    def __str__(self) -> str:
        """CEL spelling of the type: `int`, `list(string)`, `map(string, int)`, `StateDescriptor`."""
        if self.kind == "list":
            text = f"list({self.params[0]})"
        elif self.kind == "map":
            text = f"map({self.params[0]}, {self.params[1]})"
        elif self.kind == "type":
            text = f"type({self.params[0]})" if self.params else "type"
        elif self.kind == "optional":
            text = f"optional_type({self.params[0]})"
        elif self.kind == "param":
            text = self.name
        elif self.kind == "abstract":
            text = f"{self.name}({', '.join(map(str, self.params))})" if self.params else self.name
        elif self.kind == "message":
            text = self.cls.__name__ if self.cls is not None else self.name or "message"
        else:
            text = self.kind
        return text

    def __repr__(self) -> str:
        """Readable form for test failures and debugging."""
        extra = ""
        if self.max_size is not None:
            extra += f" max_size={self.max_size}"
        if self.nullable:
            extra += " nullable"
        return f"<CelType {self}{extra}>"

    @property
    def elem(self) -> CelType:
        """Element type of a list (value type of a map)."""
        return self.params[-1]

    @property
    def key(self) -> CelType:
        """Key type of a map."""
        return self.params[0]

    @property
    def bound(self) -> int:
        """`max_size`, or the default bound of this kind when none is declared (used by the cost estimate)."""
        if self.max_size is not None:
            return self.max_size
        return DEFAULT_MAX_STRING if self.kind in ("string", "bytes") else DEFAULT_MAX_LIST

    def with_size(self, max_size: int | None) -> CelType:
        """The same type with another size bound."""
        return attrs.evolve(self, max_size=max_size)

    def as_nullable(self, nullable: bool = True) -> CelType:
        """The same type, marked as possibly `None` (or not)."""
        return attrs.evolve(self, nullable=nullable)

    def fields(self) -> Mapping[str, CelType]:
        """Field types of a message or record type (empty for other kinds)."""
        if self.kind != "message":
            return {}
        if self.cls is None:
            return dict(self.record)
        return message_fields(self.cls)


INT = CelType("int")
UINT = CelType("uint")
DOUBLE = CelType("double")
BOOL = CelType("bool")
STRING = CelType("string")
BYTES = CelType("bytes")
NULL = CelType("null")
DYN = CelType("dyn")
TIMESTAMP = CelType("timestamp")
DURATION = CelType("duration")


def list_of(elem: CelType, max_size: int | None = None) -> CelType:
    """`list(elem)`, optionally with a bound on the number of items."""
    return CelType("list", (elem,), max_size=max_size)


def map_of(key: CelType, value: CelType, max_size: int | None = None) -> CelType:
    """`map(key, value)`; keys must be int, uint, bool, string (or dyn)."""
    if key.kind not in _MAP_KEYS:
        raise ValueError(f"map keys must be int, uint, bool or string, not {key}")
    return CelType("map", (key, value), max_size=max_size)


def type_of(t: CelType) -> CelType:
    """`type(t)`: the type of the value `t` used as a value (what `type(x)` returns for an x of type t)."""
    return CelType("type", (t,))


def type_param(name: str) -> CelType:
    """A type parameter (`T`) for generic plugin function declarations: `first(list(T)) -> T`."""
    return CelType("param", name=name)


def abstract_type(name: str, *params: CelType) -> CelType:
    """An abstract (opaque, parameterised) type such as `tuple(T, U)`; values are any Python object."""
    return CelType("abstract", tuple(params), name=name)


def optional_of(t: CelType) -> CelType:
    """`optional_type(t)`: an optional value of type t (the optional-types extension)."""
    return CelType("optional", (t,))


def message_type(cls: type) -> CelType:
    """The message type of a (frozen) attrs class; its fields are read from the type hints.

    `str` -> string, `int` -> int, `float` -> double, `bool` -> bool, `bytes` -> bytes, StrEnum -> string,
    `datetime` -> timestamp, `timedelta` -> duration, `tuple[X, ...]` / `list[X]` -> list(X),
    `dict[K, V]` -> map(K, V), `X | None` -> nullable X, `Any` -> dyn, an attrs class -> its message type.
    Field metadata `maxLength` / `maxItems` / `maxProperties` become `max_size`. Only fields, not properties.
    """
    if not attrs.has(cls):
        raise TypeError(f"{cls!r} is not an attrs class")
    return CelType("message", cls=cls)


def record_type(name: str, fields: Mapping[str, CelType]) -> CelType:
    """A message type declared field by field (no attrs class); values are read with `getattr`."""
    return CelType("message", name=name, record=tuple(sorted(fields.items())))


@functools.cache
def message_fields(cls: type) -> Mapping[str, CelType]:
    """Field name -> CelType of an attrs class (cached; see `message_type`)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, CelType] = {}
    for f in attrs.fields(cls):
        hint = hints.get(f.name, f.type)
        try:
            t = _from_hint(hint)
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{f.name}: {exc}") from None
        size = _size_from_metadata(f.metadata, t)
        if size is not None:
            t = t.with_size(size)
        out[f.name] = t
    return types.MappingProxyType(out)


def _size_from_metadata(meta: Mapping[str, Any], t: CelType) -> int | None:
    if t.kind in ("string", "bytes"):
        key = "maxLength"
    elif t.kind == "list":
        key = "maxItems"
    elif t.kind == "map":
        key = "maxProperties"
    else:
        return None
    value = meta.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


_PLAIN: dict[Any, CelType] = {
    str: STRING,
    int: INT,
    float: DOUBLE,
    bool: BOOL,
    bytes: BYTES,
    _dt.datetime: TIMESTAMP,
    _dt.timedelta: DURATION,
    type(None): NULL,
    Any: DYN,
    object: DYN,
}


def _from_hint(hint: Any) -> CelType:
    if hint in _PLAIN:
        return _PLAIN[hint]
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return _from_hint(rest[0]).as_nullable()
        raise TypeError(f"unsupported union type {hint!r} (only `X | None` is supported)")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list_of(_from_hint(args[0]))
    if origin in (list, Sequence, typing.Sequence) and len(args) == 1:
        return list_of(_from_hint(args[0]))
    if origin in (dict, Mapping, typing.Mapping) and len(args) == 2:
        return map_of(_from_hint(args[0]), _from_hint(args[1]))
    if isinstance(hint, type):
        if issubclass(hint, enum.Enum):
            if issubclass(hint, str):
                return STRING
            if issubclass(hint, int):
                return INT
        elif attrs.has(hint):
            return message_type(hint)
        for py, t in _PLAIN.items():
            if isinstance(py, type) and py is not object and issubclass(hint, py):
                return t
    raise TypeError(f"unsupported field type {hint!r}")


@attrs.frozen
class FunctionDecl:
    """A plugin CEL function: `name(args...) -> result`, implemented by `impl` over native Python values.

    With `receiver=True` the function is called as a method, `args[0].name(args[1:]...)`. `cost` is the static
    cost of one call (added to the cost of the arguments). `impl` signals an error by raising an exception;
    it is turned into a `CelEvalError`.
    """

    name: str
    args: tuple[CelType, ...] = attrs.field(converter=tuple)
    result: CelType
    impl: Callable[..., object] = attrs.field(eq=False)
    receiver: bool = False
    cost: int = 1


@attrs.frozen(eq=False)
class Env:
    """Declarations an expression is checked against: variable name -> type, function name -> declaration."""

    variables: Mapping[str, CelType] = attrs.field(converter=lambda m: types.MappingProxyType(dict(m)))
    functions: Mapping[str, FunctionDecl] = attrs.field(
        factory=dict, converter=lambda m: types.MappingProxyType(dict(m))
    )

    def __attrs_post_init__(self) -> None:
        """Check that function declarations are registered under their own name."""
        for name, decl in self.functions.items():
            if decl.name != name:
                raise ValueError(f"function registered as {name!r} is declared as {decl.name!r}")
            if name in BUILTIN_FUNCTIONS:
                raise ValueError(f"function {name!r} would shadow the built-in of the same name")

    def extend(
        self,
        variables: Mapping[str, CelType] | None = None,
        functions: Mapping[str, FunctionDecl] | None = None,
    ) -> Env:
        """A new Env with more (or replaced) declarations."""
        return Env({**self.variables, **(variables or {})}, {**self.functions, **(functions or {})})


_TYPE_NAMES: dict[str, CelType] = {"int": INT, "double": DOUBLE, "string": STRING, "bool": BOOL,
                                   "duration": DURATION, "timestamp": TIMESTAMP}  # fmt: skip


def plugin_functions(registrations: Mapping[str, Any]) -> tuple[dict[str, FunctionDecl], list[str]]:
    """FunctionDecls from `nexuskv_register_cel_functions` registrations `(fn, arg_types, result_type)`.

    Returns the declarations and a problem per registration that could not be used (bad type name, shape).
    """
    names = {**_TYPE_NAMES, "uint": UINT, "bytes": BYTES, "dyn": DYN,
             "list": list_of(DYN), "map": map_of(STRING, DYN)}  # fmt: skip
    out: dict[str, FunctionDecl] = {}
    problems: list[str] = []
    for name, reg in registrations.items():
        try:
            fn, args, result = reg
            decl = FunctionDecl(name=name, args=tuple(names[a] for a in args), result=names[result], impl=fn)
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"CEL function {name!r}: bad registration ({exc!r}); expected "
                            f"register(name, fn, [arg type names], result type name)")  # fmt: skip
            continue
        out[name] = decl
    return out, problems
