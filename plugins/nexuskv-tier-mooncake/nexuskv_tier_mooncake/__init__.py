"""NexusKV on Mooncake Store: a tier store (`store = "mooncake"` in `[tiers.<name>]`)."""

from __future__ import annotations

from nexuskv_tier_mooncake._link import release_abandoned
from nexuskv_tier_mooncake.store import MooncakeStore, MooncakeTierError

__all__ = ["MooncakeStore", "MooncakeTierError", "release_abandoned"]
