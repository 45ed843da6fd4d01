"""Differential: `nexuskv_vllm_events` reads exactly what vLLM's own encoder writes, and its test publisher
writes exactly those bytes."""

from __future__ import annotations

import msgspec
from nexuskv_vllm_events.testing import encode_batch
from nexuskv_vllm_events.testing import removed as our_removed
from nexuskv_vllm_events.testing import stored as our_stored
from nexuskv_vllm_events.wire import BlockRemoved, BlockStored, decode
from vllm.distributed.kv_events import AllBlocksCleared as VAllCleared
from vllm.distributed.kv_events import BlockRemoved as VRemoved
from vllm.distributed.kv_events import BlockStored as VStored
from vllm.distributed.kv_events import KVEventBatch


def vllm_events():
    return [
        VStored(block_hashes=[b"a" * 32, b"b" * 32], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                lora_id=None, medium="GPU", lora_name=None, extra_keys=[("salt",), None], group_idx=0),
        VStored(block_hashes=[b"c" * 32], parent_block_hash=b"b" * 32, token_ids=[9, 9, 9, 9], block_size=4,
                lora_id=None, medium="GPU", lora_name=None, group_idx=0),
        VRemoved(block_hashes=[b"a" * 32], medium="GPU", group_idx=0),
        VAllCleared(),
    ]  # fmt: skip


def test_vllms_encoding_decodes_field_for_field():
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=3.5, events=vllm_events(), data_parallel_rank=0))
    batch = decode(payload)
    assert batch.ts == 3.5 and [type(e).__name__ for e in batch.events] == [
        "BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]  # fmt: skip
    first, second, third, _ = batch.events
    assert isinstance(first, BlockStored) and first.extra_keys == [("salt",), None] and first.parent_block_hash is None
    assert second.parent_block_hash == b"b" * 32 and second.token_ids == [9, 9, 9, 9]
    assert isinstance(third, BlockRemoved) and third.block_hashes == [b"a" * 32]


def test_the_test_publisher_writes_vllms_bytes():
    ours = encode_batch([our_stored([b"a" * 32, b"b" * 32], None, list(range(8)), 4, salt="salt"),
                         our_stored([b"c" * 32], b"b" * 32, [9, 9, 9, 9], 4), our_removed([b"a" * 32])],
                        ts=3.5, dp_rank=0)  # fmt: skip
    theirs = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=3.5, events=vllm_events()[:3], data_parallel_rank=0))
    assert ours == theirs
