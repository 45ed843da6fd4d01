"""Private: request bodies in, responses out. JSON is parsed by orjson and checked against the contracts' schemas.

Every problem with a body is an `ApiError` carrying the HTTP status and, for contract problems, each field path
with what is wrong with it (the same messages as `nexuskv schema validate`).
"""

from __future__ import annotations

import base64
import binascii
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

import attrs
import orjson

from nexuskv import ContractError, LoadReport, NodeState, Plan, Request, from_dict

__all__ = ["ApiError", "decode", "dumps", "field", "load_report", "nodes", "payloads"]

MAX_NODES = 4096  # candidates one route prices (`nexuskv.paths.route.MAX_NODES`, the kernel's own bound)


class ApiError(Exception):
    """An answer other than 200: `status`, a one-line `detail`, and field `problems` for contract errors."""

    def __init__(self, status: int, detail: str, problems: list[tuple[str, str]] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.problems = problems or []

    def body(self) -> bytes:
        """The error as JSON: `{"error": ..., "problems": [{"path": ..., "problem": ...}]}`."""
        out: dict[str, Any] = {"error": self.detail}
        if self.problems:
            out["problems"] = [{"path": p, "problem": m} for p, m in self.problems]
        return orjson.dumps(out)


def dumps(value: Any) -> bytes:
    """JSON bytes of a JSON-compatible value."""
    return orjson.dumps(value)


def decode(body: bytes) -> Any:
    """The JSON value of a request body; 400 naming the position when it is not JSON."""
    if not body:
        raise ApiError(400, "empty body: expected a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"body is not JSON: {exc}") from None


def contract(cls: type, data: Any, where: str = "") -> Any:
    """Build a contract object from `data`; 400 (422 for an unknown schema version) with every field problem."""
    try:
        return from_dict(cls, data)
    except ContractError as exc:
        problems = [(f"{where}.{p}" if where and p != "<root>" else (where or p), m) for p, m in exc.problems]
        raise ApiError(400, f"invalid {exc.contract}", problems) from None


def field(data: Any, name: str, where: str = "body") -> Any:
    """`data[name]` of an object body; 400 when the body is not an object or lacks it."""
    if not isinstance(data, Mapping):
        raise ApiError(400, f"{where}: expected a JSON object")
    if name not in data:
        raise ApiError(400, f"{where}: {name!r} is required", [(name, "required field is missing")])
    return data[name]


def check_keys(data: Mapping[str, Any], allowed: set[str], where: str = "body") -> None:
    """400 naming the first unknown key (a typo must not be silently ignored)."""
    for k in data:
        if k not in allowed:
            raise ApiError(400, f"{where}: unknown field {k!r}", [(k, "unknown field")])


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object"}


def _accepts(tp: Any, value: Any) -> bool:
    """Whether a JSON value has the Python type a field declares (bool is not an int; an int is a float)."""
    if tp is Any:
        return True
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in args)
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp) or tp
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _accepts(args[1], v) for k, v in value.items())
    if origin is bool:
        return type(value) is bool
    if origin is int:
        return type(value) is int
    if origin is float:
        return type(value) in (int, float) and math.isfinite(value)
    return isinstance(value, origin)


def _attrs(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ApiError(400, f"{where}: expected a JSON object", [(where, "expected an object")])
    fields = attrs.fields_dict(attrs.resolve_types(cls))
    for k, v in data.items():
        if k not in fields:
            raise ApiError(400, f"{where}: unknown field {k!r}", [(f"{where}.{k}", "unknown field")])
        if not _accepts(fields[k].type, v):
            want = getattr(fields[k].type, "__name__", str(fields[k].type))
            problem = f"expected {want}, got {_JSON_TYPES.get(type(v), type(v).__name__)}"
            raise ApiError(400, f"{where}.{k}: {problem}", [(f"{where}.{k}", problem)])
    try:
        return cls(**data)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"{where}: {exc}", [(where, str(exc))]) from None


def nodes(data: Any) -> list[NodeState]:
    """A route body's `nodes`: a list of node states."""
    if not isinstance(data, list) or not data:
        raise ApiError(400, "nodes: expected a non-empty list", [("nodes", "expected a non-empty list")])
    if len(data) > MAX_NODES:  # before any is built (the kernel refuses more)
        raise ApiError(400, f"nodes: {len(data)} candidates, at most {MAX_NODES} (pre-select them)",
                       [("nodes", f"more than {MAX_NODES}")])  # fmt: skip
    nodes = [_attrs(NodeState, d, f"nodes[{i}]") for i, d in enumerate(data)]
    seen: set[str] = set()
    for i, n in enumerate(nodes):
        if n.node in seen:
            raise ApiError(400, f"nodes[{i}]: node {n.node!r} is given twice", [(f"nodes[{i}].node", "given twice")])
        seen.add(n.node)
    return nodes


def load_report(data: Any, plan: Plan) -> LoadReport:
    """A report body's `report`: how restoring `plan` went (its tier one the plan reads, its block in range)."""
    report: LoadReport = _attrs(LoadReport, data, "report")
    tiers = {s.tier for s in plan.spans}
    if report.tier and report.tier not in tiers:
        raise ApiError(400, f"report.tier: {report.tier!r} is not a tier the plan reads from ({sorted(tiers)})",
                       [("report.tier", "not a tier of the plan")])  # fmt: skip
    if report.failed_block is not None and not 0 <= report.failed_block < max(plan.tokens_total, 1):
        raise ApiError(400, f"report.failed_block: {report.failed_block} is not a block of the plan",
                       [("report.failed_block", "out of range")])  # fmt: skip
    if report.measured_ttft_ms is not None and report.measured_ttft_ms < 0:
        raise ApiError(400, "report.measured_ttft_ms: must not be negative", [("report.measured_ttft_ms", "negative")])
    if len(report.reason) > 1000:
        raise ApiError(400, "report.reason: longer than 1000 characters", [("report.reason", "too long")])
    return report


def payloads(data: Any, request: Request) -> dict[tuple[int, int], bytes]:
    """A commit body's `payloads`: `[{"block": i, "group": g, "data": base64}]` -> {(block, group): bytes}.

    Each (block, group) once, a full block of the request and a group of its layout.
    """
    blocks, groups = len(request.token_ids) // request.layout.page_size, len(request.layout.groups)
    if not isinstance(data, list):
        raise ApiError(400, "payloads: expected a list", [("payloads", "expected a list")])
    out: dict[tuple[int, int], bytes] = {}
    for i, item in enumerate(data):
        where = f"payloads[{i}]"
        if not isinstance(item, Mapping):
            raise ApiError(400, f"{where}: expected an object", [(where, "expected an object")])
        check_keys(item, {"block", "group", "data"}, where)
        block, group, raw = item.get("block"), item.get("group", 0), item.get("data")
        for name, v, bound in (("block", block, blocks), ("group", group, groups)):
            if type(v) is not int or not 0 <= v < bound:
                what = f"expected an integer in [0, {bound})" + (" (the request's full blocks)" if name == "block"
                                                                   else " (the layout's groups)")  # fmt: skip
                raise ApiError(400, f"{where}.{name}: {what}", [(f"{where}.{name}", what)])
        if (block, group) in out:
            raise ApiError(400, f"{where}: block {block} group {group} given twice", [(where, "given twice")])
        if not isinstance(raw, str):
            raise ApiError(400, f"{where}.data: expected base64 text", [(f"{where}.data", "expected base64 text")])
        try:
            out[(block, group)] = base64.b64decode(raw, validate=True)
        except binascii.Error as exc:
            raise ApiError(400, f"{where}.data: not base64: {exc}", [(f"{where}.data", "not base64")]) from None
    return out
