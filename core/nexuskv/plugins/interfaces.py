"""The protocols plugins implement: tier stores, transports and control planes (matchers: `nexuskv.state.index`).

Stores are addressed by *slot*: the 16-byte block key followed by one byte naming the layout group, so every
group of a hybrid model's block has its own payload. These protocols use the contracts only.

A store that names payloads in a place others can list (files, shm segments, Redis keys, Mooncake objects) never
names them by slot: it names them `store_name(name_key, slot)`, a keyed hash under the deployment's name key, which
the kernel hands it through `use_name_key(key)` before anything is stored, read or listed (a `shared = True` store
without that method is refused). Its listing reads each payload's descriptor and keeps only what `slot_named` says
is stored under its own name.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

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
    "slot_named",
    "slot_of",
    "store_name",
]


def slot_of(key: bytes, group: int = 0) -> bytes:
    """The store slot of a block key and layout group (key bytes + one group byte)."""
    if not 0 <= group < 256:
        raise ValueError(f"group must be in [0, 256), got {group}")
    return key + bytes((group,))


_NAME_PERSON = b"nexuskv.slotname"


def store_name(name_key: bytes, slot: bytes) -> str:
    """The name of `slot` in a shared store: 32 hex digits of a keyed BLAKE2b of the slot under `name_key`.

    `name_key` is the deployment's name key (`StateSeal.name_key`, a derivation of the secret the kernel hands every
    store through `use_name_key`). A listing of the store (`ls /dev/shm`, `SCAN`, a directory) then reveals no
    slot and no block key, and nobody without the secret can name a slot: not to ask for it, not to plant under it.

    16 bytes, not 20: a name only has to be unguessable and unique among the names one store holds. Keyed BLAKE2b
    is a PRF, so a guess hits a given slot's name with probability 2^-128, and a store of 2^40 payloads (a
    petabyte of 1 KiB blocks) holds two slots under one name with probability below 2^-48; and such a collision
    serves nothing wrong (the payload's descriptor says whose slot it is, `slot_named` checks it, and the kernel
    checks the key and the MAC): one payload is lost and recomputed. Four more bytes would buy nothing a store
    could use and lengthen every name and key. Raises ValueError for a key shorter than 16 bytes.
    """
    h = _keyed_hash(bytes(name_key)).copy()
    h.update(slot)
    return h.hexdigest()


@functools.lru_cache(maxsize=16)
def _keyed_hash(name_key: bytes) -> Any:
    """BLAKE2b keyed with `name_key`, nothing hashed yet: copied per name (half the cost of keying it each time)."""
    if not 16 <= len(name_key) <= 64:
        raise ValueError(f"a name key is 16 to 64 bytes (StateSeal.name_key), got {len(name_key)}")
    return hashlib.blake2b(digest_size=16, key=name_key, person=_NAME_PERSON)


def slot_named(name_key: bytes, name: str, descriptor: StateDescriptor) -> bytes | None:
    """The slot `descriptor` was stored at, if `name` is `store_name(name_key, slot)` of it; else None.

    What a store's listing (its re-index) keeps: the slot comes from the descriptor stored with the payload, never
    from the name. None for a payload planted, renamed or copied under a name that is not its slot's, stored under
    another secret, or named by raw slot (written before names were keyed).
    """
    try:
        slot = slot_of(bytes.fromhex(descriptor.key), descriptor.group)
    except ValueError:
        return None
    expected = store_name(name_key, slot).encode()
    return slot if hmac.compare_digest(expected, name.encode("utf-8", "surrogateescape")) else None


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
