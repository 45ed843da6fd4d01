"""Redis tier put/get against plain redis-py SET/GET of the same bytes on the same server, timed interleaved.

`run()` starts its own redis-server (127.0.0.1, free port, no persistence), measures, stops it and returns one
dict per payload size; `bench/tiers.py` turns them into RESULT lines.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from typing import Any

from _common import interleaved, named, tier_descriptor
from nexuskv_tier_redis import RedisStore
from nexuskv_tier_redis.client import make_client
from nexuskv_tier_redis.testing import RedisServer

__all__ = ["run"]


def run(sizes: Iterable[int] = (1 << 20, 16 << 20), repeats: int = 7) -> list[dict[str, Any]]:
    """Medians (seconds) of the tier's put / get and of plain SET / GET, per payload size.

    Both sides use one client configuration (the tier's own client factory: redis-py, same timeouts, same
    parser, same server); the tier stores in 4 MiB
    chunks in one MULTI/EXEC and reads back with one HMGET, the baseline is one SET / GET of the whole value.
    """
    out: list[dict[str, Any]] = []
    with RedisServer() as server:
        store = named(RedisStore(url=server.url, prefix="bench" + uuid.uuid4().hex[:8], capacity_bytes=1 << 30))
        # The baseline gets the very client the tier makes (same timeouts, same parser: hiredis on both sides
        # when it is installed), so only what the tier does differs.
        plain = make_client(server.url, store.connect_timeout_s, store.read_timeout_s)
        try:
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
                out.append({"tier": "redis", "size": size, **times})
                store.delete(slot)
                plain.delete(plain_key)
        finally:
            plain.close()
            store.close()
    return out
