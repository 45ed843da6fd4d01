"""Issue 29: keys are `{prefix}:{tenant}:{keyed name}`. A SCAN of the server reveals no slot or block key; a key
renamed to another slot's name or another tenant's prefix, or named by raw slot (an older version), is never
served; stores and kernels with the same secret share keys, another secret finds none."""

import pytest
from _tier_redis_helpers import NAME_KEY, SECRET, describe, make_request, payload, slot

from nexuskv import ConfigError, Kernel, KernelConfig, StateSeal, store_name

OTHER_SECRET = bytes(range(1, 33))
OTHER_KEY = StateSeal(OTHER_SECRET).name_key


def _keys(redis_server, prefix) -> list[bytes]:
    client = redis_server.client()
    try:
        return sorted(client.scan_iter(match=f"{prefix}:*"))
    finally:
        client.close()


def _leaks(keys, slots) -> list[bytes]:
    secrets = {x.encode() for s in slots for x in (s.hex(), s[:-1].hex())}
    return [k for k in keys for x in secrets if x in k.lower()]


def _fill(store, n=4, tenant="acme"):
    held = {}
    for i in range(n):
        data = payload(100 + i)
        assert store.put(slot(i), data, describe(slot(i), data, tenant=tenant))
        held[slot(i)] = data
    return held


def test_a_scan_of_the_server_reveals_no_slot_or_block_key(store, redis_server, prefix):
    held = _fill(store)
    data = payload(10)
    assert store.put(slot(9, group=1), data, describe(slot(9, group=1), data, tenant="globex"))
    keys = _keys(redis_server, prefix)
    assert len(keys) == 5 and _leaks(keys, [*held, slot(9, group=1)]) == []
    assert keys == sorted([f"{prefix}:acme:{store_name(NAME_KEY, s)}".encode() for s in held]
                          + [f"{prefix}:globex:{store_name(NAME_KEY, slot(9, group=1))}".encode()])  # fmt: skip


def test_a_key_renamed_to_another_slots_name_is_never_served(make_store, redis_server):
    store = make_store()
    held = _fill(store, 3)
    client = redis_server.client()
    client.rename(store.key_of(slot(0), "acme"), store.key_of(slot(1), "acme"))  # slot 0's state under slot 1's key
    assert store.get(slot(1)) is None and slot(1) not in store  # found out on the read, dropped from the server
    assert store.get(slot(0)) is None
    client.copy(store.key_of(slot(2), "acme"), store.key_of(slot(5), "acme"))  # and a copy, read back by a restart
    client.close()
    again = make_store()
    assert sorted(again.slots()) == [slot(2)] and again.misnamed == 1
    assert bytes(again.get(slot(2)).payload) == held[slot(2)] and again.get(slot(5)) is None


def test_a_key_moved_to_another_tenants_prefix_is_never_served(make_store, redis_server):
    store = make_store()
    _fill(store, 2, tenant="a")
    client = redis_server.client()
    client.rename(store.key_of(slot(0), "a"), store.key_of(slot(0), "b"))  # a's state, under tenant b's prefix
    client.close()
    again = make_store()
    assert sorted(again.slots()) == [slot(1)] and again.misnamed == 1
    assert again.for_tenant("b").get(slot(0)) is None and again.get(slot(0)) is None


def test_a_key_under_its_raw_slot_name_from_before_is_skipped_cleanly(make_store, redis_server, prefix):
    store = make_store()
    held = _fill(store, 2)
    client = redis_server.client()
    old = f"{prefix}:acme:{slot(0).hex()}".encode()
    client.rename(store.key_of(slot(0), "acme"), old)  # exactly what the older version wrote for slot 0
    client.hset(f"{prefix}:acme:zz-not-a-name".encode(), b"m", b"{}")
    client.close()
    again = make_store()
    assert sorted(again.slots()) == [slot(1)] and again.misnamed == 1 and again.get(slot(0)) is None
    assert bytes(again.get(slot(1)).payload) == held[slot(1)]
    assert old in _keys(redis_server, prefix)  # skipped, not deleted: the server is shared
    data = payload(100)
    assert again.put(slot(0), data, describe(slot(0), data))  # stored again, under its keyed name
    assert bytes(again.get(slot(0)).payload) == data


def test_the_same_key_finds_every_key_again_and_another_key_finds_none(make_store):
    held = _fill(make_store(), 4)
    same = make_store()
    assert {s: bytes(same.get(s).payload) for s in same.slots()} == held
    other = make_store(name_key=OTHER_KEY)
    assert len(other) == 0 and other.misnamed == 4
    assert all(other.get(s) is None for s in held)


def test_a_store_without_a_name_key_names_nothing_and_reads_nothing(make_store):
    _fill(make_store(), 2)
    bare = make_store(name_key=None)
    assert len(bare) == 0  # the server is not read until the store has a key
    data = payload(10)
    for call in (lambda: bare.put(slot(0), data, describe(slot(0), data)), lambda: bare.get(slot(0)),
                 lambda: bare.delete(slot(0)), lambda: bare.key_of(slot(0), "acme")):  # fmt: skip
        with pytest.raises(ConfigError, match="no name key"):
            call()
    bare.use_name_key(NAME_KEY)
    assert len(bare) == 2
    bare.use_name_key(NAME_KEY)
    with pytest.raises(ConfigError, match="cannot change"):
        bare.use_name_key(OTHER_KEY)


def test_a_kernel_under_another_secret_indexes_none_of_the_servers_keys(redis_server, prefix, make_store):
    cfg = KernelConfig(node="n1", tiers={"redis": {"store": "redis", "url": redis_server.url, "prefix": prefix,
                                                   "capacity_bytes": "64MiB"}})  # fmt: skip
    req = make_request(range(64))
    with Kernel(cfg, secret=SECRET) as k:
        keys = k.keys(req)
        for b in range(len(keys)):
            assert k.put(k.describe(req, b, b"kv" * 100, tier="redis", keys=keys), b"kv" * 100)
    assert _leaks(_keys(redis_server, prefix), [key + b"\0" for key in keys]) == []
    with Kernel(cfg, secret=OTHER_SECRET) as other:
        assert other.match(req).longest() == 0 and other.tiers["redis"].misnamed == len(keys)
    with Kernel(cfg, secret=SECRET) as same:
        assert same.match(req).longest() == len(keys)
