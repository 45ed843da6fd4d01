"""mooncake_master killed, frozen or absent: misses and recompute, never Mooncake's own retry loops; then recovery."""

import os
import signal
import time

import pytest
from _tier_mooncake_helpers import (
    HANG_S,
    describe,
    eventually,
    kernel_from_config,
    keyed,
    make_request,
    payload,
    slot,
    timed,
)

from nexuskv import PlanAction
from nexuskv_tier_mooncake import MooncakeStore, MooncakeTierError, release_abandoned


def put_blocks(k, req) -> list[bytes]:
    keys = k.keys(req)
    for b in range(len(keys)):
        data = bytes([b]) * 4096
        assert k.put(k.describe(req, b, data, tier="mc", keys=keys), data)
    return keys


def _materializing(k, req, keys):
    plan = k.plan(req, keys=keys)
    return plan if plan.action == PlanAction.MATERIALIZE else None


def _stored_again(k, req, keys):
    try:
        return all(k.put(k.describe(req, b, bytes([b]) * 4096, tier="mc", keys=keys), bytes([b]) * 4096)
                   for b in range(len(keys)))  # fmt: skip
    except MooncakeTierError:
        return False


def test_master_killed_mid_run_gives_recompute_then_recovers(tmp_path, own_mooncake_master, prefix):
    master = own_mooncake_master
    req = make_request(range(320))
    with kernel_from_config(tmp_path, master.address, prefix, down_backoff_s=0.2) as k:
        keys = put_blocks(k, req)
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.MATERIALIZE and {s.tier for s in plan.spans} == {"mc"}
        got = k.materialize(plan, req, keys=keys)
        assert got.complete and bytes(got.states[(3, 0)].payload) == bytes([3]) * 4096
        del got

        master.kill()  # SIGKILL mid-run: every object's metadata dies with it
        for _ in range(2):  # the breaker's threshold
            plan = k.plan(req, keys=keys)
            assert plan.action == PlanAction.MATERIALIZE  # the breaker is still closed: the index is believed
            got, took = timed(k.materialize, plan, req, keys=keys)
            assert took < HANG_S  # the store probed the master's port; Mooncake's retries never ran
            assert got.tokens == 0 and got.states == {} and "unavailable" in got.reason
        assert k.health.breaker("mc").state == "open"
        plan, took = timed(k.plan, req, keys=keys)
        assert plan.action == PlanAction.RECOMPUTE and took < HANG_S  # mooncake skipped while its breaker is open
        with pytest.raises(MooncakeTierError, match="unavailable"):
            k.tiers["mc"].get(keys[0] + b"\x00")  # direct calls fail fast too

        master.start()  # same ports, empty: nothing was persisted
        plan = eventually(lambda: _materializing(k, req, keys))  # the breaker half-opens: one trial
        got = k.materialize(plan, req, keys=keys)
        assert got.tokens == 0  # the restarted master lost the objects: a miss, never wrong state
        assert eventually(lambda: k.match(req, keys).longest() == 0)  # ... and the index forgot them
        assert eventually(lambda: k.tiers["mc"].sync() >= 0 and len(k.tiers["mc"]) == 0)  # all reported gone

        assert eventually(lambda: _stored_again(k, req, keys))  # the client re-registered its segment
        plan = eventually(lambda: _materializing(k, req, keys))
        got = k.materialize(plan, req, keys=keys)
        assert got.complete and bytes(got.states[(7, 0)].payload) == bytes([7]) * 4096
        assert k.health.breaker("mc").state == "closed"


def test_a_store_started_while_the_master_is_down_connects_later(own_mooncake_master, prefix):
    master = own_mooncake_master
    master.kill()
    store, took = timed(lambda **kw: keyed(MooncakeStore(**kw)), master=master.address, prefix=prefix,
                        capacity_bytes=16 << 20, local_buffer_bytes=16 << 20, down_backoff_s=0.1)  # fmt: skip
    try:
        assert took < HANG_S and len(store) == 0  # starts (empty) instead of failing the kernel's start
        d = payload(1000)
        with pytest.raises(MooncakeTierError, match="master does not answer"):
            store.put(slot(1), d, describe(slot(1), d))
        master.start()
        assert eventually(lambda: _quiet(store.put, slot(1), d, describe(slot(1), d)))
        assert bytes(store.get(slot(1)).payload) == d
    finally:
        _, took = timed(store.close)
        assert took < HANG_S


def test_a_frozen_master_costs_the_rpc_timeout_not_more(own_mooncake_master, prefix):
    master = own_mooncake_master
    store = keyed(MooncakeStore(master=master.address, prefix=prefix, capacity_bytes=16 << 20,
                                local_buffer_bytes=16 << 20, rpc_timeout_s=0.5, down_backoff_s=0.3))  # fmt: skip
    d = payload(1000)
    assert store.put(slot(1), d, describe(slot(1), d))
    os.kill(master.proc.pid, signal.SIGSTOP)  # its port still accepts connections (the backlog), nothing answers
    try:
        t0 = time.monotonic()
        with pytest.raises(MooncakeTierError, match="unavailable"):
            store.put(slot(2), d, describe(slot(2), d))
        assert time.monotonic() - t0 < HANG_S  # Mooncake's request deadline (rpc_timeout_s), not its 30 s default
        with pytest.raises(MooncakeTierError, match="retrying in"):
            store.get(slot(1))  # fails at once while the master is known down
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    got = eventually(lambda: _quiet(store.get, slot(1)))
    assert bytes(got.payload) == d  # the same master: nothing lost
    assert eventually(lambda: _quiet(store.put, slot(3), d, describe(slot(3), d)))
    store.close()


def test_close_after_the_master_died_is_bounded(own_mooncake_master, prefix):
    master = own_mooncake_master
    store = keyed(MooncakeStore(master=master.address, prefix=prefix, capacity_bytes=16 << 20,
                                local_buffer_bytes=16 << 20))  # fmt: skip
    d = payload(100)
    assert store.put(slot(1), d, describe(slot(1), d))
    master.kill()
    with pytest.raises(MooncakeTierError):
        store.get(slot(1))
    _, took = timed(store.close)  # Mooncake's own close retries the dead master for many seconds
    assert took < HANG_S
    store.close()  # twice: a no-op
    assert release_abandoned() >= 1  # its client is left behind (its threads ping the dead master)...
    master.start()
    _, took = timed(lambda: eventually(lambda: release_abandoned() == 0))
    assert took < HANG_S  # ... until the master answers again: then its close is quick


def test_a_new_client_of_a_master_closes_the_clients_left_behind_with_it(own_mooncake_master, prefix):
    master = own_mooncake_master
    kw = dict(master=master.address, prefix=prefix, capacity_bytes=16 << 20, local_buffer_bytes=16 << 20)
    store = keyed(MooncakeStore(**kw))
    d = payload(100)
    assert store.put(slot(1), d, describe(slot(1), d))
    master.kill()
    store.close()
    assert release_abandoned() >= 1
    master.start()
    again = keyed(MooncakeStore(**kw, down_backoff_s=0.1))
    try:
        assert eventually(lambda: _quiet(again.put, slot(2), d, describe(slot(2), d)))  # connects: closes the other
        assert release_abandoned(master.address) == 0
    finally:
        again.close()


def _quiet(fn, *args):
    try:
        return fn(*args)
    except MooncakeTierError:
        return None
