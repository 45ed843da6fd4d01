"""cel-python on the conformance cases, for comparison in `bench/cel_conformance.py`.

`outcome(case)` compiles and evaluates a case with cel-python (its own parser and evaluator; declarations
passed as annotations, the container as its package) and compares the result with the same strict identity
`run_case` uses. cel-python has no type checker, so `check_only` cases pass when they compile, and it has no
parse-only mode to honour. This adapter is ours: where it mistranslates a value, cel-python is undercounted.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import celpy
import celpy.celtypes as ct

from nexuskv.cel import TypeValue, Uint
from nexuskv.cel.conformance import Case, Message, Outcome, decode_value, same

_TYPE_NAMES = {ct.IntType: "int", ct.UintType: "uint", ct.DoubleType: "double", ct.BoolType: "bool",
               ct.StringType: "string", ct.BytesType: "bytes", ct.ListType: "list", ct.MapType: "map",
               ct.NullType: "null_type", ct.TimestampType: "google.protobuf.Timestamp",
               ct.DurationType: "google.protobuf.Duration", ct.TypeType: "type"}  # fmt: skip


def to_celpy(v: Any) -> Any:
    """A native value as cel-python's."""
    if v is None:
        return None
    if isinstance(v, bool):
        return ct.BoolType(v)
    if isinstance(v, Uint):
        return ct.UintType(int(v))
    if isinstance(v, int):
        return ct.IntType(v)
    if isinstance(v, float):
        return ct.DoubleType(v)
    if isinstance(v, str):
        return ct.StringType(v)
    if isinstance(v, bytes):
        return ct.BytesType(v)
    if isinstance(v, list):
        return ct.ListType([to_celpy(x) for x in v])
    if isinstance(v, dict):
        return ct.MapType({to_celpy(k): to_celpy(x) for k, x in v.items()})
    if isinstance(v, dt.datetime):
        return ct.TimestampType(v)
    if isinstance(v, dt.timedelta):
        return ct.DurationType(v)
    raise TypeError(type(v).__name__)


def from_celpy(v: Any) -> Any:
    """cel-python's value as a native one."""
    if v is None or isinstance(v, ct.NullType):
        return None
    if isinstance(v, type):
        return TypeValue(_TYPE_NAMES.get(v, v.__name__))
    if isinstance(v, ct.BoolType | bool):
        return bool(v)
    if isinstance(v, ct.UintType):
        return Uint(int(v))
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, bytes):
        return bytes(v)
    if isinstance(v, list):
        return [from_celpy(x) for x in v]
    if isinstance(v, dict):
        return {from_celpy(k): from_celpy(x) for k, x in v.items()}
    if isinstance(v, dt.datetime):
        return dt.datetime.fromtimestamp(v.timestamp(), dt.UTC).replace(microsecond=v.microsecond)
    if isinstance(v, dt.timedelta):
        return dt.timedelta(days=v.days, seconds=v.seconds, microseconds=v.microseconds)
    raise TypeError(type(v).__name__)


def outcome(case: Case) -> Outcome:
    """cel-python's outcome on one case."""
    t = case.test
    try:
        activation = {}
        for entry in t.all("bindings"):
            assert isinstance(entry, Message)
            holder = entry.message("value")
            inner = holder.message("value") if holder is not None else None
            if inner is None:
                return Outcome("fail", "binding")
            activation[entry.text("key")] = to_celpy(decode_value(inner))
        env = celpy.Environment(package=t.text("container") or None)
        program = env.program(env.compile(case.expr))
    except Exception as exc:
        return Outcome("fail", f"compile: {type(exc).__name__}")
    if t.flag("check_only"):
        return Outcome("pass")
    try:
        result = program.evaluate(activation)
        error = isinstance(result, celpy.CELEvalError)
    except Exception:
        result, error = None, True
    if t.get("eval_error") is not None or t.get("any_eval_errors") is not None:
        return Outcome("pass" if error else "wrong")
    if error:
        return Outcome("fail", "eval")
    expected = t.message("value")
    typed = t.message("typed_result")
    if expected is None and typed is not None:
        expected = typed.message("result")
    want = decode_value(expected) if expected is not None else True
    try:
        got = from_celpy(result)
    except TypeError:
        return Outcome("wrong", "unconvertible result")
    return Outcome("pass" if same(got, want) else "wrong")
