"""The shared-memory transport: reads a slot of a host-wide shm tier by mapping its segment, without copying."""

from __future__ import annotations

from nexuskv import StoredState, TierStore, get_logger
from nexuskv_transport_shm.segments import MapCache
from nexuskv_transport_shm.store import ShmStore

__all__ = ["ShmTransport"]

log = get_logger(__name__)


class ShmTransport:
    """Moves payloads written by any process of the host to this one through POSIX shared memory.

    From a `ShmStore` it returns a read-only memoryview over a read-only mapping of the segment (zero copy; the
    view keeps the mapping alive, even after the segment is unlinked). Mappings of unchanged segments are reused
    (`cache_entries` / `cache_bytes`), so a hot segment is not re-mapped or re-faulted; `populate` pre-faults a
    fresh mapping (MAP_POPULATE) for readers about to touch all of it. Liveness of the writer's lease and the
    payload's TTL are checked on every fetch, cached mapping or not. Other stores are in this process: read
    with their own `get`, as the `local` transport does.
    """

    name = "shm"

    def __init__(self, cache_entries: int = 256, cache_bytes: int = 4 << 30, populate: bool = False) -> None:
        self._cache = MapCache(cache_entries, cache_bytes)
        self.populate = populate

    def fetch(self, store: TierStore, slot: bytes) -> StoredState | None:
        """Read one slot: mapped from shared memory for a `ShmStore`, the store's own `get` otherwise."""
        if isinstance(store, ShmStore):
            return store.read(slot, self._cache, self.populate)
        return store.get(slot)

    def mapped(self) -> int:
        """How many segment mappings the transport holds for reuse."""
        return len(self._cache)

    def close(self) -> None:
        """Drop cached mappings (views already handed out stay valid)."""
        self._cache.clear()
