"""The native index against `DictIndex`: the same operations give the same answers, also under threads."""

import random
import threading
import tracemalloc

import pytest
from hypothesis import settings, stateful
from hypothesis import strategies as st

from nexuskv import DictIndex, Layout, Location, Matcher, StateGroup
from nexuskv_native import NativeIndex, NativeSnapshot
from tests.conftest import check_concurrent_writers, run_threads

LAYOUTS = [
    Layout(groups=[StateGroup(kind="dense", layers=1)]),
    Layout(groups=[StateGroup(kind="latent", layers=1)]),
    Layout(groups=[StateGroup(kind="recurrent", layers=1)]),
    Layout(groups=[StateGroup(kind="windowed", layers=1, window=32)]),
    Layout(groups=[StateGroup(kind="dense", layers=1), StateGroup(kind="recurrent", layers=1)]),
    Layout(groups=[StateGroup(kind="dense", layers=1), StateGroup(kind="windowed", layers=1, window=32),
                   StateGroup(kind="recurrent", layers=1)]),
]
LOCS = [Location("dram", "n1", 1), Location("disk", "n1", 1), Location("dram", "n2", 3), Location("dram", "n2", 5)]
KEYS = [bytes([i]) * 8 + i.to_bytes(8, "little") for i in range(16)]


def answer(m) -> tuple:
    """Everything a `Match` says, with holdings by content (codes and objects differ between indexes)."""
    where = [None if h is None else h.locations for h in m.entries]
    per = tuple(m.longest(tier=t, node=n) for t in (None, "dram", "disk") for n in (None, "n1", "n2"))
    return where, per, m.by_tier(), m.by_node(), m.tokens()


def test_is_a_matcher_and_inline():
    assert isinstance(NativeIndex(), Matcher)
    assert NativeIndex.inline is True


def test_keys_must_be_16_bytes():
    idx = NativeIndex()
    with pytest.raises(ValueError, match="16 bytes"):
        idx.insert(b"short", LOCS[0])
    with pytest.raises(ValueError, match="16 bytes"):
        idx.match([KEYS[0], b"x" * 17], LAYOUTS[0])
    assert b"short" not in idx and "text" not in idx


class Differential(stateful.RuleBasedStateMachine):
    """Random operations on both indexes; after each, every read agrees."""

    def __init__(self):
        super().__init__()
        self.ref, self.nat = DictIndex(), NativeIndex()

    keys = st.sampled_from(KEYS)
    locs = st.sampled_from(LOCS)
    masks = st.integers(1, 7)

    @stateful.rule(key=keys, loc=locs, mask=masks)
    def insert(self, key, loc, mask):
        self.ref.insert(key, loc, mask)
        self.nat.insert(key, loc, mask)

    @stateful.rule(keys=st.lists(keys, max_size=12), loc=locs, mask=masks)
    def insert_many(self, keys, loc, mask):
        self.ref.insert_many(keys, loc, mask)
        self.nat.insert_many(iter(keys), loc, mask)

    @stateful.rule(key=keys, loc=st.none() | locs, mask=st.none() | masks)
    def remove(self, key, loc, mask):
        assert self.nat.remove(key, loc, mask) == self.ref.remove(key, loc, mask)

    @stateful.rule(loc=locs)
    def drop_location(self, loc):
        assert self.nat.drop_location(loc) == self.ref.drop_location(loc)

    @stateful.rule(node=st.sampled_from(["n1", "n2"]), below=st.none() | st.integers(0, 6))
    def drop_node(self, node, below):
        assert self.nat.drop_node(node, below) == self.ref.drop_node(node, below)

    @stateful.invariant()
    def agrees(self):
        assert len(self.nat) == len(self.ref)
        assert self.nat.holdings() == self.ref.holdings()
        for loc in LOCS:
            assert self.nat.keys_at(loc) == self.ref.keys_at(loc)
        for key in KEYS:
            a, b = self.ref.get(key), self.nat.get(key)
            assert (a and a.locations) == (b and b.locations)
            assert (key in self.nat) == (key in self.ref)
        snap = self.nat.snapshot()
        assert isinstance(snap, NativeSnapshot) and len(snap) == len(self.ref)
        assert sorted(snap) == sorted(self.ref.snapshot())
        for layout in LAYOUTS:
            for keys in (KEYS, KEYS[5:11]):
                want = answer(self.ref.match(keys, layout))
                assert answer(self.nat.match(keys, layout)) == want
                assert answer(self.nat.match(keys, layout, deadline=1e18)) == want
                assert answer(snap.match(keys, layout)) == want


TestDifferential = Differential.TestCase
TestDifferential.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_codes_and_location_ids_out_of_range_are_refused_and_change_nothing():
    from nexuskv_native._native import KeyTable

    t = KeyTable()
    key = bytes(16)
    for code, loc in ((2**32 - 1, -1), (-1, -1), (2**40, -1), (1, 2**61), (1, 2**24), (1, -2)):
        with pytest.raises(OverflowError):
            t.set(key, code, loc)
        with pytest.raises(OverflowError):
            t.add_new([key], code, loc)
    assert len(t) == 0 and t.get(key) is None
    t.set(key, 3, 0)
    with pytest.raises(OverflowError):
        t.remap(0, {3: 2**32 - 1})  # refused before anything changes: the key and its list stay
    assert t.get(key) == 3 and t.remap(0, {3: -1}) == 1 and t.get(key) is None


def test_match_stops_when_its_deadline_passes():
    import time

    from nexuskv import DeadlinePassed

    idx = NativeIndex()
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(4000)]
    idx.insert_many(keys, LOCS[0])
    with pytest.raises(DeadlinePassed, match="match"):
        idx.match(keys, LAYOUTS[0], deadline=time.perf_counter() - 1)
    codes, _, late = idx._table.lookup(keys, True, time.perf_counter() - 1)  # C checks before the first key
    assert late and codes == []
    assert idx.match(keys, LAYOUTS[0], deadline=time.perf_counter() + 60).longest() == len(keys)


def test_snapshot_stays_frozen():
    idx = NativeIndex()
    idx.insert_many(KEYS[:4], LOCS[0])
    snap = idx.snapshot()
    idx.drop_location(LOCS[0])
    idx.insert(KEYS[5], LOCS[1])
    assert snap.match(KEYS, LAYOUTS[0]).longest() == 4 and snap.get(KEYS[5]) is None
    assert idx.match(KEYS, LAYOUTS[0]).longest() == 0


def test_many_blocks_grow_and_shrink_the_table():
    idx, ref = NativeIndex(), DictIndex()
    keys = [random.Random(i).randbytes(16) for i in range(20_000)]
    for part in range(0, len(keys), 2048):
        idx.insert_many(keys[part : part + 2048], LOCS[part % 2])
        ref.insert_many(keys[part : part + 2048], LOCS[part % 2])
    for key in keys[::3]:
        assert idx.remove(key) and ref.remove(key)
    assert len(idx) == len(ref) and idx.holdings() == ref.holdings()
    assert [h and h.locations for h in idx.match(keys, LAYOUTS[2]).entries] == \
        [h and h.locations for h in ref.match(keys, LAYOUTS[2]).entries]  # fmt: skip
    assert idx.drop_location(LOCS[0]) == ref.drop_location(LOCS[0])
    assert len(idx) == len(ref)


def test_memory_is_counted_by_tracemalloc_and_small():
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = NativeIndex()
    rng = random.Random(3)
    for _ in range(50):
        keys = [rng.randbytes(16) for _ in range(2048)]
        idx.insert_many(keys, LOCS[0])
    del keys
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert idx.nbytes() <= used  # the table's memory is traced (PyMem_Raw*), not hidden from the figure
    assert used / len(idx) < 64


def test_concurrent_writers_at_different_locations_are_exact():
    """Each thread owns one location and changes the same keys; nothing may be lost (as for DictIndex)."""
    check_concurrent_writers(NativeIndex(), LAYOUTS[4])


def test_readers_stay_exact_while_holdings_are_made_and_pruned():
    """Stable keys are matched while other threads create holdings and drop locations (which prunes codes)."""
    idx = NativeIndex()
    stable = [bytes([200 + i]) * 16 for i in range(40)]
    idx.insert_many(stable, LOCS[0])
    idx.insert_many(stable[:20], LOCS[1], 0b10)
    ref = DictIndex()
    ref.insert_many(stable, LOCS[0])
    ref.insert_many(stable[:20], LOCS[1], 0b10)
    want = {i: answer(ref.match(stable, layout)) for i, layout in enumerate(LAYOUTS)}
    stop = threading.Event()
    bad: list[str] = []

    def churn(n: int) -> None:
        r = random.Random(n)
        while not stop.is_set():
            loc = Location(f"t{r.randrange(8)}", f"x{n}", r.randrange(3))
            idx.insert_many([r.randbytes(16) for _ in range(30)], loc, r.choice((1, 3, 5)))
            idx.drop_location(loc) if r.random() < 0.7 else idx.drop_node(f"x{n}")

    def read(n: int) -> None:
        for j in range(400):
            i = j % len(LAYOUTS)
            got = answer(idx.match(stable, LAYOUTS[i]))
            if got != want[i]:
                bad.append(f"layout {i}: {got} != {want[i]}")

    writers = [threading.Thread(target=churn, args=(n,)) for n in range(3)]
    for w in writers:
        w.start()
    try:
        run_threads(read, 4, switch_interval=1e-6)
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert not bad, bad[:3]
