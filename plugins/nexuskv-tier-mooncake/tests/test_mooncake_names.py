"""Issue 29: object keys are `{prefix}/{keyed name}`. No key shows a slot or block key; an object copied under
another slot's key, or planted under an old raw-slot key, is never served; clients with the same secret share
objects, another secret finds none."""

import pytest
from _tier_mooncake_helpers import NAME_KEY, describe, eventually, payload, slot

from nexuskv import ConfigError, StateSeal, store_name

OTHER_KEY = StateSeal(bytes(range(1, 33))).name_key


def test_object_keys_show_no_slot_or_block_key(store, raw_client, prefix):
    slots = [slot(i) for i in range(3)] + [slot(9, group=1)]
    for s in slots:
        d = payload(100)
        assert store.put(s, d, describe(s, d))
    for s in slots:
        key = store.key_of(s)
        assert key == f"{prefix}/{store_name(NAME_KEY, s)}" and s.hex() not in key and s[:-1].hex() not in key
        assert raw_client.is_exist(key) == 1 and raw_client.is_exist(f"{prefix}/{s.hex()}") == 0


def test_an_object_copied_under_another_slots_key_is_never_served(store, raw_client):
    a, b = payload(2000), payload(2000)
    assert store.put(slot(1), a, describe(slot(1), a))
    assert store.put(slot(2), b, describe(slot(2), b))
    stolen = bytes(raw_client.get(store.key_of(slot(1))))  # slot 1's whole object, descriptor and all
    assert raw_client.put(store.key_of(slot(3)), stolen) == 0  # ... planted under slot 3's key
    assert store.get(slot(3)) is None and store.misnamed == 1  # never served, and the object is dropped
    assert eventually(lambda: store.flush_removals() == 0) and raw_client.is_exist(store.key_of(slot(3))) == 0
    assert bytes(store.get(slot(1)).payload) == a and bytes(store.get(slot(2)).payload) == b


def test_an_object_under_its_raw_slot_key_from_before_is_never_read(store, raw_client, prefix):
    a = payload(1000)
    assert store.put(slot(1), a, describe(slot(1), a))
    old = f"{prefix}/{slot(4).hex()}"
    obj = bytes(raw_client.get(store.key_of(slot(1)))).replace(slot(1)[:-1].hex().encode(), slot(4)[:-1].hex().encode())
    assert raw_client.put(old, obj) == 0  # what the older version wrote for slot 4 (its own descriptor)
    try:
        assert store.get(slot(4)) is None and store.misnamed == 0  # its keyed key holds nothing: not even read
    finally:
        raw_client.remove(old, True)


def test_the_same_key_shares_objects_and_another_key_finds_none(make_store):
    writer = make_store()
    d = payload(3000)
    assert writer.put(slot(1), d, describe(slot(1), d))
    assert bytes(make_store().get(slot(1)).payload) == d  # another client, same secret: read in place
    assert make_store(name_key=OTHER_KEY).get(slot(1)) is None  # another secret: another key, nothing there


def test_a_store_without_a_name_key_names_nothing(make_store):
    bare = make_store(name_key=None)
    d = payload(10)
    for call in (lambda: bare.put(slot(0), d, describe(slot(0), d)), lambda: bare.get(slot(0)),
                 lambda: bare.delete(slot(0)), lambda: bare.key_of(slot(0))):  # fmt: skip
        with pytest.raises(ConfigError, match="no name key"):
            call()
    bare.use_name_key(NAME_KEY)
    bare.use_name_key(NAME_KEY)
    with pytest.raises(ConfigError, match="cannot change"):
        bare.use_name_key(OTHER_KEY)
