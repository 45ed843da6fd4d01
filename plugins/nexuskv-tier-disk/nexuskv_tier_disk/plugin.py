"""Entry point of the `nexuskv-tier-disk` distribution: offers `DiskStore` to the kernel as the `disk` tier store."""

from __future__ import annotations

from nexuskv import hookimpl
from nexuskv_tier_disk.store import DiskStore


@hookimpl
def nexuskv_register_tier_stores(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the disk tier as `disk`."""
    register("disk", DiskStore)
