"""Block keys and the capacity-bounded block tiers of the simulator (the `BlockTier` protocol, an LRU tier).

A block key is `(model, tenant, hash_id)`: hash ids of a Mooncake trace are already prefix hashes, so the model
(and the tenant: tenants never share) completes the identity. A trace without tenants has tenant "default"
everywhere, so its keys are effectively `(model, hash_id)`. `block_keys` is the one place keys are made.

Tiers account capacity in bytes, because the dram and disk of a host are shared by engines of models whose
blocks differ in size; for one model, capacity in blocks is `capacity_bytes // block bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol, runtime_checkable

from attrs import define

from nexuskv_sim.api import SimRequest

__all__ = ["BlockKey", "BlockMeta", "BlockTier", "LRUTier", "block_keys"]

BlockKey = tuple[str, str, int]


def block_keys(req: SimRequest) -> tuple[BlockKey, ...]:
    """The keys of `req`'s blocks, in order."""
    m, t = req.model, req.tenant
    return tuple((m, t, h) for h in req.hash_ids)


@define(frozen=True)
class BlockMeta:
    """Facts about a stored block an eviction policy may use (no simulator timing: that is ground truth)."""

    model: str
    tenant: str
    hash_id: int
    position: int  # block index in the request that stored it
    tokens: int
    nbytes: int
    parent: int | None = None  # hash id of the block this one continues (None for a first block)


@runtime_checkable
class BlockTier(Protocol):
    """A capacity-bounded set of blocks with its own eviction policy."""

    name: str
    capacity_bytes: int

    @property
    def used_bytes(self) -> int:
        """Bytes held."""
        ...

    def contains(self, key: Hashable) -> bool:
        """Whether `key` is held (no side effect)."""
        ...

    def touch(self, key: Hashable) -> None:
        """Record a hit on a held key."""
        ...

    def insert(self, key: Hashable, meta: BlockMeta) -> list[Hashable]:
        """Store `key` (a held key is written again: made most recent), evicting as needed; return the evicted keys."""
        ...

    def __len__(self) -> int:
        """Blocks held."""
        ...


class LRUTier:
    """Least-recently-used eviction by bytes (what vLLM's and SGLang's prefix caches and LMCache do)."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self._blocks: OrderedDict[Hashable, int] = OrderedDict()
        self._used = 0

    @property
    def used_bytes(self) -> int:
        """Bytes held."""
        return self._used

    def contains(self, key: Hashable) -> bool:
        """Whether `key` is held."""
        return key in self._blocks

    def touch(self, key: Hashable) -> None:
        """Make `key` the most recently used."""
        if key in self._blocks:
            self._blocks.move_to_end(key)

    def insert(self, key: Hashable, meta: BlockMeta) -> list[Hashable]:
        """Store `key` as most recently used; evict least recently used blocks until it fits."""
        blocks = self._blocks
        if key in blocks:
            blocks.move_to_end(key)
            return []
        if meta.nbytes > self.capacity_bytes:
            return []  # never fits: not stored
        evicted: list[Hashable] = []
        while self._used + meta.nbytes > self.capacity_bytes:
            old, nb = blocks.popitem(last=False)
            self._used -= nb
            evicted.append(old)
        blocks[key] = meta.nbytes
        self._used += meta.nbytes
        return evicted

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def keys(self) -> list[Hashable]:
        """Held keys, least recently used first."""
        return list(self._blocks)
