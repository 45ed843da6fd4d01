"""What one engine's own KV cache holds, kept in a kernel's index as `RESIDENT_TIER` locations of its node.

vLLM names a cached block by its own hash; NexusKV routes by its keys. A `BlockStored` carries the blocks' tokens
and the hash of the block before them, so each block's NexusKV key is one chain step from its parent's
(`BlockKeyer.extend`): the first blocks of a prompt start at the root of their namespace, found from the block's
`cache_salt` (the gateway's salt names the tenant and scope, `namespaces` maps salts to namespaces), and every
later block continues its parent's key. A block this cannot key exactly is not indexed, and counted:

- `unattributed`: a salt no namespace is configured for, a LoRA adapter, multimodal or prompt-embedding extras
  (their NexusKV keys mix inputs the event does not carry), another block size, or a shape that does not add up
  (token ids not one block per hash: an offloading connector's placeholder);
- `orphaned`: a parent this engine's stream never showed (the subscriber started late, or it was forgotten);
- `other_medium` / `other_group`: blocks not in the engine's GPU cache (an offloading connector's, NexusKV's own
  tiers') or not in KV cache group 0 (hybrid models: group 0 is the full-attention group routes are priced on).

Bounded: at most `max_blocks` vLLM hashes remembered; the oldest is forgotten, and its index location removed with
it (a block this cannot hear removed must not stay claimed). Thread-safe: one lock around each batch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from nexuskv import RESIDENT_TIER, ConfigError, Kernel, Layout, Location, ModelIdentity, Namespace, TokenizerIdentity
from nexuskv_vllm_events.wire import AllBlocksCleared, Batch, BlockHash, BlockRemoved, BlockStored

__all__ = ["COUNTS", "EngineResidency"]

COUNTS = ("batches", "stored", "removed", "cleared", "forgotten", "unattributed", "orphaned", "other_medium",
          "other_group")  # fmt: skip
"""The counters `EngineResidency.stats` reports (blocks, except `batches` and `cleared`)."""

GPU_MEDIA = (None, "GPU")  # vLLM's own cache (older vLLM leaves `medium` empty)


class EngineResidency:
    """One engine's prefix cache as index locations `Location(RESIDENT_TIER, node, epoch)`."""

    def __init__(self, kernel: Kernel, *, node: str, model: ModelIdentity, tokenizer: TokenizerIdentity,
                 layout: Layout, namespaces: Mapping[str, Namespace], epoch: int = 0,
                 max_blocks: int = 1 << 20) -> None:  # fmt: skip
        """`namespaces` maps a vLLM `cache_salt` ("" for requests without one) to the namespace its blocks are in.

        `model`, `tokenizer` and `layout` are the identity the engine's requests are keyed with, exactly as the
        router's requests for this engine carry it (else the keys differ and nothing matches).
        """
        if not node:
            raise ConfigError("EngineResidency: node must be the engine's node name")
        if len(layout.groups) != 1 or layout.groups[0].kind not in ("dense", "latent"):
            raise ConfigError("EngineResidency: one dense or latent state group only (hybrid and recurrent layouts: "
                              f"KV cache groups beyond 0 are not followed), got {[g.kind for g in layout.groups]}")
        if layout.page_size != kernel.keyer.page_size:
            raise ConfigError(f"EngineResidency: layout page_size {layout.page_size} is not the kernel's "
                              f"{kernel.keyer.page_size}")  # fmt: skip
        if max_blocks < 1:
            raise ConfigError(f"EngineResidency: max_blocks must be >= 1, got {max_blocks}")
        self.node = node
        self.location = Location(RESIDENT_TIER, node, epoch)
        self.page_size = layout.page_size
        self.max_blocks = max_blocks
        self._index = kernel.index
        self._keyer = kernel.keyer
        self._roots = {salt: kernel.keyer.root(ns, model, tokenizer, layout) for salt, ns in namespaces.items()}
        # vLLM hash -> (NexusKV key, tokens up to the end of the block, held now); oldest first
        self._blocks: OrderedDict[BlockHash, tuple[bytes, int, bool]] = OrderedDict()
        self._held = 0
        self._counts = dict.fromkeys(COUNTS, 0)
        self._lock = threading.Lock()

    def apply(self, batch: Batch) -> None:
        """Apply one batch's events in order."""
        with self._lock:
            self._counts["batches"] += 1
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self._clear()
                    self._counts["cleared"] += 1
                elif event.group_idx not in (None, 0):
                    self._counts["other_group"] += len(event.block_hashes)
                elif (event.medium.upper() if event.medium else None) not in GPU_MEDIA:
                    self._counts["other_medium"] += len(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._removed(event)
                else:
                    self._stored(event)

    def clear(self) -> None:
        """Forget everything the engine was said to hold (its stream broke, restarted, or stopped)."""
        with self._lock:
            self._clear()

    def stats(self) -> dict[str, int]:
        """The counters (`COUNTS`), and `held`: blocks indexed as in the engine's cache now."""
        with self._lock:
            return {**self._counts, "held": self._held}

    def _stored(self, event: BlockStored) -> None:
        page = self.page_size
        n = len(event.block_hashes)
        extras = event.extra_keys or [None] * n
        if (event.block_size != page or event.lora_name is not None or event.lora_id is not None
                or len(event.token_ids) != n * page or len(extras) != n):  # fmt: skip
            self._counts["unattributed"] += n  # another block size, an adapter, or a shape this cannot key
            return
        if event.parent_block_hash is None:
            salt = _salt(extras[0])
            parent = self._roots.get(salt) if salt is not None else None
            if parent is None:
                self._counts["unattributed"] += n
                return
            offset, first = 0, 1
        else:
            known = self._blocks.get(event.parent_block_hash)
            if known is None:
                self._counts["orphaned"] += n
                return
            parent, offset, _ = known
            first = 0
        usable = next((i for i in range(first, n) if extras[i]), n)  # later extras: mm or embeddings, not keyable
        self._counts["unattributed"] += n - usable
        keys = self._keyer.extend(parent, event.token_ids[: usable * page], offset=offset)
        for i, (vllm_hash, key) in enumerate(zip(event.block_hashes[:usable], keys, strict=True)):
            old = self._blocks.pop(vllm_hash, None)
            if old is not None and old[2]:
                self._held -= 1
                if old[0] != key:  # the hash named another block: that claim ends (never left unbounded)
                    self._index.remove(old[0], self.location)
            self._held += 1
            self._blocks[vllm_hash] = (key, offset + (i + 1) * page, True)
        # every key, held before or not: an index that dropped this node's locations (a cluster index resyncing
        # a peer) gets them back with the next event that names them
        claimed = [self._blocks[h][0] for h in dict.fromkeys(event.block_hashes[:usable])]  # a hash's last key
        self._index.insert_many(claimed, self.location)
        self._counts["stored"] += usable
        while len(self._blocks) > self.max_blocks:
            _, (key, _, held) = self._blocks.popitem(last=False)
            self._counts["forgotten"] += 1
            if held:
                self._index.remove(key, self.location)
                self._held -= 1

    def _removed(self, event: BlockRemoved) -> None:
        for vllm_hash in event.block_hashes:
            known = self._blocks.get(vllm_hash)
            if known is None or not known[2]:
                continue  # never indexed (unattributed, orphaned) or already gone
            key, tokens, _ = known
            self._index.remove(key, self.location)
            self._blocks[vllm_hash] = (key, tokens, False)  # kept: a later block may still name it as parent
            self._held -= 1
            self._counts["removed"] += 1

    def _clear(self) -> None:
        self._index.drop_location(self.location)
        self._blocks.clear()
        self._held = 0


def _salt(extra: Any) -> str | None:
    """The cache salt of a prompt's first block from its extra keys; None when they hold anything else."""
    if not extra:
        return ""
    if len(extra) == 1 and isinstance(extra[0], str):
        return extra[0]
    return None
