"""Issue 29: segments are named by a keyed hash of their slot. Listing /dev/shm reveals no slot or block key; a
segment renamed, copied or planted under another name (an old raw-slot name included) is never served; processes
with the same secret share names, a process with another secret finds nothing."""

import os
import shutil

import pytest
from _shm_peer import NAME_KEY, descriptor, kernel_config, keyed, request, seg, slot_n
from _shm_testing import SHM, ours, spawn

from nexuskv import ConfigError, Kernel, StateSeal, store_name
from nexuskv_transport_shm import ShmStore, ShmTransport, segments

OTHER_KEY = StateSeal(bytes(range(1, 33))).name_key


@pytest.fixture
def store(ns):
    s = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=2.0, reap_interval_s=3600))
    yield s
    s.close()


def put(store, i, size=100):
    payload = bytes([i % 256]) * size
    assert store.put(slot_n(i), payload, descriptor(slot_n(i), payload))
    return payload


def _leaks(names, slots):
    secrets = {x for s in slots for x in (s.hex(), s[:-1].hex())}
    return [n for n in names for x in secrets if x in n.lower()]


def test_listing_the_shm_directory_reveals_no_slot_or_block_key(store, ns):
    slots = [slot_n(i) for i in range(1, 6)]
    for i in range(1, 6):
        put(store, i)
    names = ours(ns)
    assert len(names) == 6 and _leaks(names, slots) == []  # five segments and the lease record
    assert sorted(n for n in names if segments.parse_name(ns, n)[0] == "s") == sorted(
        f"{ns}-s-{store_name(NAME_KEY, s)}" for s in slots)  # fmt: skip
    assert sorted(store.slots()) == slots  # the slots come from the descriptors, not the names


def test_a_kernels_segments_reveal_no_block_key(ns):
    with Kernel(kernel_config(ns, 2.0)) as k:
        req = request(64)
        keys = k.keys(req)
        for b in range(len(keys)):
            assert k.put(k.describe(req, b, b"kv" * 100, tier="shm", keys=keys), b"kv" * 100)
        assert len(ours(ns)) == len(keys) + 1
        assert _leaks(ours(ns), [key + b"\0" for key in keys]) == []


def test_a_segment_renamed_to_another_slots_name_is_never_served(store, ns):
    put(store, 1)
    p2 = put(store, 2)
    os.rename(SHM / seg(ns, slot_n(1)), SHM / seg(ns, slot_n(3)))  # slot 1's state under slot 3's name
    shutil.copyfile(SHM / seg(ns, slot_n(2)), SHM / (seg(ns, slot_n(4)) + ".x"))
    os.rename(SHM / (seg(ns, slot_n(4)) + ".x"), SHM / seg(ns, slot_n(4)))  # a copy of slot 2 under slot 4's
    t = ShmTransport()
    for i in (1, 3, 4):
        assert store.get(slot_n(i)) is None and t.fetch(store, slot_n(i)) is None and slot_n(i) not in store, i
    assert bytes(store.get(slot_n(2)).payload) == p2
    assert sorted(store.slots()) == [slot_n(2)] and [s for s, _ in store.descriptors()] == [slot_n(2)]
    assert store.misnamed >= 4
    t.close()
    for i in (3, 4):
        (SHM / seg(ns, slot_n(i))).unlink()


def test_a_segment_under_its_raw_slot_name_from_before_is_skipped_cleanly(store, ns):
    """Segments an older version published (`{ns}-s-{slot hex}`) are never served; listing skips them."""
    put(store, 1)
    good = (SHM / seg(ns, slot_n(1))).read_bytes()
    old = SHM / f"{ns}-s-{slot_n(1).hex()}"
    old.write_bytes(good)  # exactly what the older version wrote for slot 1
    (SHM / f"{ns}-s-not-hex-at-all").write_bytes(good)
    (SHM / f"{ns}-s-{slot_n(7).hex()}").write_bytes(b"garbage")  # not even a segment
    try:
        (SHM / seg(ns, slot_n(1))).unlink()  # only the old name is left
        assert store.get(slot_n(1)) is None and slot_n(1) not in store
        assert list(store.slots()) == [] and list(store.descriptors()) == [] and store.misnamed == 4  # 2 each
        put(store, 1)  # stored again, under its keyed name
        assert [s for s, _ in store.descriptors()] == [slot_n(1)]
    finally:
        for name in (old.name, f"{ns}-s-not-hex-at-all", f"{ns}-s-{slot_n(7).hex()}"):
            (SHM / name).unlink(missing_ok=True)


def test_the_same_key_shares_segments_across_processes_and_another_key_finds_none(ns):
    writer, _ = spawn("store", ns=ns, ttl=2.0, n=3, size=1000)  # keyed with the kernels' name key
    same = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=2.0, reap_interval_s=3600))
    other = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=2.0, reap_interval_s=3600), OTHER_KEY)
    try:
        assert sorted(same.slots()) == [slot_n(i) for i in range(3)]
        assert bytes(ShmTransport().fetch(same, slot_n(2)).payload) == b"\2" * 1000
        assert list(other.slots()) == [] and list(other.descriptors()) == []  # every segment skipped
        assert all(other.get(slot_n(i)) is None and slot_n(i) not in other for i in range(3))
    finally:
        same.close()
        other.close()
        writer.stdin.close()
        writer.wait(timeout=10)
        writer.stdout.close()
        writer.stderr.close()
    assert ours(ns) == []


def test_a_kernel_under_another_secret_indexes_none_of_a_peers_segments(ns):
    writer, hello = spawn("kernel", ns=ns, ttl=2.0, tokens=64, size=1000)
    keys = [bytes.fromhex(k) for k in hello["keys"]]
    try:
        with Kernel(kernel_config(ns, 2.0)) as same:  # same secret: re-indexed at start, served
            assert same.match(request(64)).longest() == len(keys)
        with Kernel(kernel_config(ns, 2.0), secret=bytes(range(1, 33))) as other:
            assert other.match(request(64)).longest() == 0
            assert all(other.index.get(key) is None for key in keys)
            assert other.reindex("shm") == 0
    finally:
        writer.stdin.close()
        writer.wait(timeout=10)
        writer.stdout.close()
        writer.stderr.close()


def test_a_store_without_a_name_key_names_and_lists_nothing(ns):
    bare = ShmStore(1 << 20, namespace=ns, lease_ttl_s=2.0, reap_interval_s=3600)
    try:
        payload = b"x" * 10
        for call in (lambda: bare.put(slot_n(1), payload, descriptor(slot_n(1), payload)),
                     lambda: bare.get(slot_n(1)), lambda: slot_n(1) in bare, lambda: list(bare.slots()),
                     lambda: list(bare.descriptors()), lambda: bare.delete(slot_n(1))):  # fmt: skip
            with pytest.raises(ConfigError, match="no name key"):
                call()
        assert bare.reap() == [] and ours(ns) == []  # reaping names no slot: it works without a key
        bare.use_name_key(NAME_KEY)
        bare.use_name_key(NAME_KEY)
        with pytest.raises(ConfigError, match="cannot change"):
            bare.use_name_key(OTHER_KEY)
    finally:
        bare.close()
