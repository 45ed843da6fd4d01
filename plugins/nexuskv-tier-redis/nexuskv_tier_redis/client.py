"""The Redis client the tier and the cluster index use: fail-fast timeouts, and where it points."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def make_client(url: str, connect_timeout_s: float, read_timeout_s: float, **extra: Any) -> redis.Redis:
    """A client that fails fast: bounded connect and read, one immediate retry on a dropped connection only.

    The single retry lets a pooled connection that died with the server (a restart) reconnect at once; a server
    that is down refuses that reconnect too, and a timeout is never retried (it would double the wait).
    """
    retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
    return redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=read_timeout_s,
                                retry=retry, health_check_interval=0, socket_keepalive=True,
                                **extra)  # fmt: skip


def where(client: redis.Redis) -> str:
    """host:port (or socket path) of a client, for messages; never the password."""
    kw = client.connection_pool.connection_kwargs
    return str(kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}")
