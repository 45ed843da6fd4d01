"""The wire decoder: vLLM's batches decode; anything else is a WireError naming the problem, never another error."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nexuskv_vllm_events.testing import Publisher, encode_batch, removed, stored
from nexuskv_vllm_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, WireError, decode, seq_of


def test_a_batch_as_vllm_encodes_it_decodes_with_every_field_read():
    payload = encode_batch([stored([b"h" * 32, 7], None, list(range(8)), 4, salt="s"), removed([b"h" * 32]),
                            AllBlocksCleared()], ts=12.5, dp_rank=1)  # fmt: skip
    batch = decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 1
    first, second, third = batch.events
    assert isinstance(first, BlockStored) and first.block_hashes == [b"h" * 32, 7] and first.block_size == 4
    assert first.extra_keys == [("s",), None] and first.medium == "GPU" and first.group_idx == 0
    assert isinstance(second, BlockRemoved) and isinstance(third, AllBlocksCleared)


def test_nesting_too_deep_for_the_decoder_is_a_wire_error():
    """extra_keys hold any values: 100,000 nested arrays there exhaust the decoder's recursion, a WireError."""
    head = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                          "token_ids": [1], "block_size": 1, "extra_keys": [[None]]}]])
    assert head.endswith(b"\x91\x91\xc0")
    with pytest.raises(WireError, match="nested too deeply"):
        decode(head[:-1] + b"\x91" * 100_000 + b"\xc0")


def test_shapes_are_the_residencys_to_judge():
    """Skipped sliding-window blocks and offloading placeholders decode (the residency filters and counts them)."""
    batch = decode(encode_batch([stored([b"h"], None, [1, 2, 3], 2), stored([b"h"], None, [], 0, medium="CPU")]))
    assert [len(e.token_ids) for e in batch.events] == [3, 0]


def test_fields_a_newer_vllm_adds_are_ignored():
    raw = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU",
                                         "future_field": {"x": 1}}]])  # fmt: skip
    assert decode(raw).events[0].block_hashes == [1]


@pytest.mark.parametrize(("payload", "message"), [
    (msgspec.msgpack.encode([1.0, [{"type": "BlockEvicted", "block_hashes": []}]]), "BlockEvicted"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]), "block_hashes"),
    (msgspec.msgpack.encode({"ts": 1.0}), "array"),
    (encode_batch([stored([b"h"], None, [1, -2], 2)]), "Expected `int` >= 0"),
    (encode_batch([stored([b"h"], None, [1, 1 << 32], 2)]), "Expected `int` <= 4294967295"),
    (encode_batch([stored([b"h" * 65], None, [1], 1)]), "65 bytes"),
    (encode_batch([stored([b""], None, [1], 1)]), "0 bytes"),
    (b"\xc1", "not a vLLM KV event batch"),
])  # fmt: skip
def test_what_is_not_a_batch_says_why(payload, message):
    with pytest.raises(WireError, match=message):
        decode(payload)


@given(st.binary(max_size=256))
def test_arbitrary_bytes_are_a_batch_or_a_wire_error(data):
    with contextlib.suppress(WireError):
        decode(data)


@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8) |
                    st.binary(max_size=40) | st.floats(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                max_size=4), max_leaves=20))
def test_arbitrary_msgpack_is_a_batch_or_a_wire_error(value):
    with contextlib.suppress(WireError):
        decode(msgspec.msgpack.encode(value))


def test_sequence_frames():
    assert seq_of((5).to_bytes(8, "big")) == 5 and seq_of(b"\xff" * 8) == -1
    with pytest.raises(WireError, match="4 bytes"):
        seq_of(b"\x00" * 4)


def test_the_kv_events_command_prints_each_batch_and_marks_gaps():
    d = tempfile.mkdtemp(prefix="kvcli", dir="/tmp")
    endpoint = f"ipc://{d}/pub"
    try:
        with Publisher(endpoint) as pub:
            cli = str(Path(sys.executable).with_name("nexuskv"))
            proc = subprocess.Popen([cli, "kv-events", "--endpoint", endpoint, "--count", "3", "--seconds", "60"],
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
            stop = threading.Event()

            def publish() -> None:  # until the command is listening, batches are lost (ZMQ's slow joiner)
                while not stop.is_set() and proc.poll() is None:
                    pub.publish([stored([b"h" * 32], None, [1, 2], 2, salt="s")])
                    pub.publish([], send=False)  # a gap every time
                    time.sleep(0.05)

            feeder = threading.Thread(target=publish)
            feeder.start()
            out, _ = proc.communicate(timeout=60)
            stop.set()
            feeder.join()
        lines = [json.loads(line) for line in out.splitlines()]
        assert proc.returncode == 0 and len(lines) == 3
        assert lines[0]["events"] == [{"type": "BlockStored", "blocks": 1, "medium": "GPU", "group": 0, "root": True,
                                       "lora": None}]  # fmt: skip
        assert {line["position"] for line in lines[1:]} == {"gap"}
    finally:
        shutil.rmtree(d, ignore_errors=True)
