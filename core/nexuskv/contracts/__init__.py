"""The language-neutral contracts: state descriptor, request, plan and cost profile as frozen attrs classes.

The JSON Schemas in `schemas/` are generated from these classes (`nexuskv schema export`) and a test keeps the
two equal. `to_dict` / `from_dict` convert to and from JSON-compatible dicts; `from_dict` validates first, so
every error names the field path.
"""

from __future__ import annotations

from typing import Any, TypeVar

from nexuskv.contracts import schema
from nexuskv.contracts.fields import SCHEMA_VERSION
from nexuskv.contracts.plan import Plan, PlanAction, PlanSpan, Predicted
from nexuskv.contracts.profile import Calibration, CodecCost, CostProfile, LinkCost, PrefillCost
from nexuskv.contracts.request import ExtraInput, Request, Slo
from nexuskv.contracts.state import (
    AdapterIdentity,
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    StateDescriptor,
    StateGroup,
    StateKind,
    TensorSpec,
    TokenizerIdentity,
    TokenSpan,
    Usage,
)

__all__ = [
    "CONTRACTS",
    "SCHEMA_VERSION",
    "AdapterIdentity",
    "Calibration",
    "CodecCost",
    "CostProfile",
    "ExtraInput",
    "Layout",
    "LinkCost",
    "ModelIdentity",
    "Namespace",
    "Placement",
    "Plan",
    "PlanAction",
    "PlanSpan",
    "Predicted",
    "PrefillCost",
    "Request",
    "Slo",
    "StateDescriptor",
    "StateGroup",
    "StateKind",
    "TensorSpec",
    "TokenSpan",
    "TokenizerIdentity",
    "Usage",
    "from_dict",
    "from_json",
    "json_schema",
    "to_dict",
]

CONTRACTS: dict[str, type] = {
    cls.CONTRACT: cls for cls in (StateDescriptor, Request, Plan, CostProfile)
}

T = TypeVar("T")


def from_json(cls: type[T], text: bytes | str) -> T:
    """`from_dict(cls, json.loads(text))`, faster: what a server reading contracts off the wire calls.

    JSON that does not parse is a `ContractError` at `<root>` with the parser's position; orjson parses when it is
    installed (the sidecar brings it).
    """
    return schema.from_json(cls, text)


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a contract class, as `schemas/<contract>.v1.json` holds it."""
    return schema.schema_for(cls)


def to_dict(obj: Any) -> dict[str, Any]:
    """Turn a contract object into a JSON-compatible dict (tuples become lists, enums their values)."""
    return schema.unstructure(obj)


def from_dict(cls: type[T], data: Any) -> T:
    """Validate `data` against `cls`'s schema and build the object.

    Raises `SchemaVersionError` for an unknown `schema_version` and `ContractError` listing every problem with
    its field path otherwise.
    """
    return schema.structure(cls, data)
