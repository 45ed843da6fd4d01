"""StateSeal and the hierarchy: stored state that a store writer planted, changed or copied from another
deployment is never served (issue 29, finding 2)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv import Location, slot_of
from nexuskv.contracts import Namespace, Placement, TokenSpan, Usage
from nexuskv.contracts.checksums import checksum
from nexuskv.storage.state_seal import StateSeal
from tests.conftest import SECRET
from tests.storage.test_hierarchy import build, descriptor, keys  # noqa: F401  (the fixture)

OTHER = bytes(range(1, 33))


def test_the_mac_covers_the_payload_and_every_field_but_where_it_lies_and_how_often_it_was_read(build):  # noqa: F811
    h = build({"dram": {"store": "dram"}})
    seal = StateSeal(SECRET)
    d = seal.seal(descriptor(h, keys(1)[0], b"abc", "dram"), b"abc")
    assert seal.check(d, b"abc") and not StateSeal(OTHER).check(d, b"abc")
    assert seal.check(attrs.evolve(d, placement=Placement("disk", "n9", 7), usage=Usage(1.0, 2.0, 3)), b"abc")
    changed = {"namespace": Namespace("globex"), "span": TokenSpan(0, 32), "nbytes": 4, "group": 1,
               "codec": "zstd", "raw_nbytes": 9, "parent_key": "ab" * 16, "checksum": checksum(b"abd"),
               "key": "cd" * 16, "model": attrs.evolve(d.model, revision="2")}  # fmt: skip
    for name, value in changed.items():
        assert not seal.check(attrs.evolve(d, **{name: value}), b"abc"), name
    assert not seal.check(d, b"abd") and not seal.check(attrs.evolve(d, mac=""), b"abc")


@settings(max_examples=50, deadline=None)
@given(payload=st.binary(min_size=1, max_size=4096), at=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_flipped_bit_of_a_payload_fails_its_mac(payload, at, bit):
    seal = StateSeal(SECRET)
    from tests.storage.test_hierarchy import make_request  # a descriptor without a hierarchy

    req = make_request(range(16))
    d = seal.seal(attrs.evolve(_bare(req), nbytes=len(payload), checksum=checksum(payload)), payload)
    flipped = bytearray(payload)
    flipped[at % len(payload)] ^= 1 << bit
    assert seal.check(d, payload) and not seal.check(d, bytes(flipped))
    assert seal.check(d, memoryview(payload))  # the same bytes however they are held


def _bare(req):
    from nexuskv.contracts import StateDescriptor

    return StateDescriptor(key="00" * 16, namespace=req.namespace, model=req.model, tokenizer=req.tokenizer,
                           layout=req.layout, span=TokenSpan(0, 16), nbytes=0, checksum=checksum(b""),
                           placement=Placement("dram", "n1"))  # fmt: skip


def test_state_planted_by_a_store_writer_is_never_served(build):  # noqa: F811
    h = build({"dram": {"store": "dram"}})
    planted, forged, foreign, swapped = keys(4)
    store, loc = h.tiers["dram"], Location("dram", "n1", h.membership.epoch)
    # 1. a payload and a descriptor that agree (a checksum anyone can compute), and no MAC: an old or planted entry
    store.put(slot_of(planted), b"evil", descriptor(h, planted, b"evil", "dram"))
    # 2. the same with a made-up MAC
    store.put(slot_of(forged), b"evil", attrs.evolve(descriptor(h, forged, b"evil", "dram"), mac="ab" * 16))
    # 3. state sealed by another deployment (another secret)
    store.put(slot_of(foreign), b"evil", StateSeal(OTHER).seal(descriptor(h, foreign, b"evil", "dram"), b"evil"))
    # 4. this deployment's sealed descriptor, its payload swapped and the checksum made to agree
    assert h.put(descriptor(h, swapped, b"good", "dram"), b"good")
    sealed = store.get(slot_of(swapped)).descriptor
    store.put(slot_of(swapped), b"evil", attrs.evolve(sealed, checksum=checksum(b"evil"), nbytes=4))
    for k in (planted, forged, foreign, swapped):
        h.index.insert(k, loc)  # what a restart's re-index or a cluster index would say
        assert h.load(k) is None, k.hex()
        assert h.index.get(k) is None  # and it leaves the index
    assert slot_of(planted) in store  # an unsealed entry is refused, not deleted (it may be an older version's)
    assert all(slot_of(k) not in store for k in (forged, foreign, swapped))  # a failed MAC is quarantined


def test_an_evicted_payload_whose_mac_fails_is_not_laundered_into_the_tier_below(build):  # noqa: F811
    h = build({"dram": {"store": "dram", "capacity_bytes": 200}, "disk": {"store": "dram"}})
    a, b, c = keys(3)
    h.tiers["dram"].put(slot_of(a), b"e" * 100, descriptor(h, a, b"e" * 100, "dram"))  # planted, no MAC
    assert h.put(descriptor(h, b, b"b" * 100, "dram"), b"b" * 100)
    assert h.put(descriptor(h, c, b"c" * 100, "dram"), b"c" * 100)  # pushes something out of dram
    assert slot_of(a) not in h.tiers["dram"] and len(h.tiers["disk"]) == 0  # evicted, and never sealed below


def test_another_groups_sealed_state_moved_into_this_slot_is_not_the_blocks(build):  # noqa: F811
    """A hybrid block's group 1 (recurrent state) copied into group 0's slot carries a good MAC: never served."""
    h = build({"dram": {"store": "dram"}})
    k = keys(1)[0]
    assert h.put(attrs.evolve(descriptor(h, k, b"ssm-state", "dram"), group=1), b"ssm-state")
    sealed = h.tiers["dram"].get(slot_of(k, 1))
    h.tiers["dram"].put(slot_of(k, 0), b"ssm-state", sealed.descriptor)  # a store writer moves it
    h.index.insert(k, Location("dram", "n1", h.membership.epoch), 0b11)
    assert h.load(k, 0) is None and bytes(h.load(k, 1).payload) == b"ssm-state"


def test_a_mac_survives_json_whatever_number_types_the_writer_used():
    """A Python caller's `2` reads back from JSON as `2.0`: the MAC must check in another process all the same."""
    import json

    from nexuskv import AdapterIdentity, ModelIdentity, StateDescriptor, from_dict, to_dict
    from tests.storage.test_hierarchy import make_request

    req = make_request(range(16), model=ModelIdentity("m", adapter=AdapterIdentity(name="lora", scale=2)))
    d = attrs.evolve(_bare(req), model=req.model, nbytes=3, checksum=checksum(b"abc"))
    sealed = StateSeal(SECRET).seal(d, b"abc")
    back = from_dict(StateDescriptor, json.loads(json.dumps(to_dict(sealed))))
    assert StateSeal(SECRET).check(back, b"abc")  # a fresh seal: nothing memoised from the writer


# ------------------------------------------------------------------------------------------ names (issue 29)


def test_the_name_key_is_a_third_derivation_of_the_secret():
    seal = StateSeal(SECRET)
    assert len(seal.name_key) == 32 and seal.name_key == StateSeal(SECRET).name_key
    assert len({seal.name_key, seal.peer_key, seal._key}) == 3
    assert StateSeal(OTHER).name_key != seal.name_key


def test_a_store_name_is_a_keyed_hash_of_the_slot_and_names_nothing_else():
    from nexuskv import store_name

    key, k = StateSeal(SECRET).name_key, keys(1)[0]
    name = store_name(key, slot_of(k))
    assert len(name) == 32 and int(name, 16) >= 0 and name == store_name(key, slot_of(k))  # 16 bytes, hex
    assert k.hex() not in name and slot_of(k).hex() not in name
    assert name != store_name(key, slot_of(k, 1)) != store_name(StateSeal(OTHER).name_key, slot_of(k))
    for bad in (b"", b"short", bytes(65)):
        with pytest.raises(ValueError, match="name key"):
            store_name(bad, slot_of(k))


def test_slot_named_takes_the_slot_from_the_descriptor_and_only_under_its_own_name():
    from nexuskv import slot_named, store_name
    from tests.storage.test_hierarchy import make_request

    key, other = StateSeal(SECRET).name_key, StateSeal(OTHER).name_key
    a, b = keys(2)
    d = attrs.evolve(_bare(make_request(range(16))), key=a.hex(), group=1)
    assert slot_named(key, store_name(key, slot_of(a, 1)), d) == slot_of(a, 1)
    assert slot_named(key, store_name(key, slot_of(b, 1)), d) is None  # renamed: another slot's name
    assert slot_named(key, store_name(key, slot_of(a, 0)), d) is None  # another group's name
    assert slot_named(key, store_name(other, slot_of(a, 1)), d) is None  # named under another secret
    assert slot_named(key, slot_of(a, 1).hex(), d) is None  # named by raw slot, as before names were keyed
    assert slot_named(key, "not a name \udcff", d) is None
