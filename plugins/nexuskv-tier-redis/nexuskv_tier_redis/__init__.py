"""NexusKV on Redis: a tier store (`store = "redis"` in `[tiers.<name>]`) and the cluster-wide index (`[matcher]`)."""

from __future__ import annotations

from nexuskv_tier_redis.index import ClusterIndex
from nexuskv_tier_redis.store import RedisStore, RedisTierError, TenantView

__all__ = ["ClusterIndex", "RedisStore", "RedisTierError", "TenantView"]
