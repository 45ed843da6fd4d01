import heapq

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nexuskv import Frequency, pick_victims, refreshed_priority


def _heap(entries):
    h = list(entries)
    heapq.heapify(h)
    return h


def test_nothing_to_evict_when_it_fits():
    h = _heap([(1.0, 0, b"a")])
    assert pick_victims(h, used=10, need=5, capacity=20, priority=0.0, size_of=lambda s, q: 10) == []
    assert len(h) == 1


def test_lowest_priority_then_oldest_and_stale_entries_dropped():
    sizes = {b"a": 10, b"b": 10, b"c": 10}
    current = {b"a": 3, b"b": 1, b"c": 2}  # a was touched again (seq 3): its seq-0 entry is stale
    h = _heap([(1.0, 0, b"a"), (1.0, 1, b"b"), (1.0, 2, b"c"), (1.0, 3, b"a")])
    got = pick_victims(h, used=30, need=15, capacity=30, priority=1.0,
                       size_of=lambda s, q: sizes[s] if current[s] == q else None)  # fmt: skip
    assert [v[2] for v in got] == [b"b", b"c"]
    assert h == [(1.0, 3, b"a")]  # the stale entry is gone, the victims popped


def test_never_above_the_incoming_priority_and_all_or_nothing():
    h = _heap([(1.0, 0, b"a"), (5.0, 1, b"b")])
    before = sorted(h)
    assert pick_victims(h, used=20, need=15, capacity=20, priority=2.0, size_of=lambda s, q: 10) is None
    assert sorted(h) == before


def test_the_slot_being_replaced_is_kept():
    h = _heap([(0.0, 0, b"a"), (0.0, 1, b"b")])
    got = pick_victims(h, used=20, need=5, capacity=20, priority=0.0, size_of=lambda s, q: 10, keep=b"a")
    assert [v[2] for v in got] == [b"b"] and h == [(0.0, 0, b"a")]


@given(st.lists(st.tuples(st.floats(0, 10), st.integers(1, 50)), max_size=30), st.integers(1, 200),
       st.floats(0, 10))  # fmt: skip
def test_victims_make_exactly_enough_room_or_none(items, need, prio):
    sizes = {bytes([i]): n for i, (_, n) in enumerate(items)}
    h = _heap([(p, i, bytes([i])) for i, (p, _) in enumerate(items)])
    used = sum(sizes.values())
    capacity = max(used, 1)
    got = pick_victims(h, used=used, need=need, capacity=capacity, priority=prio, size_of=lambda s, q: sizes[s])
    eligible = sum(n for p, n in items if p <= prio)
    if used + need <= capacity:
        assert got == []
    elif got is None:
        assert used - eligible + need > capacity and len(h) == len(items)
    else:
        freed = sum(sizes[v[2]] for v in got)
        assert used - freed + need <= capacity and all(v[0] <= prio for v in got)
        rest = [p for p, _, _ in h]
        assert not rest or all(v[0] <= min(rest) for v in got)  # lowest first


# ------------------------------------------------------------------------------------------ frequency (GDSF)


def admit(f, slot, floor, value=None, priority=0.0):
    prio, entry = f.admit(slot, floor, priority, value)
    f.record(slot, entry)
    return prio


def test_reads_lift_a_priority_above_the_floor_again():
    f = Frequency()
    assert admit(f, b"a", 10.0, value=2.0) == pytest.approx(10.0 + 2.0 * f.probation)  # never seen: probation
    assert f.hit(b"a", 0.0, 15.0) == 15.0 + 2.0 * 2  # one read: floor now + value * (1 + reads)
    assert f.hit(b"a", 0.0, 15.0) == 15.0 + 2.0 * 3
    assert admit(f, b"a", 20.0, value=2.0) == 20.0 + 2.0 * 3  # put again while held: re-priced, reads kept
    assert refreshed_priority(1.0, 2.0, 3) == 9.0


def test_an_evicted_block_comes_back_with_its_reads():
    f = Frequency()
    admit(f, b"a", 1.0, value=2.0)
    f.hit(b"a", 0.0, 1.0)
    f.evicted(b"a")
    assert admit(f, b"a", 1.0, value=2.0) == 1.0 + 2.0 * (1 + 2)  # asked for again: its one read plus this put
    f.forget(b"a")
    assert admit(f, b"a", 1.0, value=2.0) == pytest.approx(1.0 + 2.0 * f.probation)  # deleted: no history


def test_a_refused_put_changes_nothing():
    f = Frequency()
    admit(f, b"a", 0.0, value=2.0)
    f.hit(b"a", 0.0, 0.0)
    f.evicted(b"a")
    prio, _ = f.admit(b"a", 0.0, 0.0, 2.0)  # priced, but the store could not make room: never recorded
    assert prio == 2.0 * 3 and f._ghost == {b"a": 1}
    admit(f, b"b", 0.0, value=2.0)
    f.hit(b"b", 0.0, 0.0)
    f.admit(b"b", 0.0, 0.0)  # a refused re-put with an explicit priority
    assert f.hit(b"b", 0.0, 0.0) == 2.0 * 3  # the kept copy still counts its reads


def test_explicit_priorities_are_kept_as_given():
    f = Frequency()
    assert admit(f, b"a", 5.0, priority=10.0) == 10.0  # a place rule's priority: not rescaled
    assert f.hit(b"a", 10.0, 5.0) == 10.0  # and not lifted by reads
    assert admit(f, b"b", 0.0, value=0.0) == 0.0  # LRU mode


def test_the_ghost_history_is_bounded_and_arguments_checked():
    f = Frequency(history=1)
    for i in range(500):
        slot = i.to_bytes(4, "big")
        admit(f, slot, 1.0, value=1.0)
        f.evicted(slot)
    assert len(f._ghost) == 64  # history * max(64, held)
    with pytest.raises(ValueError, match="history"):
        Frequency(history=-1)
    with pytest.raises(ValueError, match="probation"):
        Frequency(probation=-0.5)


def test_recording_a_block_whose_history_was_pushed_out_meanwhile():
    f = Frequency(history=1)
    admit(f, b"old", 0.0, value=1.0)
    f.hit(b"old", 0.0, 0.0)
    f.evicted(b"old")
    prio, entry = f.admit(b"old", 0.0, 0.0, 1.0)  # priced with its history...
    for i in range(100):  # ...then the room made for it evicts enough to push that history out
        slot = i.to_bytes(4, "big")
        admit(f, slot, 0.0, value=1.0)
        f.evicted(slot)
    f.record(b"old", entry)
    assert prio == 1.0 * 3 and b"old" not in f._ghost and f.hit(b"old", 0.0, 0.0) == 1.0 * 4


def test_an_explicit_put_ends_a_blocks_history():
    f = Frequency()
    admit(f, b"a", 0.0, value=1.0)
    f.hit(b"a", 0.0, 0.0)
    f.evicted(b"a")
    admit(f, b"a", 0.0, priority=3.0)  # put back with a rule's priority: its old reads no longer describe it
    f.forget(b"a")
    assert admit(f, b"a", 0.0, value=1.0) == pytest.approx(f.probation)
