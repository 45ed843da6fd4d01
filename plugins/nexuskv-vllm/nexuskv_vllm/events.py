"""NexusKV's stored and removed blocks as vLLM KV cache events, for routers that read vLLM's event stream.

vLLM publishes what each engine's GPU cache holds (`BlockStored` / `BlockRemoved`, msgpack over ZMQ, with
`kv_events_config`); llm-d's KV cache manager and Dynamo's KV router consume that stream. The connector's
`take_events` adds NexusKV's tiers to it: a block the workers report stored becomes a `BlockStored` whose
`medium` is the tier (upper-cased, as vLLM writes `GPU` / `CPU`), and a block they report lost a `BlockRemoved`
of the same medium. `block_hashes` are NexusKV's block keys: keyed with the deployment's secret, so an event
consumer learns which blocks exist and how they chain, not what they hold. Token ids are left out unless the
connector is configured with `events_token_ids = true` (then a consumer that hashes tokens itself can match them;
every tenant's prompt text then reaches the event stream). Bounded: at most `limit` blocks remembered between
being saved and being reported, at most `limit` events waiting to be taken (the oldest are dropped, and counted).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from nexuskv import Request

__all__ = ["Events"]


class Events:
    """The connector's pending KV events; thread-safe."""

    def __init__(self, *, token_ids: bool = False, limit: int = 65536) -> None:
        self.token_ids = token_ids
        self.limit = limit
        self._lock = threading.Lock()
        self._saving: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...], int, str | None]] = OrderedDict()
        self._where: dict[bytes, str] = {}  # key -> medium it was reported stored in (for its BlockRemoved)
        self._pending: list[Any] = []
        self.dropped = 0

    def saving(self, keys: Sequence[bytes], blocks: Sequence[int], tokens: Sequence[int], block_size: int,
               request: Request) -> None:  # fmt: skip
        """Blocks about to be saved: remember their parent, tokens and adapter until a worker reports them."""
        lora = request.model.adapter.name if request.model.adapter is not None else None
        with self._lock:
            for b in blocks:
                toks = tuple(tokens[b * block_size:(b + 1) * block_size]) if self.token_ids else ()
                self._saving[keys[b]] = (keys[b - 1] if b else None, toks, block_size, lora)
                self._saving.move_to_end(keys[b])
            while len(self._saving) > self.limit:
                self._saving.popitem(last=False)

    def reported(self, stored: Mapping[bytes, tuple[str, str, int]], removed: set[bytes]) -> None:
        """The workers' report: queue one `BlockStored` per newly stored block, one `BlockRemoved` per lost one."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        out: list[Any] = []
        with self._lock:
            for key, (tier, _node, _epoch) in stored.items():
                parent, toks, size, lora = self._saving.pop(key, (None, (), 0, None))
                medium = tier.upper()
                self._where[key] = medium
                out.append(BlockStored(block_hashes=[key], parent_block_hash=parent, token_ids=list(toks),
                                       block_size=size, lora_id=None, medium=medium, lora_name=lora))  # fmt: skip
            for key in removed:
                medium = self._where.pop(key, None)
                if medium is not None:
                    out.append(BlockRemoved(block_hashes=[key], medium=medium))
            while len(self._where) > self.limit:
                self._where.pop(next(iter(self._where)))
            self._pending.extend(out)
            if len(self._pending) > self.limit:
                self.dropped += len(self._pending) - self.limit
                del self._pending[: len(self._pending) - self.limit]

    def take(self) -> list[Any]:
        """Every event queued since the last call (vLLM publishes them with its own)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out
