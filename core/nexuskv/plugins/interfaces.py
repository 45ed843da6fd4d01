"""The protocols plugins implement: tier stores, transports and control planes (matchers: `nexuskv.state.index`).

Stores are addressed by *slot*: the 16-byte block key followed by one byte naming the layout group, so every
group of a hybrid model's block has its own payload. These protocols use the contracts only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from attrs import define

from nexuskv.contracts import StateDescriptor

__all__ = [
    "ControlPlane",
    "EvictionCallback",
    "Lease",
    "PersistentTierStore",
    "StoredState",
    "TierStore",
    "Transport",
    "slot_of",
]


def slot_of(key: bytes, group: int = 0) -> bytes:
    """The store slot of a block key and layout group (key bytes + one group byte)."""
    if not 0 <= group < 256:
        raise ValueError(f"group must be in [0, 256), got {group}")
    return key + bytes((group,))


@define(frozen=True)
class StoredState:
    """A payload read back from a tier, with the descriptor it was stored under."""

    payload: memoryview | bytes
    descriptor: StateDescriptor


EvictionCallback = Callable[[bytes, StateDescriptor, "bytes | memoryview | None"], None]
"""Called with (slot, descriptor, payload) after a store dropped a payload to make room.

`payload` is the dropped bytes when the store still has them at hand (so the kernel can demote them to a lower
tier), else None.
"""


@runtime_checkable
class TierStore(Protocol):
    """A place payloads live: DRAM, disk, a remote server. Bounded in bytes; evicts by priority."""

    name: str
    capacity_bytes: int

    def put(
        self,
        slot: bytes,
        payload: bytes | memoryview,
        descriptor: StateDescriptor,
        priority: float = 0.0,
        ttl_s: float | None = None,
    ) -> bool:
        """Store a payload; False when it cannot fit. May evict lower-priority payloads first.

        `ttl_s` (from the tenant's `place` rule) bounds how long the payload may be served; None means no limit.
        A payload that expires is reported through the eviction callback like an eviction (payload None).
        """

    def get(self, slot: bytes) -> StoredState | None:
        """Read a payload back, or None on a miss."""

    def delete(self, slot: bytes) -> bool:
        """Drop a payload; True if it was there."""

    def __contains__(self, slot: object) -> bool:
        """True if the slot is held."""

    def slots(self) -> Iterable[bytes]:
        """Every slot held."""

    def used_bytes(self) -> int:
        """Bytes held now."""

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Be told about every eviction (the kernel keeps its index exact with it)."""

    def close(self) -> None:
        """Release resources."""


@runtime_checkable
class PersistentTierStore(TierStore, Protocol):
    """A tier whose payloads outlive the process (disk, a remote server): the kernel re-indexes it at start."""

    def descriptors(self) -> Iterable[tuple[bytes, StateDescriptor]]:
        """(slot, descriptor) of every payload held, from the store's own metadata (no payload reads)."""


@runtime_checkable
class Transport(Protocol):
    """Moves payloads from a store (possibly on another node or process) to the caller."""

    name: str

    def fetch(self, store: TierStore, slot: bytes) -> StoredState | None:
        """Read one slot through this transport; None on a miss."""

    def close(self) -> None:
        """Release resources."""


@define(frozen=True)
class Lease:
    """A time-bounded grant: whatever is attached to it dies when it expires or is revoked."""

    lease_id: int
    ttl_s: float


@runtime_checkable
class ControlPlane(Protocol):
    """Membership, leases and monotonic epochs (fencing tokens) for the nodes of a deployment."""

    def epoch(self) -> int:
        """The current cluster epoch (never decreases)."""

    def bump_epoch(self) -> int:
        """Advance the epoch and return the new value."""

    def grant(self, ttl_s: float) -> Lease:
        """Create a lease that expires `ttl_s` seconds after its last keepalive."""

    def keepalive(self, lease_id: int) -> bool:
        """Renew a lease; False if it has already expired or been revoked."""

    def revoke(self, lease_id: int) -> None:
        """End a lease now."""

    def alive(self, lease_id: int) -> bool:
        """True while the lease is valid."""

    def join(self, node: str, lease_id: int) -> int:
        """Register `node` under a lease; return its fencing epoch (greater than any earlier one)."""

    def members(self) -> Mapping[str, int]:
        """Live nodes and their epochs."""

    def close(self) -> None:
        """Release resources."""
