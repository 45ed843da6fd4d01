"""Builtin local transport: reads a slot from a store in the same process, without copying."""

from __future__ import annotations

from nexuskv import StoredState, TierStore, hookimpl

__all__ = ["LocalTransport"]


class LocalTransport:
    """In-process transport: the store's own `get`, zero-copy where the store is."""

    name = "local"

    def fetch(self, store: TierStore, slot: bytes) -> StoredState | None:
        """Read one slot directly from `store`."""
        return store.get(slot)

    def close(self) -> None:
        """Nothing to release."""


@hookimpl
def nexuskv_register_transports(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the in-process transport as `local`."""
    register("local", LocalTransport)
