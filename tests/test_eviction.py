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


def test_reads_lift_a_priority_above_the_floor_again():
    f = Frequency()
    assert f.admit(b"a", 10.0 + 2.0, 10.0) == pytest.approx(10.0 + 2.0 * f.probation)  # never seen: on probation
    assert f.hit(b"a", 0.0, 15.0) == 15.0 + 2.0 * 2  # one read: floor now + value * (1 + hits)
    assert f.hit(b"a", 0.0, 15.0) == 15.0 + 2.0 * 3
    assert refreshed_priority(1.0, 2.0, 3) == 9.0


def test_an_evicted_block_comes_back_with_its_hits():
    f = Frequency()
    f.admit(b"a", 3.0, 1.0)
    f.hit(b"a", 0.0, 1.0)
    f.evicted(b"a")
    assert f.admit(b"a", 3.0, 1.0) == 1.0 + 2.0 * (1 + 2)  # asked for again: its one read plus this put
    f.forget(b"a")
    assert f.admit(b"a", 3.0, 1.0) == pytest.approx(1.0 + 2.0 * f.probation)  # deleted: no history


def test_lru_priorities_are_left_alone():
    f = Frequency()
    assert f.admit(b"a", 0.0, 0.0) == 0.0 and f.hit(b"a", 0.0, 0.0) == 0.0
    assert f.admit(b"b", 5.0, 7.0) == 5.0  # below the floor (a rule's low priority): unchanged


def test_the_ghost_history_is_bounded():
    f = Frequency(history=1)
    for i in range(500):
        slot = i.to_bytes(4, "big")
        f.admit(slot, 2.0, 1.0)
        f.evicted(slot)
    assert len(f._ghost) == 64  # history * max(64, held)
