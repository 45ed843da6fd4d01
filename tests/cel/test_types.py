from __future__ import annotations

import datetime as dt
import enum
from typing import Any

import attrs
import pytest

from nexuskv import contracts as c
from nexuskv.cel.types import (
    BOOL,
    BYTES,
    DEFAULT_MAX_LIST,
    DEFAULT_MAX_STRING,
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
    list_of,
    map_of,
    message_fields,
    message_type,
    record_type,
)


def test_scalar_names_and_identity():
    names = [str(t) for t in (INT, UINT, DOUBLE, BOOL, STRING, BYTES, NULL, DYN, TIMESTAMP, DURATION)]
    assert names == [
        "int",
        "uint",
        "double",
        "bool",
        "string",
        "bytes",
        "null",
        "dyn",
        "timestamp",
        "duration",
    ]
    assert CelType("int") == INT and hash(CelType("int")) == hash(INT)
    assert INT != UINT


def test_refinements_do_not_change_identity():
    assert STRING.with_size(10) == STRING
    assert STRING.as_nullable() == STRING
    assert hash(list_of(INT, 5)) == hash(list_of(INT))
    assert STRING.with_size(10).max_size == 10 and STRING.max_size is None
    assert STRING.as_nullable().nullable and not STRING.nullable
    assert "nullable" in repr(STRING.as_nullable()) and "max_size=3" in repr(list_of(INT, 3))


def test_containers():
    assert str(list_of(STRING)) == "list(string)"
    assert str(map_of(STRING, list_of(INT))) == "map(string, list(int))"
    assert list_of(INT).elem == INT
    m = map_of(INT, DOUBLE)
    assert m.key == INT and m.elem == DOUBLE
    assert list_of(INT) != list_of(UINT)
    with pytest.raises(ValueError, match="map keys"):
        map_of(DOUBLE, INT)


def test_default_bounds():
    assert list_of(INT).bound == DEFAULT_MAX_LIST
    assert STRING.bound == DEFAULT_MAX_STRING
    assert list_of(INT, 7).bound == 7


def test_message_type_of_contracts():
    sd = message_type(c.StateDescriptor)
    assert str(sd) == "StateDescriptor" and sd == message_type(c.StateDescriptor)
    f = sd.fields()
    assert f["nbytes"] == INT
    assert f["namespace"] == message_type(c.Namespace)
    assert f["tensors"] == list_of(message_type(c.TensorSpec))
    assert f["tensors"].max_size == 1024  # maxItems in the contract
    assert f["parent_key"] == STRING and f["parent_key"].nullable
    assert not f["key"].nullable
    assert "CONTRACT" not in f  # ClassVar, not a field
    ns = message_fields(c.Namespace)
    assert ns["tenant"].max_size == 256  # maxLength metadata
    model = message_fields(c.ModelIdentity)
    assert model["adapter"] == message_type(c.AdapterIdentity) and model["adapter"].nullable
    assert message_fields(c.AdapterIdentity)["scale"] == DOUBLE
    assert message_fields(c.StateGroup)["kind"] == STRING  # StrEnum
    assert message_fields(c.TensorSpec)["shape"] == list_of(INT)
    assert message_fields(c.Request)["request_id"].max_size == 256
    assert message_fields(c.Slo)["ttft_ms"] == DOUBLE and message_fields(c.Slo)["ttft_ms"].nullable
    assert message_fields(c.CostProfile)["tiers"] == map_of(STRING, message_type(c.LinkCost))
    assert message_fields(c.Plan)["action"] == STRING


def test_properties_are_not_fields():
    assert "namespace" not in message_fields(c.Request)
    assert "kind" not in message_fields(c.Layout)


class Color(enum.IntEnum):
    RED = 1


@attrs.frozen
class Node:
    name: str = attrs.field(metadata={"maxLength": 8})
    when: dt.datetime
    ttl: dt.timedelta
    data: bytes
    flags: list[bool] = attrs.field(metadata={"maxItems": 3})
    counts: dict[str, int] = attrs.field(metadata={"maxProperties": 2})
    extra: Any
    color: Color
    child: Node | None = None


def test_message_type_of_custom_class():
    f = message_type(Node).fields()
    assert f["name"] == STRING and f["name"].max_size == 8
    assert f["when"] == TIMESTAMP and f["ttl"] == DURATION and f["data"] == BYTES
    assert f["flags"] == list_of(BOOL) and f["flags"].max_size == 3
    assert f["counts"] == map_of(STRING, INT) and f["counts"].max_size == 2
    assert f["extra"] == DYN and f["color"] == INT
    assert f["child"] == message_type(Node) and f["child"].nullable  # recursive types work


def test_message_type_rejects_non_attrs_and_bad_hints():
    with pytest.raises(TypeError, match="not an attrs class"):
        message_type(dict)

    @attrs.frozen
    class Bad:
        x: int | str

    with pytest.raises(TypeError, match=r"Bad\.x: unsupported union"):
        message_type(Bad).fields()

    @attrs.frozen
    class Bad2:
        x: set[int]

    with pytest.raises(TypeError, match="unsupported field type"):
        message_type(Bad2).fields()


def test_env_and_function_decls():
    decl = FunctionDecl("double_it", [INT], INT, lambda x: 2 * x)
    env = Env({"x": INT}, {"double_it": decl})
    assert env.variables["x"] == INT and env.functions["double_it"].args == (INT,)
    bigger = env.extend({"y": STRING})
    assert set(bigger.variables) == {"x", "y"} and "double_it" in bigger.functions
    assert set(env.variables) == {"x"}
    with pytest.raises(ValueError, match="declared as"):
        Env({}, {"other": decl})
    with pytest.raises(ValueError, match="shadow"):
        Env({}, {"size": FunctionDecl("size", [STRING], INT, len)})
    with pytest.raises(TypeError):
        env.variables["z"] = INT  # type: ignore[index]


def test_record_type():
    r = record_type("variables", {"big": BOOL, "n": INT})
    assert str(r) == "variables" and r.fields() == {"big": BOOL, "n": INT}
    assert r == record_type("variables", {"n": INT, "big": BOOL})
    assert r != record_type("variables", {"n": INT})
    assert r != message_type(c.Namespace)
