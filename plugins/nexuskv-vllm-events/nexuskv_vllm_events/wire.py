"""vLLM's KV event wire format, decoded strictly: what one ZMQ message of an engine's event stream may hold.

vLLM (`vllm/distributed/kv_events.py`, 0.32) publishes each batch as three frames: the topic, the sequence number
(8 bytes, big-endian) and a msgpack payload. The payload is an array `[ts, events, data_parallel_rank?]`; each event
is a map tagged by `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). Fields this decoder does not know are
ignored (vLLM adds fields over time); a field of the wrong type, an unknown tag, a value out of range or nesting
too deep is a `WireError` naming what was wrong, and the whole batch is dropped: a half-read batch would change the
index in ways the stream never said.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["MAX_HASH_BYTES", "AllBlocksCleared", "Batch", "BlockRemoved", "BlockStored", "WireError", "decode",
           "seq_of"]  # fmt: skip

MAX_HASH_BYTES = 64
"""Longest block hash accepted (vLLM's are 32-byte SHA-256 digests, or 64-bit ints)."""

BlockHash = bytes | int
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]  # checked while decoding, at C speed


class WireError(ValueError):
    """A frame or payload that is not a vLLM KV event batch (the message says what and where)."""


class BlockStored(msgspec.Struct, tag=True, forbid_unknown_fields=False):
    """Blocks an engine cached: hashes in order, the hash of the block before them, their tokens."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, forbid_unknown_fields=False):
    """Blocks an engine evicted."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, forbid_unknown_fields=False):
    """The engine dropped its whole prefix cache (a reset)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True):
    """One published batch: when, and its events in order."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(Batch)


def decode(payload: bytes) -> Batch:
    """The batch in `payload`, checked: hashes of 1 to `MAX_HASH_BYTES` bytes, token ids in [0, 2**32).

    Shapes (tokens per hash, one extra-keys entry per hash) are the residency's to judge, after it has filtered
    the events it reads: vLLM leaves skipped sliding-window blocks out of `block_hashes` but not out of
    `token_ids`, and offloading connectors publish placeholder events.
    """
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a vLLM KV event batch: {exc}") from None
    except RecursionError:
        raise WireError("not a vLLM KV event batch: nested too deeply") from None
    for i, event in enumerate(batch.events):
        hashes = event.block_hashes if not isinstance(event, AllBlocksCleared) else ()
        for h in hashes:
            if isinstance(h, bytes) and not 0 < len(h) <= MAX_HASH_BYTES:
                raise WireError(f"event {i}: a block hash of {len(h)} bytes (1..{MAX_HASH_BYTES} accepted)")
    return batch


def seq_of(frame: bytes) -> int:
    """The sequence number frame (8 bytes, big-endian; vLLM's replay end marker is -1)."""
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes (8 expected)")
    return int.from_bytes(frame, "big", signed=True)
