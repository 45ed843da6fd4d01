from __future__ import annotations

import os
import threading
import time

import pytest

from nexuskv import ConfigError, PersistentTierStore, TensorSpec, TierStore, verify_checksum
from nexuskv_tier_disk import DiskStore, durable_files, file_format
from nexuskv_tier_disk import store as store_mod
from nexuskv_tier_disk.plugin import nexuskv_register_tier_stores


def files(store: DiskStore) -> list[str]:
    return sorted(n for n in os.listdir(store.path) if n != ".lock")


def test_protocol_conformance_and_registration(open_store):
    store = open_store()
    assert isinstance(store, TierStore)
    assert isinstance(store, PersistentTierStore)
    got = {}
    nexuskv_register_tier_stores(lambda name, factory: got.setdefault(name, factory))
    assert got == {"disk": DiskStore}


def test_needs_a_path_and_a_valid_codec(tmp_path):
    with pytest.raises(ConfigError):
        DiskStore(1 << 20)
    with pytest.raises(ValueError):
        DiskStore(1 << 20, path=str(tmp_path), codec="lz4")


def test_one_store_per_directory(open_store):
    open_store()
    with pytest.raises(ConfigError, match="in use"):
        open_store()


@pytest.mark.parametrize("codec", ["raw", "zstd", "shuffle-zstd"])
@pytest.mark.parametrize("tensors", [(), (TensorSpec("k", "float32", (1024,)),)])
def test_roundtrip_each_codec_pending_written_and_reopened(open_store, item, codec, tensors):
    store = open_store(codec=codec)
    it = item(1, 8192, tensors=tensors)
    assert store.put(it.slot, memoryview(it.payload), it.desc)
    assert bytes(store.get(it.slot).payload) == it.payload  # served from memory while the write is pending
    assert store.flush()
    got = store.get(it.slot)
    assert bytes(got.payload) == it.payload and got.descriptor == it.desc
    assert verify_checksum(got.payload, it.desc.checksum)
    header, _, size = file_format.read_header(store.file_of(it.slot))
    assert header.codec == ("raw" if codec == "raw" else codec) and header.raw_len == len(it.payload)
    assert header.elem_size == (0 if codec != "shuffle-zstd" else 4 if tensors else 2)
    assert store.used_bytes() == size
    if codec != "raw":
        assert header.stored_len < len(it.payload)  # fp16-like KV compresses
    store.close()
    again = open_store(codec="raw")  # the codec is per file: any store reads any file
    assert bytes(again.get(it.slot).payload) == it.payload


def test_files_are_written_under_a_temporary_name_then_renamed(open_store, item, monkeypatch):
    store = open_store()
    seen = []
    real = durable_files.write_file

    def spy(path, chunks, fsync):
        seen.append((os.path.basename(path), os.path.exists(store.file_of(it.slot))))
        real(path, chunks, fsync)

    monkeypatch.setattr(durable_files, "write_file", spy)
    it = item(1)
    store.put(it.slot, it.payload, it.desc)
    store.flush()
    ((name, final_existed),) = seen
    assert name.startswith(file_format.TEMP_PREFIX) and not final_existed
    assert files(store) == [os.path.basename(store.file_of(it.slot))]


def test_replacing_a_slot_keeps_one_file(open_store, item):
    store = open_store()
    a, b = item(1), item(2)
    store.put(a.slot, a.payload, a.desc)
    store.flush()
    store.put(a.slot, b.payload, b.desc)  # same slot, new bytes
    store.flush()
    assert bytes(store.get(a.slot).payload) == b.payload
    assert len(files(store)) == 1 and len(store) == 1


def test_restart_rebuilds_holdings_priorities_and_lru_order(open_store, item):
    items = [item(i) for i in range(4)]
    store = open_store(codec="raw")
    for i, it in enumerate(items):
        store.put(it.slot, it.payload, it.desc, priority=float(i % 2))
        store.flush()
        time.sleep(0.02)  # past the file system's timestamp granularity: mtimes tell the order (names do not)
    store.close()
    with open(os.path.join(store.path, file_format.TEMP_PREFIX + "leftover"), "wb") as f:
        f.write(b"partial")
    with open(os.path.join(store.path, "notes.txt"), "w") as f:
        f.write("not ours")
    again = open_store(capacity_bytes=store.used_bytes(), codec="raw")
    assert again.recovery.recovered == 4 and again.recovery.temp_removed == [file_format.TEMP_PREFIX + "leftover"]
    assert again.recovery.ignored == ["notes.txt"] and not again.recovery.corrupt
    assert dict(again.descriptors()) == {it.slot: it.desc for it in items}
    assert again.used_bytes() == store.used_bytes()
    assert again.floor == 0.0  # the lowest priority held
    big = item(9)
    assert again.put(big.slot, big.payload, big.desc, priority=0.5)
    again.flush()
    assert items[0].slot not in again and items[2].slot in again  # lowest priority, oldest first
    assert again.events[0][0] == items[0].slot and again.events[0][2] == items[0].payload


def test_restart_drops_payloads_past_a_smaller_capacity(open_store, item):
    store = open_store(codec="raw")
    for i in range(3):
        it = item(i)
        store.put(it.slot, it.payload, it.desc, priority=float(3 - i))
    store.flush()
    per_file = store.used_bytes() // 3
    store.close()
    again = open_store(capacity_bytes=2 * per_file + 10)
    assert again.recovery.over_capacity == [os.path.basename(again.file_of(item(2).slot))]
    assert len(again) == 2 and again.used_bytes() <= again.capacity_bytes


def test_eviction_order_floor_and_callback(open_store, item):
    per_file = file_format.FIXED_SIZE + len(file_format.encode_meta(item(0).desc)) + 4096
    store = open_store(capacity_bytes=3 * per_file, codec="raw")
    a, b, c, d, e = (item(i) for i in range(1, 6))
    assert store.put(a.slot, a.payload, a.desc, priority=1.0)
    assert store.put(b.slot, b.payload, b.desc, priority=1.0)
    assert store.put(c.slot, c.payload, c.desc, priority=5.0)
    store.flush()
    store.get(a.slot)  # a is now more recently used than b
    assert store.put(d.slot, d.payload, d.desc, priority=1.0)
    store.flush()
    assert b.slot not in store and {a.slot, c.slot, d.slot} <= set(store.slots())
    assert store.events == [(b.slot, b.desc, b.payload)]  # read back from disk so the kernel can demote it
    assert store.floor == 1.0 and store.evictions == 1
    assert not store.put(e.slot, e.payload, e.desc, priority=0.5)  # never evicts more valuable state
    assert len(store) == 3
    assert store.put(e.slot, e.payload, e.desc, priority=2.0)  # evicts the least recently used of priority 1: a
    store.flush()
    assert a.slot not in store and store.events[-1][0] == a.slot
    assert sorted(n for n in os.listdir(store.path) if n.startswith(file_format.EVICT_PREFIX)) == []


def test_pending_victim_is_reported_with_its_payload_and_never_lands(open_store, item, monkeypatch):
    gate = threading.Event()
    real = durable_files.write_file
    monkeypatch.setattr(durable_files, "write_file", lambda *a: (gate.wait(10), real(*a)))
    probe_size = file_format.FIXED_SIZE + len(file_format.encode_meta(item(1).desc)) + 4096
    store = open_store(capacity_bytes=2 * probe_size + 100)
    a, b, c = item(1), item(2), item(3)
    store.put(a.slot, a.payload, a.desc)
    store.put(b.slot, b.payload, b.desc)
    store.put(c.slot, c.payload, c.desc)  # a is evicted while its write is still queued
    assert store.events == [(a.slot, a.desc, a.payload)]
    gate.set()
    store.flush()
    assert a.slot not in store and not os.path.exists(store.file_of(a.slot))
    assert {bytes(store.get(s.slot).payload) for s in (b, c)} == {b.payload, c.payload}


def test_without_evict_payloads_the_callback_gets_none(open_store, item):
    store = open_store(capacity_bytes=8000, codec="raw", evict_payloads=False)
    a, b = item(1), item(2)
    store.put(a.slot, a.payload, a.desc)
    store.flush()
    store.put(b.slot, b.payload, b.desc)
    assert store.events == [(a.slot, a.desc, None)]


def test_ttl_expiry_is_reported_and_survives_restart(open_store, item, monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(store_mod, "_now", lambda: now[0])
    store = open_store()
    a, b = item(1), item(2)
    store.put(a.slot, a.payload, a.desc, ttl_s=10)
    store.put(b.slot, b.payload, b.desc, ttl_s=100)
    store.flush()
    now[0] += 20
    assert store.get(a.slot) is None and a.slot not in store
    assert store.events == [(a.slot, a.desc, None)]
    assert not os.path.exists(store.file_of(a.slot))
    assert store.get(b.slot) is not None
    store.close()
    now[0] += 100
    again = open_store()
    assert again.recovery.expired == [os.path.basename(again.file_of(b.slot))] and len(again) == 0


def test_backpressure_when_the_write_queue_is_full(open_store, item, monkeypatch):
    gate = threading.Event()
    real = durable_files.write_file
    monkeypatch.setattr(durable_files, "write_file", lambda *a: (gate.wait(10), real(*a)))
    store = open_store(write_queue=3)
    results = [store.put(it.slot, it.payload, it.desc) for it in (item(i) for i in range(6))]
    # one write is taken by the writer thread (blocked), three wait in the queue, the rest are refused
    assert results.count(True) in (3, 4) and results[:3] == [True] * 3 and not results[-1]
    assert store.rejected == results.count(False)
    gate.set()
    assert store.flush()
    assert len(files(store)) == results.count(True)
    assert store.put(item(9).slot, item(9).payload, item(9).desc)  # room again


def test_backpressure_by_bytes(open_store, item, monkeypatch):
    gate = threading.Event()
    real = durable_files.write_file
    monkeypatch.setattr(durable_files, "write_file", lambda *a: (gate.wait(10), real(*a)))
    store = open_store(write_queue_bytes=10_000)
    results = [store.put(it.slot, it.payload, it.desc) for it in (item(i) for i in range(8))]
    assert not results[-1]
    gate.set()
    store.flush()


def test_delete_removes_the_file_without_callback(open_store, item):
    store = open_store()
    a = item(1)
    store.put(a.slot, a.payload, a.desc)
    store.flush()
    assert store.delete(a.slot) and not store.delete(a.slot)
    assert files(store) == [] and store.used_bytes() == 0 and store.events == []


def test_too_large_and_closed_puts_are_refused(open_store, item):
    store = open_store(capacity_bytes=1000)
    a = item(1)
    assert not store.put(a.slot, a.payload, a.desc)
    store.close()
    assert not store.put(a.slot, a.payload[:10], a.desc)
    assert store.get(a.slot) is None


def test_slow_reads_are_misses_not_corruption(open_store, item, monkeypatch):
    gate = threading.Event()
    real = file_format.read_verified
    monkeypatch.setattr(file_format, "read_verified", lambda *a: (gate.wait(10), real(*a))[1])
    store = open_store(read_workers=1, read_queue=0, read_timeout_s=0.05)
    a = item(1)
    store.put(a.slot, a.payload, a.desc)
    store.flush()
    assert store.get(a.slot) is None  # the reader is stuck: the caller gives up after read_timeout_s
    assert store.get(a.slot) is None  # the one read slot is still taken: refused at once
    assert store.read_timeouts == 2 and a.slot in store and store.corrupt_reads == 0
    gate.set()
    store.flush()
    for _ in range(100):  # the stuck read finishes and frees its slot
        got = store.get(a.slot)
        if got is not None:
            break
    assert bytes(got.payload) == a.payload


def test_concurrent_puts_gets_and_deletes_keep_the_books_exact(open_store, item):
    items = [item(i) for i in range(24)]
    store = open_store(capacity_bytes=10 * 6000, write_workers=2)
    errors = []

    def worker(seed):
        try:
            for n in range(150):
                it = items[(seed * 7 + n * 5) % len(items)]
                op = (seed + n) % 4
                if op in (0, 1):
                    store.put(it.slot, it.payload, it.desc, priority=float(n % 3))
                elif op == 2:
                    got = store.get(it.slot)
                    assert got is None or bytes(got.payload) == it.payload
                else:
                    store.delete(it.slot)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.flush() and not errors
    on_disk = {n for n in os.listdir(store.path) if n != ".lock"}
    assert on_disk == {store.file_of(s).rsplit("/", 1)[1] for s in store.slots()}
    assert store.used_bytes() == sum(os.path.getsize(store.file_of(s)) for s in store.slots())
    assert store.used_bytes() <= store.capacity_bytes
    for s in list(store.slots()):
        it = next(x for x in items if x.slot == s)
        assert bytes(store.get(s).payload) == it.payload


def test_every_file_and_directory_the_store_creates_is_private(tmp_path, open_store, item):
    import stat

    old = os.umask(0o022)  # the usual umask: it must not decide who can read KV state
    try:
        path = tmp_path / "a" / "b" / "tier"
        store = open_store(path=str(path))
        for i in range(3):
            it = item(i)
            assert store.put(it.slot, it.payload, it.desc)
        assert store.flush()
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b", path):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    names = os.listdir(path)
    assert ".lock" in names and len(names) == 4
    for name in names:
        assert stat.S_IMODE(os.stat(path / name).st_mode) == 0o600, name


def test_a_chain_larger_than_the_store_keeps_its_prefix_whatever_the_priorities(tmp_path, open_store):
    import itertools

    from nexuskv.testing import prefix_problems

    n = itertools.count()
    assert prefix_problems(lambda cap: open_store(cap, path=str(tmp_path / f"s{next(n)}")), size=4096, flush=True) == []
