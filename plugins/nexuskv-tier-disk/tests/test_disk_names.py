"""Issue 29: files are named by a keyed hash of their slot, so the directory's listing reveals no slot or block key,
and a file renamed, planted or named by raw slot (before names were keyed) is never served."""

from __future__ import annotations

import os
import threading

import pytest

from nexuskv import ConfigError, StateSeal, store_name
from nexuskv_tier_disk import durable_files, file_format
from nexuskv_tier_disk import store as store_mod

NAME_KEY = StateSeal(bytes(32)).name_key  # the `open_store` fixture's (conftest.NAME_KEY)
OTHER_KEY = StateSeal(bytes(range(1, 33))).name_key


def _names(store) -> list[str]:
    return sorted(n for n in os.listdir(store.path) if n != ".lock")


def _leaks(names, items) -> list[str]:
    """Every name that shows a slot or a block key of `items` (hex, either case)."""
    secrets = {x for it in items for x in (it.slot.hex(), it.key.hex())}
    return [n for n in names for s in secrets if s in n.lower()]


def test_the_listing_shows_no_slot_or_block_key_not_even_of_writes_and_evictions_in_flight(open_store, item,
                                                                                          monkeypatch):  # fmt: skip
    seen: list[str] = []
    real_write, real_rename = durable_files.write_file, os.rename
    monkeypatch.setattr(durable_files, "write_file", lambda p, c, f: (seen.append(os.path.basename(p)),
                                                                      real_write(p, c, f)))  # fmt: skip
    monkeypatch.setattr(store_mod.os, "rename", lambda a, b: (seen.append(os.path.basename(b)), real_rename(a, b)))
    items = [item(i) for i in range(6)]
    per_file = file_format.FIXED_SIZE + len(file_format.encode_meta(items[0].desc)) + 4096
    store = open_store(capacity_bytes=4 * per_file, codec="raw")
    for it in items:
        assert store.put(it.slot, it.payload, it.desc)
        store.flush()  # written, so the next puts evict files (renamed aside, read back, deleted)
    assert any(n.startswith(file_format.TEMP_PREFIX) for n in seen)
    assert any(n.startswith(file_format.EVICT_PREFIX) for n in seen)
    listed = _names(store)
    assert len(listed) == 4 and _leaks(listed + seen, items) == []
    assert listed == sorted(store_name(NAME_KEY, s) + file_format.SUFFIX for s in store.slots())


def test_a_store_without_a_name_key_names_nothing_and_leaves_its_directory_unread(open_store, item):
    store = open_store()
    a = item(1)
    assert store.put(a.slot, a.payload, a.desc)
    store.close()
    bare = open_store(name_key=None)
    assert bare.recovery.recovered == 0 and len(bare) == 0  # the directory is not even read
    for call in (lambda: bare.put(a.slot, a.payload, a.desc), lambda: bare.get(a.slot),
                 lambda: bare.delete(a.slot), lambda: bare.file_of(a.slot)):  # fmt: skip
        with pytest.raises(ConfigError, match="no name key"):
            call()
    assert _names(bare) == [os.path.basename(store.file_of(a.slot))]  # nothing touched
    bare.use_name_key(NAME_KEY)
    assert bare.recovery.recovered == 1 and bytes(bare.get(a.slot).payload) == a.payload
    bare.use_name_key(NAME_KEY)  # the same key again: nothing changes
    with pytest.raises(ConfigError, match="cannot change"):
        bare.use_name_key(OTHER_KEY)
    with pytest.raises(ValueError, match="name key"):
        open_store(path=store.path + "-short", name_key=b"short")


def test_a_file_renamed_to_another_slots_keyed_name_is_never_served(open_store, item):
    store = open_store()
    a, b, c = item(1), item(2), item(3)
    for it in (a, b, c):
        assert store.put(it.slot, it.payload, it.desc)
    store.close()
    os.replace(store.file_of(a.slot), store.file_of(b.slot))  # a's sealed state, under b's name
    again = open_store()
    assert again.recovery.recovered == 1 and [s for s, _ in again.descriptors()] == [c.slot]
    ((name, why),) = again.recovery.misnamed
    assert name == os.path.basename(store.file_of(b.slot)) and "not the keyed name" in why
    assert again.get(a.slot) is None and again.get(b.slot) is None
    assert _names(again) == [os.path.basename(store.file_of(c.slot))]  # the misnamed file is gone


def test_a_file_under_its_raw_slot_name_from_before_is_skipped_cleanly(open_store, item):
    """An upgrade: files named `<slot hex>.nkv` are never served; the store starts without them (recomputed)."""
    store = open_store()
    a, b = item(1), item(2)
    assert store.put(a.slot, a.payload, a.desc) and store.put(b.slot, b.payload, b.desc)
    store.close()
    old = os.path.join(store.path, a.slot.hex() + file_format.SUFFIX)
    os.rename(store.file_of(a.slot), old)  # what the version before keyed names wrote
    with open(os.path.join(store.path, "00" * 17 + file_format.SUFFIX), "wb") as f:
        f.write(b"not even a header")  # a damaged old one too
    again = open_store()
    assert again.recovery.recovered == 1 and a.slot not in again and again.get(a.slot) is None
    assert [why.split(" (")[0] for _, why in again.recovery.misnamed] == ["named by raw slot"]
    assert [n for n, _ in again.recovery.corrupt] == ["00" * 17 + file_format.SUFFIX]
    assert not os.path.exists(old) and bytes(again.get(b.slot).payload) == b.payload
    assert again.put(a.slot, a.payload, a.desc)  # stored again, under its keyed name
    again.flush()
    assert os.path.exists(again.file_of(a.slot))


def test_another_secrets_store_finds_nothing_and_the_same_secret_finds_everything(open_store, item, tmp_path):
    items = [item(i) for i in range(3)]
    store = open_store()
    for it in items:
        assert store.put(it.slot, it.payload, it.desc)
    store.close()
    same = open_store()
    assert dict(same.descriptors()) == {it.slot: it.desc for it in items}
    same.close()
    other = open_store(name_key=OTHER_KEY)
    assert other.recovery.recovered == 0 and len(other.recovery.misnamed) == 3
    assert all(other.get(it.slot) is None for it in items)


def test_concurrent_puts_of_the_same_slots_leave_one_keyed_file_each(open_store, item):
    """A keyed name is a function of (key, slot) alone: threads writing the same slots end with one file each."""
    store = open_store(write_workers=2)
    items = [item(i) for i in range(8)]
    threads = [threading.Thread(target=lambda: [store.put(it.slot, it.payload, it.desc) for it in items])
               for _ in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.flush()
    assert _names(store) == sorted(os.path.basename(store.file_of(it.slot)) for it in items)
