"""A simulated tier that evicts with NexusKV's own code: the kernel's DRAM store and its default priorities.

`KernelTier` implements the simulator's `BlockTier` on `nexuskv.builtins.dram.DramStore` (its priority heap,
`Frequency` (reads lift priorities, a ghost history remembers evicted blocks) and `Lineage` (a prefix is never
evicted while a continuation stays)), with every block's value from `CostModel.eviction_priority`, exactly what
the kernel's hierarchy gives a committed block (`Hierarchy.priority_for`). `eviction="lru"` is
the same store with every priority 0: least recently used first, so the two differ only in the policy.

Payloads are stand-ins scaled down by `scale` (a 64 MiB block is stored as 1 KiB of zeros, capacities alike):
the store accounts bytes, so the proportions between models with different block sizes are kept. Each model's
cost model is the one NexusKV measured for it (`calibrate.measured_profile`), never the simulator's profile.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping

import attrs

from nexuskv import CostModel, CostProfile, StateDescriptor, from_dict
from nexuskv.builtins.dram import DramStore
from nexuskv.testing import sample_state
from nexuskv_sim.tiers import BlockMeta

__all__ = ["KernelTier"]


def _slot(key: Hashable) -> bytes:
    return hashlib.blake2b(repr(key).encode(), digest_size=32).digest() + b"\0"


class KernelTier:
    """`BlockTier` on the kernel's DRAM store (see the module docstring)."""

    def __init__(self, name: str, capacity_bytes: int, profiles: Mapping[str, CostProfile], *,
                 eviction: str = "cost", block_tokens: int = 512, scale: int = 1 << 16,
                 count_reads: bool = True) -> None:  # fmt: skip
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self.eviction = eviction
        self.count_reads = count_reads  # False: as the kernel's disk, shm and Redis stores (priority, no reads)
        self._scale = scale
        self._block_tokens = block_tokens
        self._store = DramStore(max(1, self.capacity_bytes // scale), name=name)
        self._store.set_eviction_callback(self._evicted)
        self._costs = {m: CostModel(p) for m, p in profiles.items()}
        self._template = from_dict(StateDescriptor, sample_state())
        self._keys: dict[bytes, Hashable] = {}
        self._sizes: dict[bytes, int] = {}
        self._gone: list[Hashable] = []
        self._used = 0

    def _evicted(self, slot: bytes, descriptor: StateDescriptor, payload: object = None) -> None:
        key = self._keys.pop(slot, None)
        self._used -= self._sizes.pop(slot, 0)
        if key is not None:
            self._gone.append(key)

    @property
    def used_bytes(self) -> int:
        """Bytes held (unscaled)."""
        return self._used

    def contains(self, key: Hashable) -> bool:
        """Whether `key` is held."""
        return _slot(key) in self._store

    def touch(self, key: Hashable) -> None:
        """A read: the store counts the hit (recency, and frequency under the cost policy)."""
        self._store.get(_slot(key))

    def insert(self, key: Hashable, meta: BlockMeta) -> list[Hashable]:
        """Put the block with the kernel's default priority; return the blocks the store evicted for it.

        A block already held is put again, as the kernel's writer re-puts committed state (re-priced against
        today's floor, its reads kept; not counted as a read).
        """
        slot = _slot(key)
        parent = None
        if meta.parent is not None and isinstance(key, tuple):
            parent = _slot((*key[:-1], meta.parent))[:-1].hex()
        nbytes = max(1, meta.nbytes // self._scale)
        desc = attrs.evolve(self._template, key=slot[:-1].hex(), parent_key=parent, nbytes=nbytes)
        value = self._costs[meta.model].eviction_priority(self.eviction, 0.0, self._block_tokens,
                                                          tier=self.name.rpartition("/")[2])
        self._gone = []
        held = slot in self._keys
        if self.count_reads:
            ok = self._store.put(slot, bytes(desc.nbytes), desc, 0.0, value=value)
        else:  # the kernel's default priority, as given: the floor now plus the value
            ok = self._store.put(slot, bytes(desc.nbytes), desc, self._store.floor + value if value else 0.0)
        if ok and not held:
            self._keys[slot] = key
            self._sizes[slot] = meta.nbytes
            self._used += meta.nbytes
        return self._gone

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._store)
