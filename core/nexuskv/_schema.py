"""Private: generate JSON Schemas from the attrs contract classes, validate dicts, and (de)serialise them.

The attrs classes in `contracts.py` are the single source; `schemas/*.v1.json` are their exported form.
"""

from __future__ import annotations

import enum
import functools
import types
import typing
from typing import Any

import attrs
import cattrs
import jsonschema

from nexuskv.errors import ContractError, SchemaVersionError

DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_BASE = "https://nexuskv.dev/schemas/"


def doc(text: str, **schema: Any) -> dict[str, Any]:
    """attrs field metadata: the field's description plus JSON Schema keywords (`minimum`, `pattern`, ...)."""
    return {"description": text, **schema}


def _is_attrs(tp: Any) -> bool:
    return isinstance(tp, type) and attrs.has(tp)


def _resolve(cls: type) -> None:
    """Resolve string annotations of `cls` and every attrs class it refers to."""
    seen: set[type] = set()
    stack = [cls]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        attrs.resolve_types(c)
        for f in attrs.fields(c):
            stack.extend(t for t in _leaves(f.type) if _is_attrs(t))


def _leaves(tp: Any) -> list[Any]:
    args = typing.get_args(tp)
    if not args:
        return [tp]
    out: list[Any] = []
    for a in args:
        out.extend(_leaves(a))
    return out


def _type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_null = [a for a in args if a is not type(None)]
        branches = [_type_schema(a, defs) for a in non_null]
        if len(non_null) < len(args):
            branches.append({"type": "null"})
        return {"anyOf": branches} if len(branches) > 1 else branches[0]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0], defs)}
        raise TypeError(f"fixed-length tuples are not part of the contracts: {tp!r}")
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"contract maps must have string keys: {tp!r}")
        return {"type": "object", "additionalProperties": _type_schema(args[1], defs)}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if _is_attrs(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # placeholder against recursion
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    simple = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"type {tp!r} has no JSON Schema mapping")


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in attrs.fields(cls):
        sch = _type_schema(f.type, defs)
        for k, v in f.metadata.items():
            if k == "items":
                sch["items"] = {**sch["items"], **v}
            else:
                sch[k] = v
        if f.default is attrs.NOTHING:
            required.append(f.name)
        elif not isinstance(f.default, attrs.Factory) and isinstance(f.default, str | int | float | bool | None):
            sch["default"] = f.default.value if isinstance(f.default, enum.Enum) else f.default
        props[f.name] = sch
    out: dict[str, Any] = {
        "type": "object",
        "description": (cls.__doc__ or "").strip().splitlines()[0],
        "properties": props,
        "additionalProperties": False,
    }
    if required:
        out["required"] = required
    return out


@functools.cache
def schema_for(cls: type) -> dict[str, Any]:
    """The full JSON Schema (draft 2020-12) of a top-level contract class."""
    _resolve(cls)
    defs: dict[str, Any] = {}
    body = _object_schema(cls, defs)
    version = attrs.fields_dict(cls)["schema_version"].default
    return {
        "$schema": DIALECT,
        "$id": f"{ID_BASE}{cls.CONTRACT}.v{version}.json",
        "title": cls.__name__,
        **body,
        "$defs": dict(sorted(defs.items())),
    }


@functools.cache
def _validator(cls: type) -> jsonschema.protocols.Validator:
    schema = schema_for(cls)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def format_path(parts: typing.Iterable[Any]) -> str:
    """Render a jsonschema path as `a.b[3].c` (`<root>` for the empty path)."""
    out = ""
    for p in parts:
        if not isinstance(p, int) and not str(p).isidentifier():
            p = repr(str(p))  # a hostile key ("", "a\nb", "x.y") is quoted: a path stays one unambiguous line
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


def _problems(err: jsonschema.ValidationError) -> list[tuple[str, str]]:
    path = list(err.absolute_path)
    if err.validator == "additionalProperties":
        allowed = set(err.schema.get("properties", {}))
        return [(format_path([*path, k]), "unknown field") for k in err.instance if k not in allowed]
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else err.message
        return [(format_path([*path, missing]), "required field is missing")]
    if err.validator == "anyOf" and err.context:
        # Optional[X]: report why the non-null branch failed, it is the one the caller meant.
        real = [e for e in err.context if not (e.validator == "type" and e.validator_value == "null")]
        best = jsonschema.exceptions.best_match(real or err.context)
        return _problems(best)
    if err.validator == "type":
        return [(format_path(path), f"expected {err.validator_value}, got {_json_type(err.instance)}")]
    msg = err.message if len(err.message) <= 200 else err.message[:197] + "..."
    return [(format_path(path), msg)]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def validate(cls: type, data: Any) -> None:
    """Validate a dict against `cls`'s schema; raise `ContractError` naming every bad field path."""
    contract = cls.CONTRACT
    if not isinstance(data, dict):
        raise ContractError(contract, [("<root>", f"expected an object, got {type(data).__name__}")])
    version = attrs.fields_dict(cls)["schema_version"].default
    got = data.get("schema_version", version)
    if got != version or isinstance(got, bool):
        raise SchemaVersionError(contract, got, version)
    problems: list[tuple[str, str]] = []
    for err in _validator(cls).iter_errors(data):
        problems.extend(_problems(err))
    if problems:
        raise ContractError(contract, sorted(set(problems)))


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    # Validated already: token id lists are the big ones, convert them without a per-item hook.
    conv.register_structure_hook_func(lambda t: t == tuple[int, ...], lambda v, _: tuple(v))
    return conv


_CONVERTER = _make_converter()


def structure(cls: type, data: Any) -> Any:
    """Validate, then build an instance of `cls` from a JSON-compatible dict."""
    validate(cls, data)
    _resolve(cls)
    try:
        return _CONVERTER.structure(data, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:  # pragma: no cover - schema catches these
        raise ContractError(cls.CONTRACT, [("<root>", str(exc))]) from exc


def unstructure(obj: Any) -> Any:
    """A JSON-compatible form of a contract value (attrs -> dict, tuples -> lists, enums -> values)."""
    if attrs.has(type(obj)):
        return {f.name: unstructure(getattr(obj, f.name)) for f in attrs.fields(type(obj))}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple | list):
        if obj and not isinstance(obj[0], str | int | float | bool | None):
            return [unstructure(v) for v in obj]
        return list(obj)
    if isinstance(obj, dict):
        return {k: unstructure(v) for k, v in obj.items()}
    return obj
