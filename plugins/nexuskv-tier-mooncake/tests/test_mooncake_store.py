"""The Mooncake tier on a real mooncake_master: round trips, Mooncake's put and lease semantics, eviction, a kernel."""

import threading
import time

from _tier_mooncake_helpers import describe, eventually, kernel_from_config, make_request, payload, slot

from nexuskv import PlanAction, TierStore, checksum
from nexuskv_tier_mooncake import MooncakeStore


def test_the_store_is_a_tier_store(store):
    assert isinstance(store, TierStore) and store.shared is True
    assert store.name == "mooncake" and store.capacity_bytes == 64 << 20


def test_round_trip_of_real_payloads_up_to_16_mib(store, raw_client):
    sizes = [1, 4096, 1 << 20, 16 << 20]
    datas = {slot(i): payload(n) for i, n in enumerate(sizes)}
    for s, d in datas.items():
        assert store.put(s, d, describe(s, d))
    assert set(store.slots()) == set(datas) and all(s in store for s in datas)
    assert store.used_bytes() >= sum(sizes) and len(store) == 4
    for s, d in datas.items():
        got = store.get(s)
        assert isinstance(got.payload, memoryview) and got.payload.format == "B"  # a view of Mooncake's buffer
        assert got.payload == d and got.descriptor == describe(s, d)
        assert checksum(got.payload) == got.descriptor.checksum
        del got
    big = slot(3)
    assert raw_client.is_exist(store.key_of(big)) == 1
    assert raw_client.get_size(store.key_of(big)) > 16 << 20  # the descriptor travels with the payload
    assert store.get(slot(99)) is None  # never stored: a miss, not an error


def test_a_slot_stored_by_another_client_is_read_in_place(make_store):
    writer, reader = make_store(), make_store()
    d = payload(5000)
    assert writer.put(slot(1), d, describe(slot(1), d, node="n2"))
    got = reader.get(slot(1))  # the tier is shared: another node's object, with its descriptor
    assert bytes(got.payload) == d and got.descriptor.placement.node == "n2"
    assert slot(1) not in reader  # ... but not this store's to account or evict


def test_put_of_an_existing_key_keeps_the_first_object_and_succeeds(make_store):
    first, second = make_store(), make_store()
    d = payload(10_000)
    assert first.put(slot(1), d, describe(slot(1), d, node="n1"))
    assert first.put(slot(1), d, describe(slot(1), d, node="n1"))  # again, same store: still one object
    assert first.used_bytes() < 2 * len(d) and len(first) == 1
    assert second.put(slot(1), d, describe(slot(1), d, node="n2"))  # Mooncake: object already exists -> success
    got = second.get(slot(1))
    assert bytes(got.payload) == d
    assert got.descriptor.placement.node == "n1"  # the stored object is the first writer's, descriptor included


def test_delete_under_a_read_lease_is_queued_until_the_lease_ends(store, raw_client):
    d = payload(1 << 20)
    s = slot(7)
    key = store.key_of(s)
    assert store.put(s, d, describe(s, d))
    got = store.get(s)  # the read takes a lease on the object
    assert bytes(got.payload) == d
    assert raw_client.remove(key) == -706  # Mooncake itself: OBJECT_HAS_LEASE
    assert store.delete(s) is True
    assert s not in store and store.get(s) is None and store.pending_removals == 1
    assert store.used_bytes() >= len(d)  # still in Mooncake: still counted
    assert raw_client.is_exist(key) == 1
    assert not store.put(s, d, describe(s, d))  # not stored again while its removal waits
    assert eventually(lambda: store.flush_removals() == 0)  # the lease ran out: removed
    assert raw_client.is_exist(key) == 0 and store.used_bytes() == 0
    assert bytes(got.payload) == d  # the reader's view stayed valid throughout (Mooncake's buffer, not freed)
    assert store.put(s, d, describe(s, d)) and bytes(store.get(s).payload) == d
    assert store.delete(slot(8)) is False  # never held


def test_capacity_evicts_lowest_priority_and_removes_it_from_mooncake(make_store, raw_client):
    store = make_store(capacity_bytes=(3 << 20) + 8192)  # three payloads and their headers
    evicted = []
    store.set_eviction_callback(lambda s, desc, data: evicted.append((s, desc.key, data)))
    d = payload(1 << 20)
    for i, prio in ((1, 5.0), (2, 1.0), (3, 3.0)):
        assert store.put(slot(i), d, describe(slot(i), d), priority=prio)
    assert store.put(slot(4), d, describe(slot(4), d), priority=4.0)  # 4 MiB with headers: one must go
    assert evicted == [(slot(2), slot(2)[:-1].hex(), None)]
    assert slot(2) not in store and raw_client.is_exist(store.key_of(slot(2))) == 0
    assert store.used_bytes() <= store.capacity_bytes and store.evictions == 1 and store.floor == 1.0
    assert not store.put(slot(5), d, describe(slot(5), d), priority=0.5)  # below everything held: refused
    assert not store.put(slot(6), payload(4 << 20), describe(slot(6), b"x"))  # larger than the capacity


def test_an_object_gone_behind_the_store_is_a_reported_miss(store, raw_client):
    evicted = []
    store.set_eviction_callback(lambda s, desc, data: evicted.append(s))
    d = payload(2048)
    for i in (1, 2):
        assert store.put(slot(i), d, describe(slot(i), d))
    assert raw_client.remove(store.key_of(slot(1)), True) == 0  # as Mooncake's own eviction would
    assert store.get(slot(1)) is None and evicted == [slot(1)] and slot(1) not in store
    assert raw_client.remove(store.key_of(slot(2)), True) == 0
    assert store.sync() == 1 and evicted == [slot(1), slot(2)] and len(store) == 0 and store.used_bytes() == 0


def test_exhausted_local_buffer_falls_back_to_one_copy(make_store):
    store = make_store(local_buffer_bytes=20 << 20)
    d = payload(16 << 20)
    assert store.put(slot(1), d, describe(slot(1), d))
    first = store.get(slot(1))  # holds 16 MiB of the 20 MiB local buffer
    second = store.get(slot(1))  # no room left there: read into the scratch buffer, copied out
    assert bytes(first.payload) == d and bytes(second.payload) == d
    del first
    assert bytes(store.get(slot(1)).payload) == d


def test_concurrent_readers_and_a_writer_see_only_whole_payloads(make_store):
    store = make_store(capacity_bytes=32 << 20)
    datas = {slot(i): payload(256 << 10) for i in range(16)}
    for s, d in datas.items():
        assert store.put(s, d, describe(s, d))
    errors: list[str] = []

    def read(k: int) -> None:
        for r in range(40):
            s = slot((k + r) % 16)
            got = store.get(s)
            if got is None or got.payload != datas[s] or got.descriptor.key != s[:-1].hex():
                errors.append(f"reader {k} round {r}: wrong payload for {s.hex()}")

    def write() -> None:
        for i in range(16, 40):
            d = payload(256 << 10)
            if not store.put(slot(i), d, describe(slot(i), d), priority=-1.0):  # never evicts the readers' slots
                errors.append(f"put {i} refused")

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)] + [threading.Thread(target=write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(s in store for s in datas) and store.used_bytes() <= store.capacity_bytes


def test_ttl_expiry_is_reported_and_removes_the_object(store, raw_client):
    evicted = []
    store.set_eviction_callback(lambda s, desc, data: evicted.append(s))
    d = payload(100)
    assert store.put(slot(1), d, describe(slot(1), d), ttl_s=0.05)
    assert not store.put(slot(2), d, describe(slot(2), d), ttl_s=0)
    time.sleep(0.1)
    assert store.get(slot(1)) is None and evicted == [slot(1)]
    assert eventually(lambda: store.flush_removals() == 0) and raw_client.is_exist(store.key_of(slot(1))) == 0


def test_bad_options_are_precise_errors(mooncake_master):
    for kw, fragment in (({"master": "nohost"}, "master must be 'host:port'"),
                         ({"capacity_bytes": 0}, "capacity_bytes must be positive"),
                         ({"prefix": "a/b"}, "prefix must be non-empty")):  # fmt: skip
        try:
            MooncakeStore(**{"master": mooncake_master.address, **kw})
        except ValueError as exc:
            assert fragment in str(exc)
        else:
            raise AssertionError(f"{kw} accepted")


def put_blocks(k, req, n_bytes=4096) -> list[bytes]:
    keys = k.keys(req)
    for b in range(len(keys)):
        data = bytes([b]) * n_bytes
        assert k.put(k.describe(req, b, data, tier="mc", keys=keys), data)
    return keys


def test_a_kernel_from_config_plans_and_materializes_from_mooncake(tmp_path, mooncake_master, prefix):
    req = make_request(range(160))
    with kernel_from_config(tmp_path, mooncake_master.address, prefix) as k:
        assert isinstance(k.tiers["mc"], MooncakeStore) and k.tiers["mc"].capacity_bytes == 64 << 20
        keys = put_blocks(k, req, 1 << 20)
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.MATERIALIZE and {s.tier for s in plan.spans} == {"mc"}
        assert plan.tokens_reused == 160
        got = k.materialize(plan, req, keys=keys)
        assert got.complete and len(got.states) == 10
        for (b, _g), st in got.states.items():  # checksum-verified by the kernel on the way
            assert bytes(st.payload) == bytes([b]) * (1 << 20) and st.descriptor.checksum == checksum(st.payload)


def test_a_corrupt_object_is_quarantined_despite_the_read_lease(tmp_path, mooncake_master, prefix, raw_client):
    req = make_request(range(64))
    with kernel_from_config(tmp_path, mooncake_master.address, prefix) as k:
        store = k.tiers["mc"]
        keys = put_blocks(k, req)
        key = store.key_of(keys[2] + b"\x00")
        stored = bytearray(raw_client.get(key))
        stored[-1] ^= 0xFF  # one payload byte flipped; header (and its checksum) intact
        assert eventually(lambda: raw_client.remove(key, True) == 0)
        assert raw_client.put(key, bytes(stored)) == 0
        got = k.materialize(k.plan(req, keys=keys), req, keys=keys)
        assert got.tokens == 32 and "block 2" in got.reason  # blocks 0-1 restored; recompute from block 2 on
        assert keys[2] + b"\x00" not in store and store.pending_removals == 1  # the read's lease delays removal
        assert k.plan(req, keys=keys).tokens_reused == 32
        assert eventually(lambda: store.flush_removals() == 0) and raw_client.is_exist(key) == 0
