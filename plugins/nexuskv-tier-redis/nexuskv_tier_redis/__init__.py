"""NexusKV tier store in a Redis server (`store = "redis"` in a kernel's `[tiers.<name>]`)."""

from __future__ import annotations

from nexuskv_tier_redis.store import RedisStore, RedisTierError, TenantView

__all__ = ["RedisStore", "RedisTierError", "TenantView"]
