"""Entry point of the Redis tier: registers `RedisStore` as the tier store `redis`."""

from __future__ import annotations

from nexuskv import hookimpl
from nexuskv_tier_redis.store import RedisStore

__all__ = ["nexuskv_register_tier_stores"]


@hookimpl
def nexuskv_register_tier_stores(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the Redis tier as `redis`."""
    register("redis", RedisStore)
