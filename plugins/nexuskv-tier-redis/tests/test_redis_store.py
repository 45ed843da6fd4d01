import time

import pytest
from _tier_redis_helpers import SECRET, describe, make_request, payload, slot

from nexuskv import Kernel, KernelConfig, PersistentTierStore, PluginManager, TierStore
from nexuskv_tier_redis import RedisStore


def test_protocols_and_plugin_registration(store):
    assert isinstance(store, TierStore) and isinstance(store, PersistentTierStore)
    assert PluginManager().tier_stores()["redis"] is RedisStore


def test_the_tier_parses_replies_with_hiredis(store):
    """`redis[hiredis]` is the plugin's dependency: production parses with hiredis, and bench/tiers.py compares
    the tier with a plain GET only when both do (redis-py's Python parser is much slower on large replies)."""
    from redis.utils import HIREDIS_AVAILABLE

    assert HIREDIS_AVAILABLE, "hiredis missing or too old for redis-py: reinstall the plugin (`redis[hiredis]`)"
    pool = store._client.connection_pool
    conn = pool.get_connection()
    try:
        assert type(conn._parser).__name__ == "_HiredisParser"
    finally:
        pool.release(conn)


@pytest.mark.parametrize("size", [0, 1, 1000, 4 << 20, 9 << 20])
def test_roundtrip_small_and_chunked(make_store, redis_server, size):
    store = make_store(chunk_bytes=4 << 20)
    data = payload(size)
    s = slot(1)
    d = describe(s, data)
    assert store.put(s, data, d)
    got = store.get(s)
    assert bytes(got.payload) == data and got.descriptor == d
    assert s in store and list(store.slots()) == [s] and store.used_bytes() == size
    fields = redis_server.client().hkeys(store.key_of(s, "acme"))
    assert len(fields) == 2 + -(-size // (4 << 20))  # metadata, token, one field per 4 MiB chunk


def test_overwrite_with_fewer_chunks_leaves_nothing_behind(make_store, redis_server):
    store = make_store(chunk_bytes=1000)
    s = slot(2)
    big, small = payload(5000), payload(10)
    store.put(s, big, describe(s, big))
    store.put(s, small, describe(s, small))
    assert bytes(store.get(s).payload) == small and store.used_bytes() == 10
    assert len(redis_server.client().hkeys(store.key_of(s, "acme"))) == 3


def test_memoryview_payload_and_delete(store, redis_server):
    data = payload(3000)
    s = slot(3)
    assert store.put(s, memoryview(data), describe(s, data))
    assert store.delete(s) and not store.delete(s)
    assert store.get(s) is None and s not in store and store.used_bytes() == 0
    assert not redis_server.client().exists(store.key_of(s, "acme"))


def test_ttl_expires_on_the_server_and_is_reported(make_store, redis_server):
    seen = []
    store = make_store()
    store.set_eviction_callback(lambda s, d, p: seen.append((s, d.key, p)))
    a, b = slot(4), slot(5)
    data = payload(100)
    assert store.put(a, data, describe(a, data), ttl_s=0.5)
    assert store.put(b, data, describe(b, data))
    assert 0 < redis_server.client().pttl(store.key_of(a, "acme")) <= 500
    assert redis_server.client().ttl(store.key_of(b, "acme")) == -1
    assert store.get(a) is not None
    time.sleep(0.6)
    assert store.get(a) is None
    assert seen == [(a, a[:-1].hex(), None)] and a not in store and store.used_bytes() == 100
    assert not redis_server.client().exists(store.key_of(a, "acme"))


def test_default_ttl(make_store, redis_server):
    store = make_store(default_ttl_s=30)
    data = payload(10)
    store.put(slot(6), data, describe(slot(6), data))
    assert 0 < redis_server.client().ttl(store.key_of(slot(6), "acme")) <= 30


def test_key_gone_behind_the_stores_back_is_a_miss_and_reported(store, redis_server):
    seen = []
    store.set_eviction_callback(lambda s, d, p: seen.append(s))
    data = payload(100)
    s = slot(7)
    store.put(s, data, describe(s, data))
    redis_server.client().delete(store.key_of(s, "acme"))  # evicted by maxmemory, flushed, ...
    assert store.get(s) is None
    assert seen == [s] and s not in store and store.used_bytes() == 0


def test_rewritten_by_another_writer_is_read_back_fresh(make_store):
    one, two = make_store(), make_store()
    s = slot(8)
    a, b = payload(100), payload(200)
    one.put(s, a, describe(s, a))
    two.put(s, b, describe(s, b))
    got = one.get(s)
    assert bytes(got.payload) == b and got.descriptor.nbytes == 200 and one.used_bytes() == 200


def test_priority_eviction_lru_among_equals_and_refusal(make_store, redis_server):
    seen = []
    store = make_store(capacity_bytes=3000)
    store.set_eviction_callback(lambda s, d, p: seen.append((s, p)))
    data = payload(1000)
    for i, prio in ((1, 1.0), (2, 2.0), (3, 2.0)):
        assert store.put(slot(i), data, describe(slot(i), data), priority=prio)
    assert store.put(slot(4), data, describe(slot(4), data), priority=2.5)
    assert seen == [(slot(1), None)] and store.floor == 1.0
    assert not redis_server.client().exists(store.key_of(slot(1), "acme"))
    store.get(slot(2))  # slot 3 is now the least recently used of the equals
    assert store.put(slot(5), data, describe(slot(5), data), priority=2.0)
    assert seen[-1] == (slot(3), None) and store.floor == 2.0
    assert not store.put(slot(6), data, describe(slot(6), data), priority=0.5)  # only more valuable state held
    assert not store.put(slot(7), payload(3001), describe(slot(7), data), priority=9.0)  # larger than the tier
    assert sorted(store.slots()) == [slot(2), slot(4), slot(5)] and store.used_bytes() == 3000
    assert store.evictions == 2


def test_restart_reindexes_from_the_server(make_store, redis_server):
    first = make_store()
    held = {}
    for i in range(5):
        data = payload(100 + i)
        d = describe(slot(i), data, tenant="acme" if i % 2 else "globex")
        first.put(slot(i), data, d, priority=float(i), ttl_s=60 if i == 3 else None)
        held[slot(i)] = (data, d)
    first.close()
    again = make_store()
    assert dict(again.descriptors()) == {s: d for s, (_, d) in held.items()}
    assert again.used_bytes() == first.used_bytes() and len(again) == 5
    for s, (data, _) in held.items():
        assert bytes(again.get(s).payload) == data


def test_kernel_reindexes_a_persistent_redis_tier_at_start(redis_server, prefix, make_store):
    # make_store: its teardown removes the prefix's keys
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"},
                                         "redis": {"store": "redis", "url": redis_server.url, "prefix": prefix,
                                                   "capacity_bytes": "64MiB"}})  # fmt: skip
    req = make_request(range(64))
    with Kernel(cfg, secret=SECRET) as k:
        keys = k.keys(req)
        for b in range(len(keys)):
            data = bytes([b]) * 512
            assert k.put(k.describe(req, b, data, tier="redis", keys=keys), data)
    with Kernel(cfg, secret=SECRET) as k:
        assert k.match(req).longest() == 4
        assert bytes(k.load(keys[2], tier="redis").payload) == bytes([2]) * 512


def test_bad_options():
    with pytest.raises(ValueError, match="capacity_bytes"):
        RedisStore(capacity_bytes=0)
    with pytest.raises(ValueError, match="prefix"):
        RedisStore(prefix="a:b")


def test_verify_crc_drops_bytes_changed_behind_the_stores_back(make_store, redis_server):
    seen = []
    store = make_store(verify_crc=True, chunk_bytes=100)
    store.set_eviction_callback(lambda s, d, p: seen.append(s))
    data = payload(250)
    s = slot(9)
    store.put(s, data, describe(s, data))
    assert bytes(store.get(s).payload) == data
    redis_server.client().hset(store.key_of(s, "acme"), b"1", bytes(100))  # same length, other bytes
    assert store.get(s) is None and seen == [s]
    assert not redis_server.client().exists(store.key_of(s, "acme"))


def test_a_chain_larger_than_the_store_keeps_its_prefix_whatever_the_priorities(make_store, prefix, redis_server):
    import itertools

    from nexuskv.testing import prefix_problems

    n = itertools.count()
    try:
        assert prefix_problems(lambda cap: make_store(capacity_bytes=cap, prefix=f"{prefix}x{next(n)}")) == []
    finally:
        client = redis_server.client()
        keys = list(client.scan_iter(match=f"{prefix}x*"))
        if keys:
            client.delete(*keys)
        client.close()
