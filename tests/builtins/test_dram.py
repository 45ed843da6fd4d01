import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv import TierStore
from nexuskv.builtins.dram import DramStore
from tests.contracts.test_contracts import next_descriptor

D = next_descriptor()


def s(i: int) -> bytes:
    return i.to_bytes(17, "big")


def test_is_a_tier_store():
    assert isinstance(DramStore(100), TierStore)


def test_put_get_delete_zero_copy():
    st_ = DramStore(100)
    assert st_.put(s(1), b"abc", D)
    got = st_.get(s(1))
    assert bytes(got.payload) == b"abc" and got.descriptor == D
    assert isinstance(got.payload, memoryview) and got.payload.readonly
    assert s(1) in st_ and st_.used_bytes() == 3
    assert st_.delete(s(1)) and not st_.delete(s(1))
    assert st_.get(s(1)) is None and st_.used_bytes() == 0


def test_evicts_lowest_priority_then_lru_and_calls_back():
    evicted = []
    st_ = DramStore(30)
    st_.set_eviction_callback(lambda slot, desc, data: evicted.append(slot))
    st_.put(s(1), b"x" * 10, D, priority=5)
    st_.put(s(2), b"x" * 10, D, priority=1)
    st_.put(s(3), b"x" * 10, D, priority=1)
    st_.put(s(2), b"x" * 10, D, priority=1)  # put again: s(3) is now the least recently used among priority 1
    assert st_.put(s(4), b"x" * 10, D, priority=1)
    assert evicted == [s(3)]
    assert st_.put(s(5), b"x" * 20, D, priority=2)
    assert evicted == [s(3), s(2), s(4)]
    assert set(st_.slots()) == {s(1), s(5)} and st_.used_bytes() == 30


def test_refuses_what_cannot_fit_without_evicting_higher_priority():
    evicted = []
    st_ = DramStore(20)
    st_.set_eviction_callback(lambda slot, desc, data: evicted.append(slot))
    st_.put(s(1), b"x" * 15, D, priority=9)
    assert not st_.put(s(2), b"x" * 10, D, priority=1)
    assert not st_.put(s(3), b"x" * 21, D, priority=99)
    assert evicted == [] and s(1) in st_


def test_replacing_a_slot_that_no_longer_fits_keeps_the_old_payload():
    st_ = DramStore(20)
    st_.put(s(1), b"x" * 10, D, priority=9)
    st_.put(s(2), b"y" * 10, D, priority=9)
    assert not st_.put(s(1), b"z" * 15, D, priority=0)
    assert bytes(st_.get(s(1)).payload) == b"x" * 10


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 40), st.integers(0, 3)), max_size=60))
def test_never_exceeds_capacity_and_accounting_is_exact(ops):
    evicted = []
    st_ = DramStore(100)
    st_.set_eviction_callback(lambda slot, desc, data: evicted.append(slot))
    for key, size, prio in ops:
        st_.put(s(key), bytes(size), D, prio)
        assert st_.used_bytes() <= 100
        assert st_.used_bytes() == sum(len(st_.get(k).payload) for k in list(st_.slots()))
    assert not set(evicted) - {s(k) for k, _, _ in ops}


def test_thread_safe_puts():
    st_ = DramStore(10_000)

    def work(base):
        for i in range(200):
            st_.put(s(base + i), b"x" * 10, D)

    ts = [threading.Thread(target=work, args=(n * 1000,)) for n in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert st_.used_bytes() == 8000 and len(st_) == 800


def test_bad_capacity():
    with pytest.raises(ValueError):
        DramStore(0)


def test_ttl_expires_on_read_and_reports_like_an_eviction(monkeypatch):
    import nexuskv.builtins.dram as dram

    now = [100.0]
    monkeypatch.setattr(dram.time, "monotonic", lambda: now[0])
    reported = []
    st_ = DramStore(100)
    st_.set_eviction_callback(lambda slot, desc, data: reported.append((slot, data)))
    assert st_.put(s(1), b"abc", D, ttl_s=5.0)
    assert st_.put(s(2), b"def", D)  # no TTL: kept
    now[0] += 4.0
    assert st_.get(s(1)) is not None and reported == []
    now[0] += 2.0
    assert st_.get(s(1)) is None and reported == [(s(1), None)]
    assert st_.used_bytes() == 3 and st_.get(s(2)) is not None
    assert st_.put(s(1), b"abc", D, ttl_s=5.0) and st_.put(s(1), b"abc", D)  # a later put without TTL clears it
    now[0] += 60.0
    assert st_.get(s(1)) is not None


def test_a_chain_larger_than_the_store_keeps_its_prefix_whatever_the_priorities():
    from nexuskv.testing import prefix_problems

    assert prefix_problems(lambda capacity: DramStore(capacity)) == []


def test_a_block_read_often_outlives_blocks_read_once_and_never():
    """GreedyDual-Size-Frequency: with priorities above the floor, reads count, not only recency."""
    st_ = DramStore(3)
    for i in range(3):
        assert st_.put(s(i), b"x", D, value=1.0)  # the kernel's default priority: floor + value
    for _ in range(3):
        st_.get(s(0))  # read three times, then the others are read later (more recently)
    st_.get(s(1))
    order = []
    for i in (3, 4, 5):  # newcomers valuable enough to push out anything read so far
        before = set(st_.slots())
        assert st_.put(s(i), b"x", D, value=100.0)
        order.extend(before - set(st_.slots()))
    assert order == [s(2), s(1), s(0)]  # never read, then read once, then read three times


def test_explicit_priorities_keep_their_order_whatever_the_reads():
    st_ = DramStore(2)
    st_.put(s(0), b"x", D, priority=2.0)
    st_.put(s(1), b"x", D, priority=10.0)
    for _ in range(5):
        st_.get(s(0))  # a place rule said 2: reads do not lift it above 10
    assert st_.put(s(2), b"x", D, priority=5.0)
    assert s(0) not in st_ and s(1) in st_


def test_the_value_is_added_to_the_floor_the_store_has_when_it_stores():
    st_ = DramStore(1)
    st_.put(s(0), b"x", D, priority=7.0)
    st_.put(s(1), b"x", D, priority=7.5)  # evicts s(0): the floor is 7 now
    assert st_.floor == 7.0
    st_.delete(s(1))
    st_.put(s(2), b"x", D, priority=0.0, value=4.0)  # priced against the floor of 7, whatever the caller read
    assert st_._items[s(2)][2] == pytest.approx(7.0 + 4.0 * 0.3)


def test_with_equal_priorities_it_stays_least_recently_used():
    st_ = DramStore(2)
    st_.put(s(0), b"x", D)
    st_.put(s(1), b"x", D)
    for _ in range(5):
        st_.get(s(0))
    st_.get(s(1))
    st_.put(s(2), b"x", D)
    assert s(0) not in st_ and s(1) in st_  # LRU mode: frequency plays no part


def test_a_refused_re_put_keeps_the_old_copy_evictable():
    st_ = DramStore(20)
    st_.put(s(1), b"x" * 10, D, priority=1.0)
    st_.put(s(2), b"x" * 10, D, priority=9.0)
    assert not st_.put(s(1), b"y" * 15, D, priority=1.0)  # bigger: would need s(2) (worth more) to go
    assert bytes(st_.get(s(1)).payload) == b"x" * 10  # the old copy is kept...
    assert st_.put(s(3), b"z" * 10, D, priority=5.0)  # ...and is still the one evicted when room is needed
    assert s(1) not in st_ and s(2) in st_ and s(3) in st_


def test_read_counting_bookkeeping_stays_consistent_under_threads():
    """Eight threads put (with values and with explicit priorities), read and delete on a store small enough to
    evict all the time; afterwards every held payload has exactly one frequency entry and a live heap entry."""
    import random

    st_ = DramStore(400)

    def work(seed):
        rng = random.Random(seed)
        for _ in range(1500):
            k, op = rng.randrange(120), rng.random()
            if op < 0.45:
                st_.put(s(k), b"x" * rng.randint(5, 30), D, value=rng.choice([0.5, 1.0, 2.0]))
            elif op < 0.55:
                st_.put(s(k), b"x" * 10, D, priority=rng.random())
            elif op < 0.9:
                st_.get(s(k))
            else:
                st_.delete(s(k))

    ts = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    with st_._lock:
        held = set(st_._items)
        assert set(st_._freq._held) == held
        assert st_._used == sum(len(v[0]) for v in st_._items.values()) <= st_.capacity_bytes
        live = {(p, q, k) for p, q, k in st_._heap}
        assert all((v[2], v[3], k) in live for k, v in st_._items.items())


def test_a_refused_re_put_leaves_one_heap_entry_for_the_kept_copy():
    st_ = DramStore(30)
    st_.put(s(1), b"x" * 10, D, priority=9.0)  # its heap entry is never popped while room is sought below
    st_.put(s(2), b"x" * 10, D, priority=1.0)
    assert not st_.put(s(1), b"y" * 25, D, priority=0.5)  # would need s(2) and more: refused, old copy kept
    assert [e for e in st_._heap if e[2] == s(1) and e[1] == st_._items[s(1)][3]] == [(9.0, st_._items[s(1)][3], s(1))]
    assert st_.put(s(3), b"z" * 30, D, priority=10.0)  # evicts both, each once
    assert set(st_.slots()) == {s(3)}
