"""Redis killed, frozen or absent: misses and recompute within the timeouts, never a hung call; then recovery."""

import os
import signal
import time

import pytest
from _tier_redis_helpers import SECRET, describe, eventually, keyed, make_request, payload, slot

from nexuskv import Kernel, KernelConfig, PlanAction
from nexuskv_tier_redis import RedisStore, RedisTierError

HANG_S = 10.0  # "did not hang": far above every timeout configured here, far below a hung socket


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def kernel_on(server, prefix) -> Kernel:
    tiers = {"dram": {"store": "dram", "capacity_bytes": "1MiB"},
             "redis": {"store": "redis", "url": server.url, "prefix": prefix, "capacity_bytes": "64MiB",
                       "connect_timeout_s": 0.5, "read_timeout_s": 1.0, "down_backoff_s": 0.2}}  # fmt: skip
    # No prefetch and no promotion on hit: either would copy blocks into dram, and plans would stop asking redis.
    cfg = KernelConfig(node="n1", tiers=tiers, breaker_threshold=2, breaker_cooldown_s=0.5, load_timeout_ms=2000,
                       prefetch_max_tasks=0, promote_on_hit=False)  # fmt: skip
    return Kernel(cfg, secret=SECRET)


def put_all(k: Kernel, req) -> list[bytes]:
    keys = k.keys(req)
    for b in range(len(keys)):
        data = bytes([b]) * 4096
        assert k.put(k.describe(req, b, data, tier="redis", keys=keys), data)
    return keys


def test_redis_killed_and_restarted_mid_run(own_redis_server, prefix):
    srv = own_redis_server
    req = make_request(range(320))
    with kernel_on(srv, prefix) as k:
        keys = put_all(k, req)
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.MATERIALIZE and {s.tier for s in plan.spans} == {"redis"}
        got = k.materialize(plan, req, keys=keys)
        assert got.complete and bytes(got.states[(3, 0)].payload) == bytes([3]) * 4096

        srv.kill()  # SIGKILL mid-run: the pooled connections die with it
        for _ in range(2):  # the breaker's threshold
            plan, took = timed(k.plan, req, keys=keys)
            assert plan.action == PlanAction.MATERIALIZE  # the breaker is still closed: the index is believed
            got, took = timed(k.materialize, plan, req, keys=keys)
            assert took < HANG_S
            assert got.tokens == 0 and got.states == {} and "unavailable" in got.reason
        assert k.health.breaker("redis").state == "open"
        plan, took = timed(k.plan, req, keys=keys)
        assert plan.action == PlanAction.RECOMPUTE and took < HANG_S  # redis skipped while its breaker is open
        with pytest.raises(RedisTierError):
            k.tiers["redis"].get(slot_of_block(keys, 0))  # direct calls fail fast too

        srv.restart()  # same port, empty: nothing was persisted
        plan = eventually(lambda: _materializing(k, req, keys))  # the breaker half-opens: one trial
        got = k.materialize(plan, req, keys=keys)
        assert got.tokens == 0 and "missing" in got.reason  # the restarted server lost the state: a miss
        assert k.match(req, keys).longest() == 0  # ... and the index forgot it (reported as evictions)
        assert len(k.tiers["redis"]) == 0

        put_all(k, req)  # the tier takes writes again
        plan = eventually(lambda: _materializing(k, req, keys))
        got = k.materialize(plan, req, keys=keys)
        assert got.complete and bytes(got.states[(7, 0)].payload) == bytes([7]) * 4096
        assert k.health.breaker("redis").state == "closed"


def slot_of_block(keys, b):
    return keys[b] + b"\x00"


def _materializing(k, req, keys):
    plan = k.plan(req, keys=keys)
    return plan if plan.action == PlanAction.MATERIALIZE else None


def test_frozen_server_costs_the_read_timeout_not_more(own_redis_server, prefix):
    srv = own_redis_server
    store = keyed(RedisStore(url=srv.url, prefix=prefix, read_timeout_s=0.3, down_backoff_s=0.3))
    data = payload(1000)
    store.put(slot(1), data, describe(slot(1), data))
    os.kill(srv.proc.pid, signal.SIGSTOP)  # accepts connections (the kernel's backlog), never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(RedisTierError, match="unavailable"):
            store.get(slot(1))
        assert time.monotonic() - t0 < HANG_S  # the 0.3 s read timeout, not a hung socket
        with pytest.raises(RedisTierError, match="retrying in"):
            store.put(slot(2), data, describe(slot(2), data))  # fails at once while the server is known down
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    got = eventually(lambda: _quiet_get(store, slot(1)))
    assert bytes(got.payload) == data  # same server (same run id): nothing lost, nothing re-read
    store.close()


def test_frozen_server_in_a_kernel_gives_recompute_within_the_load_timeout(own_redis_server, prefix):
    srv = own_redis_server
    with kernel_on(srv, prefix) as k:
        req = make_request(range(160))
        keys = put_all(k, req)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            plan = k.plan(req, keys=keys)
            got, took = timed(k.materialize, plan, req, keys=keys, timeout_ms=100)
            assert got.tokens == 0 and took < HANG_S
            assert k.health.breaker("redis").state == "open"  # a timeout opens it at once
            assert k.plan(req, keys=keys).action == PlanAction.RECOMPUTE
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)


def test_server_down_at_start_then_up(own_redis_server, prefix):
    srv = own_redis_server
    data = payload(100)
    first = keyed(RedisStore(url=srv.url, prefix=prefix))
    first.put(slot(1), data, describe(slot(1), data))
    first.close()
    srv.kill()
    store, took = timed(lambda **kw: keyed(RedisStore(**kw)), url=srv.url, prefix=prefix, down_backoff_s=0.1)
    assert took < HANG_S and len(store) == 0  # starts (empty) instead of failing the kernel's start
    srv.start()
    data2 = payload(50)
    eventually(lambda: _quiet(store.put, slot(2), data2, describe(slot(2), data2)))
    assert bytes(store.get(slot(2)).payload) == data2
    assert store.used_bytes() == 50  # the restarted server is empty: slot 1 is gone, and not counted
    store.close()


def _quiet(fn, *args):
    try:
        return fn(*args)
    except RedisTierError:
        return None


def _quiet_get(store, s):
    return _quiet(store.get, s)


def test_a_full_server_refuses_the_put_instead_of_failing(own_redis_server, prefix):
    own_redis_server.client().config_set("maxmemory", 4 << 20)
    own_redis_server.client().config_set("maxmemory-policy", "noeviction")
    store = keyed(RedisStore(url=own_redis_server.url, prefix=prefix))
    data = payload(8 << 20)
    assert not store.put(slot(1), data, describe(slot(1), data))
    assert len(store) == 0 and store.used_bytes() == 0
    store.close()
