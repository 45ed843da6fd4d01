"""What a Mooncake object holds: the header before the payload (the descriptor as JSON) and the entry it decodes to."""

from __future__ import annotations

import json
import struct

from attrs import define

from nexuskv import StateDescriptor, from_dict, to_dict

MAGIC = b"NXKV"


FORMAT = 1


_HEAD = struct.Struct("<4sBI")  # magic, format, length of the JSON descriptor that follows


def encode_header(descriptor: StateDescriptor) -> bytes:
    """The bytes stored before a payload: magic, format, and the descriptor as JSON (`nexuskv.to_dict`)."""
    body = json.dumps(to_dict(descriptor), separators=(",", ":")).encode()
    return _HEAD.pack(MAGIC, FORMAT, len(body)) + body


def header_length(view: memoryview) -> int:
    """Length of the header at the start of a stored object; ValueError when it is not one of ours."""
    if view.nbytes < _HEAD.size:
        raise ValueError(f"object of {view.nbytes} bytes is shorter than the header")
    magic, fmt, n = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise ValueError(f"bad magic {bytes(magic)!r}")
    if fmt != FORMAT:
        raise ValueError(f"unknown format {fmt}")
    if _HEAD.size + n > view.nbytes:
        raise ValueError(f"descriptor of {n} bytes runs past the {view.nbytes}-byte object")
    return _HEAD.size + n


def decode_descriptor(header: memoryview | bytes) -> StateDescriptor:
    """The descriptor of a header (`header_length` bytes); ValueError when unreadable."""
    try:
        return from_dict(StateDescriptor, json.loads(bytes(header[_HEAD.size :])))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable descriptor: {exc!r}") from None


@define
class Entry:
    """What this process knows about one object it stored (no payload)."""

    key: str
    descriptor: StateDescriptor
    header: bytes  # the header this process wrote: a read that finds it again skips decoding the JSON
    size: int  # header + payload bytes, as stored
    priority: float
    seq: int
    expires: float | None  # time.monotonic() deadline, None without a TTL
