"""Entry point of the Mooncake plugin: the tier store `mooncake`."""

from __future__ import annotations

from nexuskv import hookimpl
from nexuskv_tier_mooncake.store import MooncakeStore

__all__ = ["nexuskv_register_tier_stores"]


@hookimpl
def nexuskv_register_tier_stores(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the Mooncake Store tier as `mooncake`."""
    register("mooncake", MooncakeStore)
