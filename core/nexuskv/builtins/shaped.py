"""A tier behind an emulated network link: DRAM storage, reads paced to a bandwidth and latency.

It stands in for a remote tier reached over a slow or congested network (what `tc netem` would do to a real
one), so demos, engine connectors and benchmarks can show what a cost-blind cache does when moving state is slower than
recomputing it. Writes are not paced: state lands there by placement, and the question is whether to read it.
"""

from __future__ import annotations

import time
from typing import Any

from nexuskv import EvictionCallback, PluginManager, StateDescriptor, StoredState, hookimpl

__all__ = ["ShapedLinkStore"]


class ShapedLinkStore:
    """A DRAM tier whose `get` takes `latency_ms + nbytes / bandwidth_bytes_per_s`, like a remote read would."""

    def __init__(self, name: str = "remote", capacity_bytes: int = 1 << 30, bandwidth_bytes_per_s: float = 50e6,
                 latency_ms: float = 1.0) -> None:  # fmt: skip
        if bandwidth_bytes_per_s <= 0 or latency_ms < 0:
            raise ValueError("bandwidth_bytes_per_s must be positive and latency_ms not negative")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
        self.latency_ms = float(latency_ms)
        dram = PluginManager({}, entry_points=False).tier_stores()["dram"]
        self._inner = dram(capacity_bytes=capacity_bytes, name=name)

    @property
    def floor(self) -> float:
        """The inner DRAM store's aging floor (cost-aware eviction)."""
        return float(self._inner.floor)

    def put(self, slot: bytes, payload: bytes | memoryview, descriptor: StateDescriptor, priority: float = 0.0,
            ttl_s: float | None = None) -> bool:  # fmt: skip
        """Store (not paced)."""
        return bool(self._inner.put(slot, payload, descriptor, priority, ttl_s))

    def get(self, slot: bytes) -> StoredState | None:
        """Read, paced to the link: the caller waits as it would for the bytes to arrive."""
        got = self._inner.get(slot)
        time.sleep((self.latency_ms / 1e3) + (len(got.payload) if got is not None else 0) / self.bandwidth_bytes_per_s)
        return got

    def delete(self, slot: bytes) -> bool:
        """Drop a payload."""
        return bool(self._inner.delete(slot))

    def __contains__(self, slot: object) -> bool:
        return slot in self._inner

    def slots(self) -> Any:
        """Every slot held."""
        return self._inner.slots()

    def used_bytes(self) -> int:
        """Bytes held."""
        return int(self._inner.used_bytes())

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Evictions of the inner store are reported as this tier's."""
        self._inner.set_eviction_callback(callback)

    def close(self) -> None:
        """Drop everything."""
        self._inner.close()



@hookimpl
def nexuskv_register_tier_stores(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the emulated slow link as `shaped-link` (fault injection for demos, tests and benchmarks)."""
    register("shaped-link", ShapedLinkStore)
