"""Entry point of the shm plugin: registers the `shm` transport and the host-wide `shm` tier store."""

from __future__ import annotations

from nexuskv import hookimpl
from nexuskv_transport_shm.store import ShmStore
from nexuskv_transport_shm.transport import ShmTransport


@hookimpl
def nexuskv_register_tier_stores(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the host shared-memory tier as `shm`."""
    register("shm", ShmStore)


@hookimpl
def nexuskv_register_transports(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the shared-memory transport as `shm`."""
    register("shm", ShmTransport)
