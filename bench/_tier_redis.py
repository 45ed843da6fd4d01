"""Redis tier put/get against plain redis-py SET/GET of the same bytes on the same server, timed interleaved.

`run()` starts its own redis-server (127.0.0.1, free port, no persistence), measures, stops it and returns one
dict per payload size, each saying which reply parser each side used (`parsers`); `bench/tiers.py` turns them into
RESULT lines, and only when both sides parse with hiredis (`hiredis_on_both`): redis-py's pure-Python parser reads
one large reply much more slowly than hiredis (a 16 MiB GET took about twice as long here), so a baseline without
it is one no production setup runs (`redis[hiredis]` is the tier plugin's dependency).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import redis
from redis.utils import HIREDIS_AVAILABLE

from _common import interleaved, named, tier_descriptor
from nexuskv_tier_redis import RedisStore
from nexuskv_tier_redis.client import make_client
from nexuskv_tier_redis.testing import RedisServer

__all__ = ["HIREDIS_AVAILABLE", "hiredis_on_both", "hiredis_version", "parser_of", "run"]

HIREDIS_PARSER = "_HiredisParser"
"""The class name of redis-py's hiredis-backed reply parser (`redis._parsers.hiredis`), on redis-py 5 to 8."""


def hiredis_version() -> str | None:
    """The installed hiredis's version, or None (redis-py uses only 3.2 and later: see `HIREDIS_AVAILABLE`)."""
    try:
        import hiredis
    except ImportError:
        return None
    return str(hiredis.__version__)


def parser_of(client: redis.Redis) -> str:
    """The reply parser and command packer a pooled connection of `client` uses, e.g. `_HiredisParser` (packer ...).

    Read from a live connection rather than from `HIREDIS_AVAILABLE`: a `parser_class` passed to the client, or
    a redis-py that refuses the installed hiredis, would make the two differ.
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        # Private attributes, but the only place redis-py keeps what a connection actually parses with.
        parser = type(getattr(conn, "_parser", None)).__name__
        packer = type(getattr(conn, "_command_packer", None)).__name__
    finally:
        pool.release(conn)
    return f"{parser} (packer {packer})"


def hiredis_on_both(parsers: Mapping[str, str]) -> bool:
    """Whether every side of `parsers` (as `run()` reports them) parses replies with hiredis."""
    return HIREDIS_AVAILABLE and all(p.startswith(HIREDIS_PARSER + " ") for p in parsers.values())


def run(sizes: Iterable[int] = (1 << 20, 16 << 20), repeats: int = 7) -> list[dict[str, Any]]:
    """Medians (seconds) of the tier's put / get and of plain SET / GET, per payload size.

    Both sides use one client configuration (the tier's own client factory: redis-py, same timeouts, same
    parser, same server); the tier stores in 4 MiB chunks in one MULTI/EXEC and reads back with one HMGET, the
    baseline is one SET / GET of the whole value. Each row's `parsers` names the parser of each side's client.
    """
    out: list[dict[str, Any]] = []
    with RedisServer() as server:
        store = named(RedisStore(url=server.url, prefix="bench" + uuid.uuid4().hex[:8], capacity_bytes=1 << 30))
        # The baseline gets the very client the tier makes (same timeouts, same parser), so only what the tier
        # does differs.
        plain = make_client(server.url, store.connect_timeout_s, store.read_timeout_s)
        try:
            # The tier's own client (private: the store keeps it to itself), not a new one made alike.
            parsers = {"tier": parser_of(store._client), "plain": parser_of(plain)}
            for size in sizes:
                data = os.urandom(size)
                key = os.urandom(16)
                slot = key + b"\x00"
                desc = tier_descriptor(key, data, "redis")
                plain_key = b"plain:" + key.hex().encode()

                def get(slot: bytes = slot, size: int = size) -> None:
                    got = store.get(slot)
                    assert got is not None and len(got.payload) == size

                def base_get(k: bytes = plain_key, size: int = size) -> None:
                    got = plain.get(k)
                    assert got is not None and len(got) == size  # type: ignore[arg-type]

                times = interleaved({
                    "put_s": lambda s=slot, d=data, ds=desc: store.put(s, d, ds),
                    "base_put_s": lambda k=plain_key, d=data: plain.set(k, d),
                    "get_s": get,
                    "base_get_s": base_get,
                }, repeats, inner=1)  # fmt: skip
                out.append({"tier": "redis", "size": size, "parsers": parsers, **times})
                store.delete(slot)
                plain.delete(plain_key)
        finally:
            plain.close()
            store.close()
    return out
