"""How the Redis tier lays a slot out: key names per tenant, and the metadata record beside the payload chunks.

A key is `{prefix}:{tenant}:{name}`, `name` the slot's keyed name (`nexuskv.store_name`): a `SCAN` of the server
shows which tenants hold state, never which blocks. The tenant stays readable because per-tenant ACL users
(`RedisStore.grant`, or an operator's own rules) are key patterns, `~{prefix}:{tenant}:*`.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any
from urllib.parse import quote, unquote

from attrs import define

from nexuskv import StateDescriptor, from_dict, to_dict

META = b"m"  # JSON: descriptor, priority, chunk count and sizes, crc32, write token


TOKEN = b"t"  # the write token alone: what a read compares, so it never parses JSON


FORMAT = 1


_FIELDS: list[bytes] = []


_GLOB = re.compile(r"([*?\[\]\\])")


_NAME = re.compile(r"^[0-9a-f]{2,}$")  # a keyed name (or an older version's raw slot: then skipped by the caller)


def chunk_fields(n: int) -> list[bytes]:
    """Field names of the first `n` chunks: b"0", b"1", ... (cached)."""
    while len(_FIELDS) < n:
        _FIELDS.append(b"%d" % len(_FIELDS))
    return _FIELDS[:n]


def tenant_part(tenant: str) -> str:
    """The tenant as it appears in key names: percent-encoded, so it holds no `:` and no glob character.

    Without it tenant `a` would own the key pattern `nexuskv:a:*`, which also matches tenant `a:b`'s keys.
    """
    return quote(tenant, safe="")


def tenant_prefix(prefix: str, tenant: str) -> str:
    """`{prefix}:{tenant}:`, the start of every key of one tenant."""
    return f"{prefix}:{tenant_part(tenant)}:"


def slot_key(prefix: str, tenant: str, name: str) -> bytes:
    """The key of one slot of one tenant: `{prefix}:{tenant}:{name}` (a Redis hash), `name` its keyed name."""
    return (tenant_prefix(prefix, tenant) + name).encode()


def glob_escape(text: str) -> str:
    """`text` as a literal inside a Redis glob pattern (SCAN MATCH, ACL key patterns)."""
    return _GLOB.sub(r"\\\1", text)


def parse_key(prefix: str, key: bytes) -> tuple[str, str] | None:
    """(tenant, name) of a key of this layout under `prefix`, or None for any other key.

    The name is not a slot: the slot comes from the descriptor stored under the key (`nexuskv.slot_named`).
    """
    text = key.decode("utf-8", "replace")
    head = prefix + ":"
    if not text.startswith(head):
        return None
    parts = text[len(head) :].split(":")
    if len(parts) != 2 or not _NAME.match(parts[1]):
        return None
    return unquote(parts[0]), parts[1]


@define
class Entry:
    """What this process knows about one stored slot (no payload): enough to read it in one round trip."""

    key: bytes
    descriptor: StateDescriptor
    size: int
    chunks: tuple[int, ...]  # byte length of each chunk
    token: bytes
    crc: int | None  # crc32 of the payload, when the writer had verify_crc on
    priority: float
    seq: int
    expires: float | None  # time.monotonic() deadline, None without a TTL


def encode_meta(descriptor: StateDescriptor, chunks: tuple[int, ...], token: bytes, crc: int | None,
                priority: float, ttl_s: float | None) -> bytes:  # fmt: skip
    """The JSON metadata record of a slot."""
    record = {"format": FORMAT, "descriptor": to_dict(descriptor), "chunks": list(chunks), "token": token.decode(),
              "crc32": crc, "priority": priority, "ttl_s": ttl_s}  # fmt: skip
    return json.dumps(record, separators=(",", ":")).encode()


def decode_meta(key: bytes, raw: bytes, pttl_ms: int, seq: int) -> Entry:
    """An `Entry` from a metadata record and the key's remaining TTL (PTTL: -1 none); ValueError if unusable."""
    try:
        record: dict[str, Any] = json.loads(raw)
        if record.get("format") != FORMAT:
            raise ValueError(f"unknown metadata format {record.get('format')!r}")
        desc = from_dict(StateDescriptor, record["descriptor"])
        chunks = tuple(int(n) for n in record["chunks"])
        expires = time.monotonic() + pttl_ms / 1e3 if pttl_ms >= 0 else None
        crc = None if record["crc32"] is None else int(record["crc32"])
        return Entry(key=key, descriptor=desc, size=sum(chunks), chunks=chunks, token=record["token"].encode(),
                     crc=crc, priority=float(record["priority"]), seq=seq,
                     expires=expires)  # fmt: skip
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed metadata: {exc!r}") from None
