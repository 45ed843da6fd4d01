"""Run CEL's official conformance tests (the cel-spec "simple" suite) against NexusKV's CEL compiler.

`load_cases` reads every `*.textproto` of a directory (text-format `SimpleTestFile`s), `protobuf_reason` says
why a case needs protocol buffer message types (which the policy dialect does not have: such cases are not
applicable), and `run_case` compiles and evaluates one case and compares the outcome with CEL's equality,
strict about kinds (`1` is not `1u` is not `1.0`). `decode_value` and `decode_type` turn `cel.expr.Value` /
`cel.expr.Type` messages into native values and `CelType`s; `Message` and `parse_text` are the text-format reader.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import attrs

from nexuskv.cel.compiled import compile_expr
from nexuskv.cel.runtime.core import CelEvalError, type_name
from nexuskv.cel.runtime.timestamps import make_dur, make_ts
from nexuskv.cel.syntax.parser import CelError
from nexuskv.cel.textproto import Message, Scalar, parse_text
from nexuskv.cel.types import (
    BOOL,
    BYTES,
    DOUBLE,
    DURATION,
    DYN,
    INT,
    NULL,
    STRING,
    TIMESTAMP,
    UINT,
    CelType,
    Env,
    FunctionDecl,
    abstract_type,
    list_of,
    map_of,
    optional_of,
    type_of,
    type_param,
)
from nexuskv.cel.values import TypeValue, Uint

__all__ = [
    "Case", "Message", "Outcome", "decode_type", "decode_value", "load_cases", "parse_text", "protobuf_reason",
    "run_case", "same",
]  # fmt: skip


@attrs.frozen
class Case:
    """One conformance test: where it is, what to evaluate, and what is expected."""

    file: str
    section: str
    name: str
    expr: str
    test: Message = attrs.field(repr=False)

    @property
    def id(self) -> str:
        """`file/section/name`, the test's unique name."""
        return f"{self.file}/{self.section}/{self.name}"


@attrs.frozen
class Outcome:
    """The result of one case: `status` is "pass", "fail" (rejected or errored) or "wrong" (a wrong value)."""

    status: str
    detail: str = ""


def load_cases(directory: str | Path) -> list[Case]:
    """Every test of every `*.textproto` under `directory`, in file order."""
    out: list[Case] = []
    for path in sorted(Path(directory).glob("*.textproto")):
        suite = parse_text(path.read_text(encoding="utf-8"))
        for section in suite.all("section"):
            assert isinstance(section, Message)
            for test in section.all("test"):
                assert isinstance(test, Message)
                out.append(Case(path.stem, section.text("name"), test.text("name"), test.text("expr"), test))
    return out


_MESSAGE_IN_EXPR = re.compile(
    r"\b(?:TestAllTypes|NestedTestAllTypes|NestedMessage|NestedEnum|GlobalEnum|TestRequired\w*|proto[23]\."
    r"|google\.protobuf\.|cel\.expr\.conformance)|(?<![\w.])(?:[A-Z]\w*\.)*[A-Z]\w*\s*\{"
)
_WELL_KNOWN_VALUES = ("google.protobuf.Timestamp", "google.protobuf.Duration")


def protobuf_reason(case: Case) -> str | None:
    """Why `case` needs protocol buffer message types (None when it does not)."""
    t = case.test
    if _MESSAGE_IN_EXPR.search(case.expr):
        return "the expression uses a protobuf message type"
    if t.text("container").startswith(("cel.expr.conformance", "google.protobuf")):
        return "the expression resolves names in a protobuf package"
    for decl in t.all("type_env"):
        if _mentions(decl, "message_type", allowed=_WELL_KNOWN_VALUES):
            return "a declaration has a protobuf message type"
    for entry in t.all("bindings"):
        if _has_message(entry):
            return "a binding is a protobuf message"
    for name in ("value", "typed_result"):
        got = t.get(name)
        if isinstance(got, Message) and (_has_message(got) or _mentions(got, "enum_value")):
            return "the expected value is a protobuf message"
    return None


def _mentions(m: Message, field: str, allowed: tuple[str, ...] = ()) -> bool:
    for key, value in m.fields:
        if key == field and not (isinstance(value, Scalar) and value.as_str() in allowed):
            return True
        if isinstance(value, Message) and _mentions(value, field, allowed):
            return True
    return False


def _has_message(m: Message) -> bool:
    for key, value in m.fields:
        if key.startswith("[") and key.strip("[]").rsplit("/", 1)[-1] not in _WELL_KNOWN_VALUES:
            return True
        if isinstance(value, Message) and _has_message(value):
            return True
    return False


# --------------------------------------------------------------------------------------------- decoding

_PRIMITIVES = {"BOOL": BOOL, "INT64": INT, "UINT64": UINT, "DOUBLE": DOUBLE, "STRING": STRING, "BYTES": BYTES}
_WELL_KNOWN = {"TIMESTAMP": TIMESTAMP, "DURATION": DURATION, "ANY": DYN}


def decode_type(m: Message) -> CelType:
    """A `cel.expr.Type` message as a CelType (ValueError for message and abstract types it cannot express)."""
    name = m.names()[0] if m.fields else "dyn"
    value = m.get(name)
    if name == "primitive" and isinstance(value, Scalar):
        return _PRIMITIVES[value.text]
    if name == "well_known" and isinstance(value, Scalar):
        return _WELL_KNOWN[value.text]
    if name == "dyn":
        return DYN
    if name == "message_type" and isinstance(value, Scalar) and value.as_str() in _WELL_KNOWN_VALUES:
        return TIMESTAMP if value.as_str().endswith("Timestamp") else DURATION  # CEL's own types
    if name == "null":
        return NULL
    if name == "list_type" and isinstance(value, Message):
        elem = value.message("elem_type")
        return list_of(decode_type(elem) if elem is not None else DYN)
    if name == "map_type" and isinstance(value, Message):
        k, v = value.message("key_type"), value.message("value_type")
        return map_of(decode_type(k) if k else DYN, decode_type(v) if v else DYN)
    if name == "type" and isinstance(value, Message):
        return type_of(decode_type(value))
    if name == "wrapper" and isinstance(value, Scalar):
        return _PRIMITIVES[value.text].as_nullable()
    if name == "type_param" and isinstance(value, Scalar):
        return type_param(value.as_str())
    if name == "abstract_type" and isinstance(value, Message):
        params = [decode_type(p) for p in value.all("parameter_types") if isinstance(p, Message)]
        if value.text("name") == "optional_type":
            return optional_of(params[0] if params else DYN)
        return abstract_type(value.text("name"), *params)
    raise ValueError(f"type {name} is not supported")


def decode_value(m: Message) -> Any:
    """A `cel.expr.Value` message as a native value (uint as `Uint`, types as `TypeValue`)."""
    if not m.fields:
        raise ValueError("empty value")
    name, value = m.fields[0]
    if isinstance(value, Scalar):
        if name == "null_value":
            return None
        if name == "bool_value":
            return value.as_bool()
        if name == "int64_value":
            return value.as_int()
        if name == "uint64_value":
            return Uint(value.as_int())
        if name == "double_value":
            return value.as_float()
        if name == "string_value":
            return value.as_str()
        if name == "bytes_value":
            return value.raw
        if name == "type_value":
            return TypeValue(value.as_str())
    elif name == "list_value":
        return [decode_value(v) for v in value.all("values") if isinstance(v, Message)]
    elif name == "map_value":
        out: dict[Any, Any] = {}
        for entry in value.all("entries"):
            assert isinstance(entry, Message)
            k, v = entry.message("key"), entry.message("value")
            out[decode_value(k) if k else None] = decode_value(v) if v else None
        return out
    elif name == "object_value":
        return _well_known(value)
    raise ValueError(f"value {name} is not supported")


def _well_known(any_: Message) -> Any:
    (key, body), = any_.fields
    type_name_ = key.strip("[]").rsplit("/", 1)[-1]
    assert isinstance(body, Message)
    seconds = body.get("seconds")
    nanos = body.get("nanos")
    s = seconds.as_int() if isinstance(seconds, Scalar) else 0
    ns = nanos.as_int() if isinstance(nanos, Scalar) else 0
    if type_name_ == "google.protobuf.Duration":
        return make_dur(s * 1_000_000_000 + ns)
    if type_name_ == "google.protobuf.Timestamp":
        return make_ts(s * 1_000_000_000 + ns)
    raise ValueError(f"message value {type_name_} is not supported")


# --------------------------------------------------------------------------------------------- running


def _env(case: Case) -> tuple[Env, dict[str, Any]]:
    variables: dict[str, CelType] = {}
    functions: dict[str, FunctionDecl] = {}
    for decl in case.test.all("type_env"):
        assert isinstance(decl, Message)
        name = decl.text("name")
        ident = decl.message("ident")
        if ident is not None:
            t = ident.message("type")
            variables[name] = decode_type(t) if t is not None else DYN
            continue
        fn = decl.message("function")
        overloads = fn.all("overloads") if fn is not None else []
        if len(overloads) != 1:
            raise ValueError(f"function {name}: only one overload per function is supported")
        (ov,) = overloads
        assert isinstance(ov, Message)
        params = [decode_type(p) for p in ov.all("params") if isinstance(p, Message)]
        result = ov.message("result_type")
        functions[name] = FunctionDecl(
            name, tuple(params), decode_type(result) if result else DYN, impl=_undefined,
            receiver=ov.flag("is_instance_function"),
        )  # fmt: skip
    activation: dict[str, Any] = {}
    for entry in case.test.all("bindings"):
        assert isinstance(entry, Message)
        holder = entry.message("value")
        inner = holder.message("value") if holder is not None else None
        if inner is None:
            raise ValueError(f"binding {entry.text('key')}: only plain values are supported")
        activation[entry.text("key")] = decode_value(inner)
    return Env(variables, functions), activation


def _undefined(*args: Any) -> Any:
    raise CelEvalError("function has no implementation in the conformance environment")


def run_case(case: Case) -> Outcome:
    """Compile and evaluate one case and compare with what it expects."""
    t = case.test
    try:
        env, activation = _env(case)
    except (ValueError, KeyError) as exc:
        return Outcome("fail", f"environment: {exc}")
    try:
        compiled = compile_expr(
            case.expr, env, container=t.text("container"), checked=not t.flag("disable_check"),
            macros=not t.flag("disable_macros"), cost_limit=10**12,
        )  # fmt: skip
    except CelError as exc:
        return Outcome("fail", f"compile: {type(exc).__name__}: {exc.message}")
    typed = t.message("typed_result")
    if typed is not None and typed.message("deduced_type") is not None:
        want_type = decode_type(typed.message("deduced_type"))  # type: ignore[arg-type]
        if str(compiled.type) != str(want_type):
            return Outcome("wrong", f"type {compiled.type}, expected {want_type}")
    if t.flag("check_only"):
        return Outcome("pass")
    try:
        fast = compiled(activation)
        fast_error = None
    except CelEvalError as exc:
        fast, fast_error = None, exc
    try:
        exact = compiled.evaluate_exact(activation)
        exact_error = None
    except CelEvalError as exc:
        exact, exact_error = None, exc
    if (fast_error is None) != (exact_error is None) or (fast_error is None and not same(fast, exact)):
        return Outcome("wrong", f"fast path {fast!r} / {fast_error} but exact path {exact!r} / {exact_error}")
    expected = t.message("value") or (typed.message("result") if typed is not None else None)
    if t.get("eval_error") is not None or t.get("any_eval_errors") is not None:
        if exact_error is not None:
            return Outcome("pass")
        return Outcome("wrong", f"expected an error, got {exact!r}")
    if exact_error is not None:
        return Outcome("fail", f"eval: {exact_error}")
    want = decode_value(expected) if expected is not None else True
    if not same(exact, want):
        return Outcome("wrong", f"got {exact!r}, expected {want!r}")
    return Outcome("pass")


def same(a: Any, b: Any) -> bool:
    """Strict CEL value identity for test results: kinds must match (int, uint and double differ), NaN == NaN."""
    ka, kb = type_name(a), type_name(b)
    if ka != kb:
        return False
    if ka == "double":
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if ka == "list":
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if ka == "map":
        if len(a) != len(b):
            return False
        return all(any(same(k, k2) and same(v, v2) for k2, v2 in b.items()) for k, v in a.items())
    if ka.startswith("optional"):
        return a.present == b.present and (not a.present or same(a.value, b.value))
    return bool(a == b)

