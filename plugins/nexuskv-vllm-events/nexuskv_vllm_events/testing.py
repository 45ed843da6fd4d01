"""A publisher speaking vLLM's KV event protocol, for tests that inject faults (gaps, restarts, forged frames).

It encodes batches exactly as vLLM 0.32's `ZmqEventPublisher` does (the field order of vLLM's structs, tags by
class name, the batch as an array; `plugins/nexuskv-vllm/tests/test_vllm_kv_events_wire.py` checks the bytes against
vLLM's own encoder) and serves vLLM 0.32's replay frames from its buffer; `test_vllm_serve.py` follows a real server.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

__all__ = ["Publisher", "encode_batch", "removed", "stored"]


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def stored(hashes: list[Any], parent: Any, tokens: list[int], block_size: int, *, salt: str | None = None,
           medium: str | None = "GPU", group: int | None = 0, lora: str | None = None,
           extras: list[Any] | None = None) -> BlockStored:  # fmt: skip
    """A `BlockStored` as vLLM builds it (the salt in the first block's extra keys when `parent` is None)."""
    if extras is None and salt is not None:
        extras = [(salt,)] + [None] * (len(hashes) - 1)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                       lora_id=None, medium=medium, lora_name=lora, extra_keys=extras, group_idx=group)  # fmt: skip


def removed(hashes: list[Any], *, medium: str | None = "GPU", group: int | None = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def encode_batch(events: list[Any], ts: float | None = None, dp_rank: int | None = 0) -> bytes:
    """The payload vLLM publishes for `events`."""
    return _encoder.encode(_Batch(ts=time.time() if ts is None else ts, events=events, data_parallel_rank=dp_rank))


class Publisher:
    """PUB (bound) + replay ROUTER, numbering batches from 0 as vLLM does; `skip`, `restart` and `raw` inject faults."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000) -> None:  # fmt: skip
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_delay_s = 0.0  # a slow replay endpoint
        # vLLM 0.32 replays (topic, seq, payload); older vLLM (seq, payload); bytes: replay under another topic
        self.replay_topic: bool | bytes = True
        self._thread = None
        if replay_endpoint:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._thread.start()

    def publish(self, events: list[Any], *, send: bool = True) -> int:
        """Publish one batch (with `send=False` it is numbered and buffered, never sent live: a gap)."""
        payload = encode_batch(events)
        with self._lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def raw(self, frames: list[bytes]) -> None:
        """Send frames as they are (a forger, a corrupted stream)."""
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """The engine restarted: numbering starts at 0 again and the replay buffer is empty."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                client, _, start = router.recv_multipart()
                time.sleep(self.replay_delay_s)
                first = int.from_bytes(start, "big")
                with self._lock:
                    batches = [(s, p) for s, p in self.buffer if s >= first]
                end = (-1).to_bytes(8, "big", signed=True)
                for s, p in batches:  # vLLM 0.32's frames; before it, without the topic
                    topic = (self.topic if self.replay_topic is True else self.replay_topic,) if self.replay_topic \
                        else ()
                    router.send_multipart((client, b"", *topic, s.to_bytes(8, "big"), p))
                router.send_multipart((client, b"", *((b"",) if self.replay_topic else ()), end, b""))
        finally:
            router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.pub.close(0)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
