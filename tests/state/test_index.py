import pytest
from hypothesis import settings, stateful
from hypothesis import strategies as st

from nexuskv import DictIndex, Layout, Location, Matcher, StateGroup, longest_restore_point

DENSE = Layout(groups=[StateGroup(kind="dense", layers=1)])
HYBRID = Layout(groups=[StateGroup(kind="dense", layers=1), StateGroup(kind="recurrent", layers=1)])
A, B, C = Location("dram", "n1", 1), Location("disk", "n1", 1), Location("dram", "n2", 3)


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_is_a_matcher():
    assert isinstance(DictIndex(), Matcher)


def test_insert_get_and_longest_prefix():
    idx = DictIndex()
    for i in range(5):
        idx.insert(k(i), A)
    idx.insert(k(6), A)
    m = idx.match([k(i) for i in range(8)], DENSE)
    assert m.longest() == 5 and m.tokens() == 80
    assert idx.get(k(6)).mask == 1 and idx.get(k(5)) is None
    assert len(idx) == 6 and k(0) in idx


def test_per_tier_and_per_node_answers():
    idx = DictIndex()
    for i in range(6):
        idx.insert(k(i), A)
    for i in range(6, 10):
        idx.insert(k(i), B)
    for i in range(3):
        idx.insert(k(i), C)
    m = idx.match([k(i) for i in range(12)], DENSE)
    assert m.longest() == 10
    assert m.longest(tier="dram") == 6 and m.longest(tier="disk") == 0
    assert m.by_tier() == {"disk": 0, "dram": 6}
    assert m.by_node() == {"n1": 10, "n2": 3}
    assert m.longest(tier="dram", node="n2") == 3
    assert idx.holdings() == {B: 4, A: 6, C: 3}


def test_hybrid_groups_can_live_in_different_places():
    idx = DictIndex()
    for i in range(8):
        idx.insert(k(i), A, 0b01)  # pages in DRAM
    idx.insert(k(3), B, 0b10)  # recurrent checkpoint after block 3, on disk
    idx.insert(k(7), A, 0b10)
    m = idx.match([k(i) for i in range(8)], HYBRID)
    assert m.longest() == 8
    assert m.longest(tier="dram") == 8
    assert m.longest(tier="disk") == 0
    idx.remove(k(7), A, 0b10)
    assert idx.match([k(i) for i in range(8)], HYBRID).longest() == 4


def test_remove_and_drop():
    idx = DictIndex()
    for i in range(4):
        idx.insert(k(i), A)
        idx.insert(k(i), C)
    assert idx.remove(k(1), A)
    assert not idx.remove(k(1), A)
    assert not idx.remove(k(99))
    m = idx.match([k(i) for i in range(4)], DENSE)
    assert m.longest(node="n1") == 1 and m.longest() == 4
    assert idx.drop_node("n2") == 4
    assert idx.match([k(i) for i in range(4)], DENSE).longest() == 1
    assert idx.holdings() == {A: 3}
    assert idx.remove(k(0))
    assert k(0) not in idx


def test_drop_node_below_epoch_fences_stale_holdings():
    idx = DictIndex()
    old, new = Location("dram", "n2", 1), Location("dram", "n2", 5)
    idx.insert(k(0), old)
    idx.insert(k(1), new)
    assert idx.drop_node("n2", below_epoch=5) == 1
    assert idx.get(k(0)) is None and idx.get(k(1)) is not None


def test_insert_many_equals_repeated_insert():
    a, b = DictIndex(), DictIndex()
    for i in range(5):
        a.insert(k(i), C)
        b.insert(k(i), C)
    a.insert_many([k(i) for i in range(8)], A, 0b10)
    for i in range(8):
        b.insert(k(i), A, 0b10)
    assert {i: a.get(k(i)).locations for i in range(8)} == {i: b.get(k(i)).locations for i in range(8)}
    assert a.holdings() == b.holdings()
    with pytest.raises(ValueError):
        a.insert_many([k(0)], A, 0)


def test_holdings_are_interned():
    idx = DictIndex()
    for i in range(100):
        idx.insert(k(i), A)
    assert len({id(idx.get(k(i))) for i in range(100)}) == 1


def test_snapshot_is_frozen_in_time():
    idx = DictIndex()
    for i in range(3):
        idx.insert(k(i), A)
    snap = idx.snapshot()
    idx.insert(k(3), A)
    idx.remove(k(0))
    keys = [k(i) for i in range(4)]
    assert snap.match(keys, DENSE).longest() == 3
    assert idx.match(keys, DENSE).longest() == 0
    assert snap.version < idx.version and len(snap) == 3


def test_bad_mask_rejected():
    with pytest.raises(ValueError):
        DictIndex().insert(k(0), A, 0)


class IndexModel(stateful.RuleBasedStateMachine):
    """The index against a naive reference: a dict of key -> {location: mask}."""

    def __init__(self):
        super().__init__()
        self.idx = DictIndex()
        self.ref: dict[bytes, dict[Location, int]] = {}

    keys = st.integers(0, 12).map(k)
    locs = st.sampled_from([A, B, C])

    @stateful.rule(key=keys, loc=locs, mask=st.integers(1, 3))
    def insert(self, key, loc, mask):
        self.idx.insert(key, loc, mask)
        self.ref.setdefault(key, {})[loc] = self.ref.get(key, {}).get(loc, 0) | mask

    @stateful.rule(key=keys, loc=st.none() | locs, mask=st.none() | st.integers(1, 3))
    def remove(self, key, loc, mask):
        self.idx.remove(key, loc, mask)
        held = self.ref.get(key, {})
        for where in [loc] if loc else list(held):
            if where in held:
                held[where] = 0 if mask is None else held[where] & ~mask
                if not held[where]:
                    del held[where]
        if key in self.ref and not held:
            del self.ref[key]

    @stateful.rule(node=st.sampled_from(["n1", "n2"]))
    def drop(self, node):
        self.idx.drop_node(node)
        for key in list(self.ref):
            self.ref[key] = {w: m for w, m in self.ref[key].items() if w.node != node}
            if not self.ref[key]:
                del self.ref[key]

    @stateful.invariant()
    def agrees(self):
        assert len(self.idx) == len(self.ref)
        keys = [k(i) for i in range(13)]
        for layout in (DENSE, HYBRID):
            m = self.idx.match(keys, layout)
            for tier in (None, "dram", "disk"):
                masks = [
                    sum_or(m for w, m in self.ref.get(key, {}).items() if tier is None or w.tier == tier)
                    for key in keys
                ]
                assert m.longest(tier=tier) == longest_restore_point(layout, masks)
        counts: dict[Location, int] = {}
        for held in self.ref.values():
            for w in held:
                counts[w] = counts.get(w, 0) + 1
        assert self.idx.holdings() == dict(sorted(counts.items()))


def sum_or(ms):
    out = 0
    for m in ms:
        out |= m
    return out


TestIndexModel = IndexModel.TestCase
TestIndexModel.settings = settings(max_examples=60, stateful_step_count=30)


def test_concurrent_inserts_and_removes_at_different_locations_of_the_same_keys_are_exact():
    """Each thread owns one location and changes the same keys as the others; nothing may be lost."""
    from tests.conftest import check_concurrent_writers

    check_concurrent_writers(DictIndex(), DENSE)
