"""Hierarchy: building tiers, their order, store / load / quarantine, evictions, demotion and prefetch moves."""

from __future__ import annotations

import json
from typing import ClassVar

import attrs
import pytest

from nexuskv import BlockKeyer, ConfigError, DictIndex, KernelConfig, Location, slot_of
from nexuskv.builtins.embedded import EmbeddedControlPlane
from nexuskv.cluster.membership import Membership
from nexuskv.contracts import LinkCost, Placement, StateDescriptor, TokenSpan, Usage, to_dict
from nexuskv.contracts.checksums import checksum
from nexuskv.planning.breakers import Health
from nexuskv.planning.cost import CostModel, default_profile, load_profile
from nexuskv.plugins.manager import PluginManager
from nexuskv.storage.hierarchy import Hierarchy
from nexuskv.storage.state_seal import StateSeal
from tests.conftest import SECRET, make_request


@pytest.fixture
def build():
    made: list[tuple[Hierarchy, Membership]] = []

    def make(tiers, **cfg) -> Hierarchy:
        config = KernelConfig(node="n1", tiers=tiers, **cfg)
        membership = Membership(EmbeddedControlPlane(), "n1", 10.0)
        pm = PluginManager({}, entry_points=False)
        cost = CostModel(load_profile(config.profile) if config.profile else None)
        h = Hierarchy(config, (pm.tier_stores(), pm.transports()), DictIndex(), cost, Health(), membership,
                      StateSeal(SECRET))
        made.append((h, membership))
        return h

    yield make
    for h, m in made:
        h.close()
        m.close()


def descriptor(h: Hierarchy, key: bytes, payload: bytes, tier: str, block: int = 0) -> StateDescriptor:
    req = make_request(range(16))
    return StateDescriptor(key=key.hex(), parent_key=None, namespace=req.namespace, model=req.model,
                           tokenizer=req.tokenizer, layout=req.layout, group=0, span=TokenSpan(0, 16 * (block + 1)),
                           nbytes=len(payload), checksum=checksum(payload), placement=h.placement(tier),
                           usage=Usage())  # fmt: skip


def shaped_profile(tmp_path) -> str:
    """The default profile, plus a cost for a tier named `shaped`."""
    prof = default_profile()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(to_dict(attrs.evolve(prof, tiers={**prof.tiers, "shaped": LinkCost(5e7, 1.0)}))))
    return str(path)


def keys(n: int) -> list[bytes]:
    return BlockKeyer(SECRET, 16).request_keys(make_request(range(16 * n)))


def test_tiers_are_ordered_fastest_first(build):
    h = build({"redis": {"store": "dram"}, "disk": {"store": "dram"}, "dram": {"store": "dram"}})
    assert h.tier_order == ("dram", "disk", "redis")  # by the profile's bandwidth
    assert set(h.tiers) == {"disk", "dram", "redis"} and h.fastest == "dram"
    assert set(h.transports) == {"local"}


def test_a_tier_the_cost_profile_has_no_cost_for_is_refused_with_the_fix(tmp_path):
    """It would store blocks that no plan ever reads (and no demotion reaches): refused when the tiers are built."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(to_dict(default_profile())))
    membership = Membership(EmbeddedControlPlane(), "n1", 10.0)
    pm = PluginManager({}, entry_points=False)
    try:
        for cfg, which in ((KernelConfig(tiers={"dram": {}, "nvme": {"store": "dram"}}), "`profile` is not set"),
                           (KernelConfig(tiers={"nvme": {"store": "dram"}}, profile=str(profile)), str(profile))):
            with pytest.raises(ConfigError) as info:
                Hierarchy(cfg, (pm.tier_stores(), pm.transports()), DictIndex(), CostModel(), Health(), membership,
                          StateSeal(SECRET))
            assert str(info.value).startswith("tiers.nvme: the cost profile 'default-cpu-tiny-llama' (")
            assert which in str(info.value)
            assert ('add "nvme": {"bandwidth_bytes_per_s": ..., "latency_ms": ...} to the profile\'s "tiers"'
                    in str(info.value))  # fmt: skip
            assert str(info.value).endswith("or use a tier name the profile prices (disk, dram, redis, shm)")
    finally:
        membership.close()


def test_a_transport_that_reaches_other_nodes_but_cannot_authenticate_them_is_refused():
    class Unkeyed:
        name, remote = "tcp", True

        def fetch(self, store, slot):
            return store.get(slot)

        def close(self):
            pass

    membership = Membership(EmbeddedControlPlane(), "n1", 10.0)
    pm = PluginManager({}, entry_points=False)
    try:
        with pytest.raises(ConfigError, match="'tcp' reaches other nodes but cannot authenticate them"):
            Hierarchy(KernelConfig(node="n1", transports=("local", "tcp")),
                      (pm.tier_stores(), {**pm.transports(), "tcp": Unkeyed}), DictIndex(), CostModel(), Health(),
                      membership, StateSeal(SECRET))  # fmt: skip
    finally:
        membership.close()


@pytest.mark.parametrize(("tiers", "fragment"), [
    ({"hot": {"store": "nvme"}}, "no tier store plugin named 'nvme'"),
    ({"hot": {"store": "dram", "capacity_bytes": "lots"}}, "tiers.hot.capacity_bytes"),
    ({"hot": {"store": "dram", "speed": 3}}, "tiers.hot"),
])  # fmt: skip
def test_a_bad_tier_is_a_precise_error(build, tiers, fragment):
    with pytest.raises(ConfigError) as info:
        build(tiers)
    assert fragment in str(info.value)


def test_store_indexes_at_this_nodes_epoch_and_load_verifies(build):
    h = build({"dram": {"store": "dram"}})
    k = keys(1)[0]
    assert h.put(descriptor(h, k, b"abc", "dram"), b"abc")
    assert h.index.get(k).locations == ((Location("dram", "n1", h.membership.epoch), 1),)
    got = h.load(k)
    assert got is not None and bytes(got.payload) == b"abc"
    h.tiers["dram"].put(slot_of(k), b"abd", got.descriptor)  # bit rot behind the kernel's back
    assert h.load(k) is None  # quarantined: gone from the tier and the index
    assert slot_of(k) not in h.tiers["dram"] and h.index.get(k) is None


def test_old_checksums_still_verify_and_unknown_ones_are_refused_without_deleting(build):
    import attrs

    from nexuskv import ChecksumError

    h = build({"dram": {"store": "dram"}})
    old, new = keys(2)
    legacy = attrs.evolve(descriptor(h, old, b"abc", "dram"), checksum=checksum(b"abc", "blake2b-128"))
    assert legacy.checksum.startswith("blake2b-128:") and h.put(legacy, b"abc")  # written before xxh3 was the default
    assert bytes(h.load(old).payload) == b"abc"
    future = attrs.evolve(descriptor(h, new, b"xyz", "dram"), checksum="sha3-256:" + "ab" * 32)
    with pytest.raises(ChecksumError, match="unknown checksum algorithm 'sha3-256'"):
        h.put(future, b"xyz")
    h.tiers["dram"].put(slot_of(new), b"xyz", future)  # a newer node wrote it into a shared tier
    h.index.insert(new, Location("dram", "n1", h.membership.epoch))
    assert h.load(new) is None  # refused: this version cannot verify it
    assert h.index.get(new) is None and slot_of(new) in h.tiers["dram"]  # unindexed here, kept for its readers


def test_an_eviction_removes_exactly_that_location_and_demotes_one_tier_down(build):
    h = build({"dram": {"store": "dram", "capacity_bytes": 300}, "disk": {"store": "dram"}})
    ks = keys(4)
    for b in reversed(range(4)):  # deepest first: the prefix that arrives last outranks the leaf (cost-aware)
        d = descriptor(h, ks[b], bytes([b]) * 100, "dram", block=b)
        assert h.store(d, bytes([b]) * 100, h.default_priority(d))
    in_dram = [k for k in ks if slot_of(k) in h.tiers["dram"]]
    in_disk = [k for k in ks if slot_of(k) in h.tiers["disk"]]
    assert in_dram == ks[:3] and in_disk == ks[3:]  # the leaf went, the prefix stayed
    for k in in_dram:
        assert h.index.get(k).tiers() == {"dram"}
    assert h.index.get(in_disk[0]).tiers() == {"disk"}  # the evicted block lives on, one tier down
    assert bytes(h.load(in_disk[0]).payload) == bytes([ks.index(in_disk[0])]) * 100


def test_without_demotion_an_evicted_block_is_gone(build):
    h = build({"dram": {"store": "dram", "capacity_bytes": 100}, "disk": {"store": "dram"}}, demote=False)
    a, b = keys(2)
    assert h.put(descriptor(h, a, b"a" * 100, "dram"), b"a" * 100)
    assert h.put(descriptor(h, b, b"b" * 100, "dram"), b"b" * 100)
    assert h.index.get(a) is None and len(h.tiers["disk"]) == 0


def test_move_copies_a_slot_and_quarantines_a_corrupt_source(build):
    h = build({"dram": {"store": "dram"}, "disk": {"store": "dram"}})
    a, b = keys(2)
    for k in (a, b):
        assert h.put(descriptor(h, k, b"x" * 10, "disk"), b"x" * 10)
    assert h.move(slot_of(a), "disk", "dram")
    assert h.index.get(a).tiers() == {"dram", "disk"}
    assert h.tiers["dram"].get(slot_of(a)).descriptor.placement == Placement("dram", "n1", h.membership.epoch)
    bad = h.tiers["disk"].get(slot_of(b))
    h.tiers["disk"].put(slot_of(b), b"y" * 10, bad.descriptor)
    assert not h.move(slot_of(b), "disk", "dram")
    assert h.index.get(b) is None and slot_of(b) not in h.tiers["dram"]
    assert not h.move(slot_of(b), "disk", "dram") and not h.move(slot_of(a), "disk", "nowhere")


def test_reindex_refuses_a_tier_that_is_not_persistent(build):
    h = build({"dram": {"store": "dram"}})
    with pytest.raises(ConfigError, match="not a persistent tier"):
        h.reindex("dram")


def test_transport_options_reach_the_factory_and_mistakes_are_config_errors(build):
    dram = {"dram": {"store": "dram", "capacity_bytes": "1MiB"}}
    with pytest.raises(ConfigError, match=r"transport_options: \['tcp'\] not in transports"):
        build(dram, transport_options={"tcp": {"host": "127.0.0.1"}})
    with pytest.raises(ConfigError, match=r"transport_options.local: .*takes no arguments"):
        build(dram, transport_options={"local": {"speed": 1}})
    h = build(dram)
    assert h.remote == "" and h.addresses == {}  # no transport reaches other nodes: only local state is planned


def test_only_this_nodes_entries_in_a_private_tier_are_forgotten_on_a_miss(build):
    h = build({"dram": {"store": "dram", "capacity_bytes": "1MiB"}})
    key = keys(1)[0]
    h.index.insert(key, Location("dram", "n2", 1), 1)  # a peer's entry, from the cluster index
    h.index.insert(key, Location("dram", "n1", 1), 1)  # ours, but the tier no longer has it
    assert h.load(key, tier="dram") is None
    assert h.index.get(key).mask_at("dram", "n2") == 1 and not h.index.get(key).mask_at("dram", "n1")


def test_a_transport_that_reaches_other_nodes_cannot_come_first(build):
    class Peers:
        name, remote = "tcp", True

        def fetch(self, store, slot):
            return store.get(slot)

        def authenticate(self, key):
            pass

        def close(self):
            pass

    config = KernelConfig(node="n1", transports=("tcp", "local"))
    membership = Membership(EmbeddedControlPlane(), "n1", 10.0)
    pm = PluginManager({}, entry_points=False)
    try:
        with pytest.raises(ConfigError, match="the first transport reads this node's own tiers"):
            Hierarchy(config, (pm.tier_stores(), {**pm.transports(), "tcp": Peers}), DictIndex(), CostModel(),
                      Health(), membership, StateSeal(SECRET))  # fmt: skip
    finally:
        membership.close()


def test_priority_for_keeps_a_rules_priority_and_prices_the_default_once(build, tmp_path):
    h = build({"dram": {"store": "dram"}, "shaped": {"store": "shaped-link"}}, profile=shaped_profile(tmp_path))
    d = descriptor(h, keys(1)[0], b"x" * 100, "dram")
    assert h.priority_for(d, 7.5) == (7.5, None)  # a place rule's priority, as given
    prio, value = h.priority_for(d)  # the DRAM store counts reads: it takes the value and adds its own floor
    assert value is not None and value > 0 and prio == pytest.approx(h.tiers["dram"].floor + value)
    shaped = attrs.evolve(d, placement=h.placement("shaped"))
    assert h.priority_for(shaped) == (h.default_priority(shaped), None)  # a store that does not count reads


# ------------------------------------------------------------------------------------------ names (issue 29)


def _store_class(shared: bool, keyed: bool, listing: list | None = None):
    """A DRAM store that records what the hierarchy calls first; `keyed`: it has `use_name_key`."""
    from nexuskv.builtins.dram import DramStore

    class Store(DramStore):
        calls: ClassVar[list] = []

        def __init__(self, **kw):
            super().__init__(**kw)
            self.shared, self.closed = shared, False
            Store.calls.append(("init", None))

        def set_eviction_callback(self, callback):
            Store.calls.append(("set_eviction_callback", None))
            super().set_eviction_callback(callback)

        def descriptors(self):
            Store.calls.append(("descriptors", None))
            return list(listing or [])

        def close(self):
            Store.calls.append(("close", None))
            super().close()

    if keyed:
        Store.use_name_key = lambda self, key: Store.calls.append(("use_name_key", key))
    return Store


def _hierarchy(factory):
    membership = Membership(EmbeddedControlPlane(), "n1", 10.0)
    pm = PluginManager({}, entry_points=False)
    try:
        return Hierarchy(KernelConfig(node="n1", tiers={"dram": {"store": "named"}}),
                         ({**pm.tier_stores(), "named": factory}, pm.transports()), DictIndex(), CostModel(), Health(),
                         membership, StateSeal(SECRET)), membership  # fmt: skip
    except BaseException:
        membership.close()
        raise


def test_every_store_that_names_things_gets_the_name_key_before_anything_else():
    store = _store_class(shared=True, keyed=True)
    h, membership = _hierarchy(store)
    try:
        assert [c for c, _ in store.calls] == ["init", "use_name_key", "set_eviction_callback", "descriptors"]
        assert store.calls[1][1] == StateSeal(SECRET).name_key != StateSeal(SECRET).peer_key
    finally:
        h.close()
        membership.close()


def test_a_shared_store_that_cannot_take_the_name_key_is_refused_and_closed():
    store = _store_class(shared=True, keyed=False)
    with pytest.raises(ConfigError, match=r"tiers\.dram: the store is shared .* cannot take the name key"):
        _hierarchy(store)
    assert [c for c, _ in store.calls] == ["init", "close"]
    private = _store_class(shared=False, keyed=False)  # a store of this process alone names nothing shared
    h, membership = _hierarchy(private)
    h.close()
    membership.close()


def test_reindex_skips_what_a_store_lists_under_another_slot_than_its_descriptors(build):
    h = build({"dram": {"store": "dram"}})
    k1, k2 = keys(2)
    seal = StateSeal(SECRET)
    good, bad = (seal.seal(descriptor(h, k, b"abc", "dram"), b"abc") for k in (k1, k2))
    store = _store_class(shared=True, keyed=True, listing=[(slot_of(k1), good), (slot_of(k1, 1), bad)])
    h2, membership = _hierarchy(store)
    try:
        assert h2.index.get(k1) is not None and h2.index.get(k2) is None  # k2's state listed as k1's: skipped
        assert h2.index.get(k1).mask_at(tier="dram") == 1  # and not as group 1 of k1 either
    finally:
        h2.close()
        membership.close()
