"""Private: the binary request encoding (`application/x-nexuskv-tokens`): token ids as raw integers beside JSON.

A 4,096-token request is about 30 KB of JSON, and parsing and checking its token list cost more than planning
it. In this encoding a body is

    offset 0      b"NKV1"                       magic and version
    offset 4      n: uint32, little-endian      length of the JSON part
    offset 8      n bytes of UTF-8 JSON          the JSON body as usual, with the request's `token_ids` left out
    offset 8 + n  uint32 little-endian each      the request's token ids, to the end of the body

On `/v1/plan` the JSON part is the request itself; on `/v1/route` it is `{"request": ..., "nodes": [...]}` and the
ids are the request's. Every uint32 is a valid token id (the contract's range is 0 .. 2^32 - 1), so the ids are
not checked one by one; everything else is checked exactly as in a JSON body. Problems are 400s that say where.
"""

from __future__ import annotations

import array
import sys
from typing import Any

import attrs
import orjson

from nexuskv import ContractError, Request, from_dict
from nexuskv_sidecar._codec import ApiError

__all__ = ["CONTENT_TYPE", "MAGIC", "Parsed", "encode", "head", "split", "with_tokens"]

CONTENT_TYPE = "application/x-nexuskv-tokens"
MAGIC = b"NKV1"
_HEAD = 8
_LITTLE = sys.byteorder == "little"


def encode(document: dict[str, Any], token_ids: Any) -> bytes:
    """A binary body: `document` as JSON (without the request's token ids) and `token_ids` as uint32 LE."""
    head = orjson.dumps(document)
    ids = array.array("I", token_ids)
    if not _LITTLE:  # pragma: no cover - the wire is little-endian everywhere
        ids.byteswap()
    return MAGIC + len(head).to_bytes(4, "little") + head + ids.tobytes()


def split(body: bytes, max_tokens: int) -> tuple[Any, array.array[int]]:
    """The JSON part (parsed) and the token ids of a binary body; 400 naming what is wrong."""
    if len(body) < _HEAD or body[:4] != MAGIC:
        raise ApiError(400, f"body: a {CONTENT_TYPE} body starts with {MAGIC!r} and the JSON part's length")
    n = int.from_bytes(body[4:8], "little")
    rest = len(body) - _HEAD - n
    if rest < 0:
        raise ApiError(400, f"body: the JSON part's length {n} runs past the body's end ({len(body)} bytes)")
    if rest % 4:
        raise ApiError(400, f"body: the token part is {rest} bytes, not a whole number of uint32 ids")
    if rest // 4 > max_tokens:
        raise ApiError(400, f"request: {rest // 4} tokens, over the limit of {max_tokens}")
    try:
        document = orjson.loads(body[_HEAD : _HEAD + n])
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"body: the JSON part is not JSON: {exc}") from None
    ids = array.array("I")
    ids.frombytes(body[_HEAD + n :])
    if not _LITTLE:  # pragma: no cover
        ids.byteswap()
    return document, ids


class Parsed:
    """A checked request whose token ids are still uint32s: `head` (the request with no token ids) and `ids`.

    Making 4,096 Python ints costs about as much as planning: a worker never makes them; the process that plans
    does, once (`request()`).
    """

    __slots__ = ("head", "ids")

    def __init__(self, head: Request, ids: array.array[int]) -> None:
        self.head = head
        self.ids = ids

    @classmethod
    def of(cls, request: Request) -> Parsed:
        """A whole request in this form."""
        return cls(attrs.evolve(request, token_ids=()), array.array("I", request.token_ids))

    def request(self) -> Request:
        """The whole request."""
        return attrs.evolve(self.head, token_ids=tuple(self.ids))

    def __reduce__(self) -> tuple[Any, ...]:  # the ids travel as bytes (a pickled array is the same, slower)
        return _parsed, (self.head, self.ids.tobytes())


def _parsed(head: Request, raw: bytes) -> Parsed:
    ids = array.array("I")
    ids.frombytes(raw)
    return Parsed(head, ids)


def with_tokens(data: Any, ids: array.array[int], where: str = "") -> Request:
    """The request `data` describes (checked as a JSON request is) with `ids` as its token ids."""
    return attrs.evolve(head(data, where), token_ids=tuple(ids))


def head(data: Any, where: str = "") -> Request:
    """The request `data` describes, checked as a JSON request is, with no token ids (they travel apart)."""
    at = f"{where}." if where else ""
    if not isinstance(data, dict):
        raise ApiError(400, f"{where or 'body'}: expected a JSON object")
    if "token_ids" in data:
        raise ApiError(400, f"{at}token_ids: given in the JSON part; in {CONTENT_TYPE} the ids follow it",
                       [(f"{at}token_ids", "must not be in the JSON part")])  # fmt: skip
    try:
        empty: Request = from_dict(Request, {**data, "token_ids": []})
    except ContractError as exc:
        problems = [(f"{at}{p}" if p != "<root>" else (where or p), m) for p, m in exc.problems]
        raise ApiError(400, f"invalid {exc.contract}", problems) from None
    return empty
