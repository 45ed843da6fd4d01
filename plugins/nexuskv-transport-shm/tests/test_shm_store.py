import mmap
import os

import pytest
from _shm_peer import descriptor, keyed, seg, slot_n
from _shm_testing import SHM, ours
from _shm_testing import eventually as _eventually

from nexuskv import PersistentTierStore, PluginManager, TierStore, Transport
from nexuskv_transport_shm import ShmStore, ShmTransport, as_array, segments


def eventually(cond, timeout=5.0):
    return _eventually(cond, timeout)


@pytest.fixture
def store(ns):
    s = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=3600))
    yield s
    s.close()
    assert ours(ns) == []


def put(store, i, size=100, value=None, **kw):
    payload = bytes([i % 256 if value is None else value]) * size
    assert store.put(slot_n(i), payload, descriptor(slot_n(i), payload), **kw)
    return payload


def test_protocols_and_registration(store):
    assert isinstance(store, TierStore) and isinstance(store, PersistentTierStore)
    assert isinstance(ShmTransport(), Transport) and ShmTransport.name == "shm"
    pm = PluginManager()
    assert pm.transports()["shm"] is ShmTransport and pm.tier_stores()["shm"] is ShmStore
    assert not [pr for pr in pm.problems if pr.plugin == "shm"]


def test_roundtrip_slots_descriptors_delete(store, ns):
    p1, p2 = put(store, 1), put(store, 2, size=300)
    got = store.get(slot_n(1))
    assert bytes(got.payload) == p1 and got.descriptor == descriptor(slot_n(1), p1)
    assert slot_n(2) in store and slot_n(3) not in store and store.get(slot_n(3)) is None
    assert sorted(store.slots()) == [slot_n(1), slot_n(2)]
    assert dict(store.descriptors())[slot_n(2)] == descriptor(slot_n(2), p2)
    assert store.used_bytes() == 400 and len(store) == 2
    assert store.delete(slot_n(1)) and not store.delete(slot_n(1)) and store.get(slot_n(1)) is None
    assert store.used_bytes() == 300
    # one published segment per slot plus this store's lease record
    assert ours(ns) == sorted([seg(ns, slot_n(2)), segments.lease_name(ns, store.lease_id)])


def test_reader_view_is_zero_copy_over_the_segment(store, ns):
    put(store, 5, size=4096, value=1)
    got = ShmTransport().fetch(store, slot_n(5))
    view = got.payload
    assert isinstance(view, memoryview) and view.readonly and isinstance(view.obj, mmap.mmap)
    with pytest.raises(TypeError):
        view[0] = 9  # read-only mapping: a reader cannot scribble on shared state
    # The view *is* the segment: a byte changed in the segment file is seen through the view (no copy made).
    path = SHM / seg(ns, slot_n(5))
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as w:
        off = len(w) - 4096
        w[off + 7] = 42
        assert view[7] == 42
        w[off + 7] = 1
    arr = as_array(view, "uint8", (64, 64))
    assert arr.shape == (64, 64) and not arr.flags.writeable and arr.base is not None


def test_view_outlives_store_close_and_unlink(ns):
    s = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=3600))
    payload = put(s, 1, size=10_000)
    view = s.get(slot_n(1)).payload
    s.close()  # unlinks the segment and the lease
    assert ours(ns) == []
    assert bytes(view) == payload  # the mapping still holds the pages: no dangling memory, no torn read


def test_replacing_a_slot_never_changes_a_view_already_handed_out(store):
    t = ShmTransport()
    put(store, 1, size=5000, value=1)
    old = t.fetch(store, slot_n(1)).payload
    put(store, 1, size=7000, value=2)
    new = t.fetch(store, slot_n(1)).payload
    assert bytes(old) == b"\1" * 5000 and bytes(new) == b"\2" * 7000
    assert store.used_bytes() == 7000


def test_transport_reuses_mappings_until_the_segment_changes(store):
    t = ShmTransport()
    put(store, 1)
    a, b = t.fetch(store, slot_n(1)), t.fetch(store, slot_n(1))
    assert a.payload.obj is b.payload.obj and t.mapped() == 1
    put(store, 1, value=9)
    c = t.fetch(store, slot_n(1))
    assert c.payload.obj is not a.payload.obj and c.payload[0] == 9
    store.delete(slot_n(1))
    assert t.fetch(store, slot_n(1)) is None and t.mapped() == 0
    t.close()


def test_other_stores_go_through_their_own_get():
    from nexuskv.builtins.dram import DramStore

    d = DramStore(1000)
    d.put(slot_n(1), b"abc", descriptor(slot_n(1), b"abc"))
    assert bytes(ShmTransport().fetch(d, slot_n(1)).payload) == b"abc"


def test_capacity_evicts_own_lowest_priority_and_reports_the_payload(ns):
    s = keyed(ShmStore(1000, namespace=ns, lease_ttl_s=0.5, reap_interval_s=3600))
    seen = []
    s.set_eviction_callback(lambda slot, desc, data: seen.append((slot, desc.key, None if data is None else
                                                                  bytes(data))))  # fmt: skip
    put(s, 1, size=400, priority=1.0)
    put(s, 2, size=400, priority=5.0)
    put(s, 3, size=400, priority=3.0)  # evicts slot 1 (lowest)
    assert seen == [(slot_n(1), slot_n(1)[:-1].hex(), b"\1" * 400)]
    assert s.get(slot_n(1)) is None and s.used_bytes() == 800
    payload = b"x" * 400
    assert not s.put(slot_n(4), payload, descriptor(slot_n(4), payload), priority=0.5)  # would evict better state
    assert not s.put(slot_n(5), b"y" * 2000, descriptor(slot_n(5), b"y" * 2000))  # larger than the tier
    s.close()
    assert ours(ns) == []


def test_ttl_expiry_is_a_miss_and_reported(store, ns):
    seen = []
    store.set_eviction_callback(lambda slot, desc, data: seen.append((slot, data)))
    put(store, 1, ttl_s=0.05)
    put(store, 2)
    assert eventually(lambda: store.get(slot_n(1)) is None)
    assert seen == [(slot_n(1), None)]
    assert seg(ns, slot_n(1)) not in ours(ns)
    assert store.get(slot_n(2)) is not None


def test_a_live_peer_segment_with_the_same_checksum_is_not_rewritten(ns, store):
    other = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=3600))
    try:
        payload = put(other, 1, size=1000)
        ino = os.stat(SHM / seg(ns, slot_n(1))).st_ino
        assert store.put(slot_n(1), payload, descriptor(slot_n(1), payload))
        assert os.stat(SHM / seg(ns, slot_n(1))).st_ino == ino
        assert store.used_bytes() == 0 and other.used_bytes() == 1000
    finally:
        other.close()
    assert store.get(slot_n(1)) is None  # it died with its owner's lease


def test_torn_incomplete_or_damaged_segments_are_never_read(store, ns):
    put(store, 1, size=1000)
    good = (SHM / seg(ns, slot_n(1))).read_bytes()
    cases = {
        2: bytearray(good),  # flag "complete" not set (the header is written last)
        3: bytearray(good[:-10]),  # truncated payload
        4: bytearray(good),  # descriptor bytes changed after the CRC was taken
        5: bytearray(good),  # wrong magic
    }
    flags_at = 10
    cases[2][flags_at] = 0
    cases[4][segments.HEADER_SIZE + 5] ^= 0xFF
    cases[5][0:8] = b"NOTASHM!"
    for i, data in cases.items():
        (SHM / seg(ns, slot_n(i))).write_bytes(bytes(data))
        assert store.get(slot_n(i)) is None, i
        assert ShmTransport().fetch(store, slot_n(i)) is None, i
        assert slot_n(i) not in store
    assert sorted(store.slots()) == [slot_n(1)]
    # A write in progress lives under a temp name: readers never see it, it is not a slot.
    tmp = SHM / segments.temp_name(ns, store.lease_id)
    tmp.write_bytes(good[:500])
    assert sorted(store.slots()) == [slot_n(1)]
    tmp.unlink()
    for i in cases:
        (SHM / seg(ns, slot_n(i))).unlink()


def test_bad_options_are_refused(ns, tmp_path):
    with pytest.raises(ValueError, match="namespace"):
        ShmStore(namespace="bad-name")
    with pytest.raises(ValueError, match="capacity_bytes"):
        ShmStore(0, namespace=ns)
    with pytest.raises(ValueError, match="shm_dir"):
        ShmStore(namespace=ns, shm_dir=tmp_path / "missing")


def test_a_lost_lease_drops_its_segments_and_never_revives(ns):
    s = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.3, reap_interval_s=3600))
    seen = []
    s.set_eviction_callback(lambda slot, desc, data: seen.append(slot))
    put(s, 1)
    lease = s.lease_id
    s.registry.revoke(lease)  # as a reaper would after our process stalled past the TTL
    assert eventually(lambda: seen == [slot_n(1)])  # reported after the lease is dropped
    assert s.lease_id is None and s.used_bytes() == 0 and ours(ns) == []
    put(s, 2)  # a fresh lease for new writes
    assert s.lease_id not in (None, lease) and s.get(slot_n(2)) is not None
    s.close()
    assert ours(ns) == []


def test_every_segment_and_lease_file_is_private(store, ns):
    import stat

    old = os.umask(0o022)
    try:
        put(store, 1)
        put(store, 2, size=300)
    finally:
        os.umask(old)
    names = ours(ns)
    assert len(names) == 3  # two segments and the lease record
    for name in names:
        assert stat.S_IMODE(os.stat(SHM / name).st_mode) == 0o600, name


def test_a_chain_larger_than_the_store_keeps_its_prefix_whatever_the_priorities(ns):
    import itertools

    from nexuskv.testing import prefix_problems

    n = itertools.count()
    names = []

    def make(cap):
        names.append(f"{ns}x{next(n)}")
        return keyed(ShmStore(cap, namespace=names[-1], lease_ttl_s=5, reap_interval_s=3600))

    try:
        assert prefix_problems(make) == []
    finally:
        for name in names:
            for f in ours(name):
                (SHM / f).unlink(missing_ok=True)


def test_a_segment_another_user_planted_or_a_symlink_is_never_read(store, ns):
    """Issue 29, finding 2: segments planted in the shm directory by another uid were served after a restart."""
    put(store, 1, size=1000)
    good = SHM / seg(ns, slot_n(1))
    planted = SHM / seg(ns, slot_n(2))
    planted.write_bytes(good.read_bytes())  # a whole, valid segment (CRC and all)
    link = SHM / seg(ns, slot_n(3))
    link.symlink_to(good)
    try:
        if os.geteuid() == 0:
            os.chown(planted, 65534, 65534)  # another user's file
            assert store.get(slot_n(2)) is None and ShmTransport().fetch(store, slot_n(2)) is None
            assert slot_n(2) not in dict(store.descriptors())
        assert store.get(slot_n(3)) is None and ShmTransport().fetch(store, slot_n(3)) is None  # never followed
        assert store.get(slot_n(1)) is not None  # its own segment still reads
    finally:
        planted.unlink()
        link.unlink()
