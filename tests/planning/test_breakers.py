import threading

import pytest

from nexuskv.planning.breakers import Breaker, Health


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock():
    return FakeClock()


def test_new_breaker_is_closed_and_allows(clock):
    b = Breaker("disk", clock=clock)
    assert b.state == "closed" and b.allow()
    assert b.failures == 0 and b.trips == 0 and b.last_error == ""


def test_opens_after_threshold_consecutive_failures(clock):
    b = Breaker("disk", threshold=3, cooldown_s=5.0, clock=clock)
    b.failure("e1")
    b.failure("e2")
    assert b.state == "closed" and b.allow()
    b.failure("e3")
    assert b.state == "open"
    assert not b.allow()
    assert b.trips == 1 and b.last_error == "e3" and b.failures == 3
    assert b.opened_at == clock.t


def test_success_resets_the_failure_count(clock):
    b = Breaker("disk", threshold=3, clock=clock)
    b.failure("e1")
    b.failure("e2")
    b.success()
    assert b.failures == 0
    b.failure("e3")
    b.failure("e4")
    assert b.state == "closed"  # not three in a row
    b.failure("e5")
    assert b.state == "open"


def test_severe_failure_opens_at_once(clock):
    b = Breaker("redis", threshold=10, clock=clock)
    b.failure("checksum mismatch", severe=True)
    assert b.state == "open" and not b.allow()
    assert b.trips == 1 and b.last_error == "checksum mismatch"


def test_cooldown_then_half_open(clock):
    b = Breaker("disk", threshold=1, cooldown_s=5.0, clock=clock)
    b.failure("boom")
    clock.advance(4.999)
    assert not b.allow() and b.state == "open"
    clock.advance(0.001)
    assert b.allow()
    assert b.state == "half-open"


def test_half_open_success_closes(clock):
    b = Breaker("disk", threshold=1, cooldown_s=5.0, clock=clock)
    b.failure("boom")
    clock.advance(5.0)
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.failures == 0 and b.allow()
    assert b.trips == 1


def test_half_open_failure_reopens_and_counts_a_trip(clock):
    b = Breaker("disk", threshold=3, cooldown_s=5.0, clock=clock)
    b.failure("x", severe=True)
    clock.advance(5.0)
    assert b.allow() and b.state == "half-open"
    b.failure("still broken")  # one failure is enough in half-open, below the threshold
    assert b.state == "open" and b.trips == 2 and b.last_error == "still broken"
    assert b.opened_at == clock.t
    assert not b.allow()  # a fresh cooldown started
    clock.advance(5.0)
    assert b.allow()


def test_failures_while_open_do_not_count_more_trips(clock):
    b = Breaker("disk", threshold=1, cooldown_s=5.0, clock=clock)
    b.failure("a")
    b.failure("b")
    b.failure("c", severe=True)
    assert b.trips == 1 and b.state == "open"


def test_trips_count_every_opening(clock):
    b = Breaker("disk", threshold=2, cooldown_s=1.0, clock=clock)
    for i in range(3):
        b.failure("a")
        b.failure("b")
        assert b.state == "open"
        clock.advance(1.0)
        assert b.allow()
        b.success()
        assert b.trips == i + 1


def test_half_open_lets_only_one_trial_through(clock):
    b = Breaker("disk", threshold=1, cooldown_s=5.0, clock=clock)
    b.failure("boom")
    clock.advance(5.0)
    assert b.allow()
    assert not b.allow()  # the trial is out; others wait for its outcome


def test_concurrent_failures_trip_once():
    b = Breaker("disk", threshold=50)
    threads = [threading.Thread(target=lambda: [b.failure("x") for _ in range(100)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.failures == 800 and b.trips == 1 and b.state == "open"


# ------------------------------------------------------------------------------------------------ Health


def test_health_allows_unknown_paths_without_creating_breakers(clock):
    h = Health(clock=clock)
    assert h.allow("never-seen")
    assert h.snapshot() == {}


def test_health_creates_one_breaker_per_name_with_its_settings(clock):
    h = Health(threshold=2, cooldown_s=7.0, clock=clock)
    b = h.breaker("disk")
    assert h.breaker("disk") is b
    assert (b.name, b.threshold, b.cooldown_s) == ("disk", 2, 7.0)
    assert h.breaker("redis") is not b


def test_health_allow_follows_the_breaker(clock):
    h = Health(threshold=2, cooldown_s=7.0, clock=clock)
    h.breaker("disk").failure("a")
    assert h.allow("disk")
    h.breaker("disk").failure("b")
    assert not h.allow("disk")
    assert h.allow("dram")
    clock.advance(7.0)
    assert h.allow("disk")


def test_health_snapshot(clock):
    h = Health(threshold=3, clock=clock)
    h.breaker("redis").failure("timeout", severe=True)
    h.breaker("disk").failure("eio")
    h.breaker("dram")
    snap = h.snapshot()
    assert list(snap) == ["disk", "dram", "redis"]  # sorted
    assert snap["redis"] == {"state": "open", "failures": 1, "trips": 1, "last_error": "timeout"}
    assert snap["disk"] == {"state": "closed", "failures": 1, "trips": 0, "last_error": "eio"}
    assert snap["dram"] == {"state": "closed", "failures": 0, "trips": 0, "last_error": ""}
