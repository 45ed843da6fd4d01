"""The sidecar API's OpenAPI 3.1 document, built from the kernel's contract schemas (never written by hand).

`GET /v1/openapi.json` serves it; docs/sidecar.md describes the same operations in prose. The request, plan and
state-descriptor bodies are the published JSON Schemas (`nexuskv.json_schema`), so a client generated from this
document speaks exactly the contracts the kernel validates.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from nexuskv import LoadReport, NodeState, Plan, Request, StateDescriptor, json_schema
from nexuskv_sidecar._binary import CONTENT_TYPE

__all__ = ["openapi"]

_REF = "#/components/schemas/"
_BINARY = ("The binary encoding: the 4 bytes `NKV1`, the JSON part's length as a little-endian uint32, the JSON part "
           "(the JSON body with the request's `token_ids` left out), then the request's token ids as little-endian "
           "uint32s to the end of the body. Checked as the JSON body is; every uint32 is a valid token id.")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _simple(cls: type) -> dict[str, Any]:
    """A small JSON Schema of a plain attrs class's fields (NodeState, LoadReport)."""
    types = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
    props: dict[str, Any] = {}
    for f in attrs.fields(cls):
        name = getattr(f.type, "__name__", str(f.type))
        tp = next((v for k, v in types.items() if name.startswith(k)), None)
        sch: dict[str, Any] = {"type": tp} if tp else {}
        if "dict" in str(f.type):
            sch = {"type": "object", "additionalProperties": {"type": "string"}}
        if "None" in str(f.type) and tp:
            sch = {"type": [tp, "null"]}
        if f.metadata.get("description"):
            sch["description"] = f.metadata["description"]
        props[f.name] = sch
    required = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _op(summary: str, body: dict[str, Any] | None, answer: dict[str, Any], *, auth: bool = True,
        binary: bool = False) -> dict[str, Any]:  # fmt: skip
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {"application/json": {"schema": answer}}},
        "400": {"description": "Bad body: every field problem with its path", "content": {
            "application/json": {"schema": _ref("Error")}}},
        "401": {"description": "No token, or an unknown one"},
        "403": {"description": "The token acts for another tenant, or (materialize, report) the plan's MAC does not "
                               "check"},
    }}  # fmt: skip
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        if binary:
            op["requestBody"]["content"][CONTENT_TYPE] = {"schema": {
                "type": "string", "format": "binary", "contentMediaType": CONTENT_TYPE, "description": _BINARY}}
    if not auth:
        op["security"] = []
        op["responses"] = {"200": op["responses"]["200"]}
    return op


@functools.cache
def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the sidecar API."""
    payload = {"type": "object", "required": ["block", "data"], "additionalProperties": False, "properties": {
        "block": {"type": "integer", "minimum": 0}, "group": {"type": "integer", "minimum": 0, "default": 0},
        "data": {"type": "string", "contentEncoding": "base64"}}}  # fmt: skip
    schemas: dict[str, Any] = {
        "Request": json_schema(Request),
        "Plan": json_schema(Plan),
        "StateDescriptor": json_schema(StateDescriptor),
        "NodeState": _simple(NodeState),
        "LoadReport": _simple(LoadReport),
        "Error": {"type": "object", "required": ["error"], "properties": {
            "error": {"type": "string"},
            "problems": {"type": "array", "items": {"type": "object", "properties": {
                "path": {"type": "string"}, "problem": {"type": "string"}}}}}},
    }  # fmt: skip
    obj = {"type": "object", "additionalProperties": False}
    paths = {
        "/v1/plan": {"post": _op("Plan a request: what to restore, from where, what to prefetch (fails open to "
                                 "recompute within the deadline)", _ref("Request"), _ref("Plan"), binary=True)},
        "/v1/route": {"post": _op("Pick the node to run a request on", {
            **obj, "required": ["request", "nodes"],
            "properties": {"request": _ref("Request"), "nodes": {"type": "array", "items": _ref("NodeState")}}},
            {"type": "object"}, binary=True)},
        "/v1/commit": {"post": _op("Hand produced state to the bounded writer", {
            **obj, "required": ["request", "payloads"],
            "properties": {"request": _ref("Request"), "payloads": {"type": "array", "items": payload}}},
            {"type": "object", "properties": {"accepted": {"type": "integer"}, "refused": {"type": "integer"}}})},
        "/v1/materialize": {"post": _op("Load and verify a plan's state; per block its descriptor (and bytes with "
                                        "?payloads=1)", {
            **obj, "required": ["plan", "request"], "properties": {"plan": _ref("Plan"), "request": _ref("Request")}},
            {"type": "object", "properties": {"blocks": {"type": "integer"}, "tokens": {"type": "integer"},
             "complete": {"type": "boolean"}, "reason": {"type": "string"}, "states": {"type": "array", "items": {
                 "type": "object", "properties": {"block": {"type": "integer"}, "group": {"type": "integer"},
                 "descriptor": _ref("StateDescriptor"), "data": {"type": "string"}}}}}})},
        "/v1/report": {"post": _op("Report how restoring a plan went", {
            **obj, "required": ["plan", "report"], "properties": {"plan": _ref("Plan"), "report": _ref("LoadReport")}},
            {"type": "object", "properties": {"recompute_from": {"type": "integer"}}})},
        "/v1/status": {"get": _op("The kernel's status (operator token)", None, {"type": "object"})},
        "/v1/decisions": {"get": _op("Stream decision records as JSON lines (a tenant's own; the operator's: all)",
                                     None, {"type": "object"})},
        "/metrics": {"get": _op("Prometheus metrics (operator token)", None, {"type": "string"})},
        "/healthz": {"get": _op("Liveness", None, {"type": "object"}, auth=False)},
        "/v1/openapi.json": {"get": _op("This document", None, {"type": "object"}, auth=False)},
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "NexusKV sidecar", "version": "1"},
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
