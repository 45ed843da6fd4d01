"""Entry point of the Redis plugin: the tier store `redis`, and the cluster-wide index (`[matcher] name = "redis"`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexuskv import ConfigError, hookimpl
from nexuskv_tier_redis.index import ClusterIndex
from nexuskv_tier_redis.store import RedisStore

__all__ = ["nexuskv_matcher", "nexuskv_register_tier_stores"]


@hookimpl
def nexuskv_register_tier_stores(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the Redis tier as `redis`."""
    register("redis", RedisStore)


@hookimpl
def nexuskv_matcher(config: Mapping[str, Any]) -> ClusterIndex | None:
    """The cluster-wide index in Redis when `[matcher] name = "redis"` (options: url, prefix, timeout_s, ...)."""
    if config.get("name") != "redis":
        return None
    options = {k: v for k, v in config.items() if k != "name"}
    try:
        return ClusterIndex(**options)
    except TypeError as exc:
        raise ConfigError(f"[matcher] (redis): {exc}") from None
