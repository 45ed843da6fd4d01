"""State descriptors as JSON, fast both ways: schema-checked parsing (a tier's files, a peer) and encoding.

A full validation (`from_dict`, about 2 ms) runs the first time each model / layout / tenant shape is seen; after
that only the fields that differ from block to block are checked, as the schema would, and set on that shape's
template: a restart or a large fetch reads thousands of descriptors that share everything else. Bytes seen
before give back the descriptor parsed then (descriptors are frozen, so sharing them is safe). Both caches are
bounded; the parser is safe to share between threads.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import attrs

from nexuskv.contracts import (
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    StateDescriptor,
    StateGroup,
    TokenizerIdentity,
    TokenSpan,
    Usage,
    from_dict,
    to_dict,
)

__all__ = ["DescriptorEncoder", "DescriptorParser"]

_PER_BLOCK = ("key", "parent_key", "span", "nbytes", "checksum", "placement", "group", "usage", "mac")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_MAC = re.compile(r"^([0-9a-f]{32})?$")
_CHECKSUM = re.compile(r"^[a-z0-9-]+:[0-9a-f]+$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")


def _int(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise ValueError(v)
    return v


def _num(v: Any) -> float:
    if type(v) not in (int, float):
        raise ValueError(v)
    return float(v)


def _name(v: Any) -> str:
    if type(v) is not str or len(v) > 256 or not _NAME.match(v):
        raise ValueError(v)
    return v


def _per_block(data: dict[str, Any]) -> dict[str, Any]:
    """The fields that differ from block to block, checked as the schema would (raises on anything off)."""
    key, parent, span, place, usage = data["key"], data["parent_key"], data["span"], data["placement"], data["usage"]
    if type(key) is not str or not _HEX32.match(key) or not (parent is None or (type(parent) is str and
                                                                                _HEX32.match(parent))):  # fmt: skip
        raise ValueError("key")
    if type(data["checksum"]) is not str or not _CHECKSUM.match(data["checksum"]):
        raise ValueError("checksum")
    if type(data["mac"]) is not str or not _MAC.match(data["mac"]):
        raise ValueError("mac")
    if set(span) != {"start", "end"} or set(place) != {"tier", "node", "epoch"} or set(usage) != {
        "created_s", "last_access_s", "hits"}:  # fmt: skip
        raise ValueError("shape")
    return {
        "key": key,
        "parent_key": parent,
        "span": TokenSpan(_int(span["start"]), _int(span["end"])),
        "nbytes": _int(data["nbytes"]),
        "checksum": data["checksum"],
        "placement": Placement(_name(place["tier"]), _name(place["node"]), _int(place["epoch"])),
        "group": _int(data["group"]),
        "usage": Usage(_num(usage["created_s"]), _num(usage["last_access_s"]), _int(usage["hits"])),
        "mac": data["mac"],
    }


_warm = threading.Lock()
_warmed = False


def _warm_up() -> None:
    """Run the schema's full check once: its first use builds validators (about 75 ms), which a request must not pay."""
    global _warmed
    with _warm:
        if _warmed:
            return
        layout = Layout(groups=[StateGroup(kind="dense", layers=1, kv_heads=1, head_dim=8)])
        desc = StateDescriptor(key="0" * 32, namespace=Namespace("warm-up"), model=ModelIdentity("warm-up"),
                               tokenizer=TokenizerIdentity("warm-up"), layout=layout, span=TokenSpan(0, 16),
                               nbytes=0, checksum="xxh3-128:" + "0" * 32, placement=Placement("t", "n"))  # fmt: skip
        from_dict(StateDescriptor, json.loads(json.dumps(to_dict(desc))))
        _warmed = True


class DescriptorParser:
    """Parses descriptor JSON with the schema's checks, fast (see the module docstring)."""

    def __init__(self, entries: int = 4096) -> None:
        """Keep at most `entries` exact descriptors and `entries` shape templates (oldest dropped first).

        The first parser of a process warms the schema check up, so the first descriptor read does not pay it.
        """
        _warm_up()
        self._max = entries
        self._exact: dict[bytes, StateDescriptor] = {}
        self._templates: dict[str, StateDescriptor] = {}
        self._lock = threading.Lock()

    def parse(self, raw: bytes | bytearray | str) -> StateDescriptor:
        """The descriptor in `raw`; a `ValueError` (JSON) or the schema's `ContractError` when it is not a valid one."""
        key = raw.encode() if isinstance(raw, str) else bytes(raw)
        with self._lock:
            desc = self._exact.get(key)
        if desc is None:
            desc = self._parse(key)
            with self._lock:
                _bounded_put(self._exact, key, desc, self._max)
        return desc

    def _parse(self, raw: bytes) -> StateDescriptor:
        data = json.loads(raw)
        if not isinstance(data, dict) or not set(_PER_BLOCK) <= data.keys():
            return from_dict(StateDescriptor, data)  # says exactly what is wrong
        shared = json.dumps({k: v for k, v in data.items() if k not in _PER_BLOCK}, sort_keys=True)
        with self._lock:
            template = self._templates.get(shared)
        if template is None:
            desc = from_dict(StateDescriptor, data)
            with self._lock:
                _bounded_put(self._templates, shared, desc, self._max)
            return desc
        try:
            return attrs.evolve(template, **_per_block(data))
        except (KeyError, TypeError, ValueError):
            return from_dict(StateDescriptor, data)  # the full check says exactly what is wrong


class DescriptorEncoder:
    """Descriptors as compact JSON, equal to `to_dict`'s: each shape's shared fields converted once.

    `to_dict` costs about 0.15 ms a descriptor; a peer asking for thousands of blocks of one model and tenant
    gets the shared part (model, tokenizer, layout, namespace...) from a bounded cache, and only the per-block
    fields are written out. Safe to share between threads.
    """

    def __init__(self, entries: int = 1024) -> None:
        self._max = entries
        self._shapes: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def encode(self, desc: StateDescriptor) -> bytes:
        """The JSON bytes of `desc` (what `json.dumps(to_dict(desc))` would say, in another key order)."""
        shape = (desc.namespace, desc.model, desc.tokenizer, desc.layout, desc.codec, desc.raw_nbytes, desc.tensors,
                 desc.schema_version, type(desc))  # fmt: skip
        try:
            with self._lock:
                shared = self._shapes.get(shape)
        except TypeError:  # an unhashable field (a store's own subclass): the plain way
            return json.dumps(to_dict(desc), separators=(",", ":")).encode()
        if shared is None:
            shared = {k: v for k, v in to_dict(desc).items() if k not in _PER_BLOCK}
            with self._lock:
                _bounded_put(self._shapes, shape, shared, self._max)
        span, place, usage = desc.span, desc.placement, desc.usage
        data = {**shared, "key": desc.key, "parent_key": desc.parent_key,
                "span": {"start": span.start, "end": span.end}, "nbytes": desc.nbytes, "checksum": desc.checksum,
                "placement": {"tier": place.tier, "node": place.node, "epoch": place.epoch}, "group": desc.group,
                "usage": {"created_s": usage.created_s, "last_access_s": usage.last_access_s,
                          "hits": usage.hits}, "mac": desc.mac}  # fmt: skip
        return json.dumps(data, separators=(",", ":")).encode()


def _bounded_put(cache: dict[Any, Any], key: Any, value: Any, limit: int) -> None:
    """Insert into an insertion-ordered cache, dropping the oldest entries beyond `limit`."""
    cache[key] = value
    while len(cache) > limit:
        del cache[next(iter(cache))]
