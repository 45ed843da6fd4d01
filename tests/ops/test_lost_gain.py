"""Reuse lost to fallbacks is a measured quantity (issue 30, build 3): per reason, and the gain given up."""

from __future__ import annotations

import threading

import attrs

from nexuskv import Kernel, KernelConfig, PlanAction
from nexuskv.ops.lost_gain import LostGain
from tests.conftest import SECRET, make_request, run_threads


def _kernel() -> Kernel:
    cfg = KernelConfig(node="n1", deadline_ms=60_000.0, tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})
    return Kernel(cfg, secret=SECRET)


def test_a_fallback_that_could_have_reused_is_charged_the_gain_a_plan_predicts():
    with _kernel() as k:
        req = make_request(range(64 * 16))
        k.commit(req, [bytes(256)] * len(k.keys(req)))
        assert k.flush(10)
        whole = k.plan(req)  # what the plan is with time enough
        assert whole.action == PlanAction.MATERIALIZE and whole.predicted.gain_ms > 0
        k.config = attrs.evolve(k.config, deadline_ms=1e-9, deadline_fraction=0.0)  # the kernel's own budget: ~0
        k.reads.config = k.config
        late = k.plan(make_request(range(64 * 16), request_id="late"))
        empty = k.plan(make_request(range(900_000, 900_064), request_id="empty"))
        assert late.reasons[0].startswith("fail-open: deadline") and empty.action == PlanAction.RECOMPUTE
        asked = k.plan(make_request(range(64 * 16), request_id="asked"), deadline_ms=0.0)  # the caller's own deadline
        assert asked.reasons[0].startswith("fail-open: deadline")
        assert k.reads.lost.drain(10)
        got = k.reads.lost.snapshot()
        assert got == {"deadline": {"fallbacks": 3, "judged": 2, "unjudged": 1,  # the caller's own: counted, not judged
                                    "lost_gain_ms": round(whole.predicted.gain_ms, 3)}}  # nothing held for `empty`
        assert k.metrics.status()["lost_gain"] == got


def test_many_threads_falling_back_count_exactly_and_a_full_queue_never_blocks():
    gate = threading.Event()

    def judge(request):
        gate.wait(10)  # the judging thread is held: the queue fills
        return 1.5

    lost = LostGain(judge)
    run_threads(lambda i: [lost.fell_back(object(), "deadline" if n % 2 else "error") for n in range(100)], 8)
    snap = lost.snapshot()
    assert snap["deadline"]["fallbacks"] == snap["error"]["fallbacks"] == 400  # every fallback counted
    gate.set()
    assert lost.drain(10)
    snap = lost.snapshot()
    judged = snap["deadline"]["judged"] + snap["error"]["judged"]
    assert 0 < judged <= 50 and snap["deadline"]["lost_gain_ms"] + snap["error"]["lost_gain_ms"] == 1.5 * judged
    assert snap["deadline"]["unjudged"] + snap["error"]["unjudged"] == 800 - judged  # dropped ones say so
    lost.close()
    lost.fell_back(object(), "deadline")  # after close: counted, never judged, never blocks
    assert lost.snapshot()["deadline"]["fallbacks"] == 401


def test_a_judge_that_raises_leaves_the_fallback_unjudged():
    lost = LostGain(lambda request: 1 / 0)
    lost.fell_back(object(), "error")
    assert lost.drain(10)
    assert lost.snapshot() == {"error": {"fallbacks": 1, "judged": 0, "unjudged": 1, "lost_gain_ms": 0.0}}
    lost.close()


def test_judging_a_fallback_never_takes_a_half_open_breakers_one_trial():
    """Review: hindsight planned through `Health.allow`, so it took the trial a real plan needed after a cooldown."""
    import time

    cfg = KernelConfig(node="n1", deadline_ms=60_000.0, breaker_cooldown_s=0.01,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(64 * 4))
        k.commit(req, [bytes(256)] * len(k.keys(req)))
        assert k.flush(10)
        for _ in range(3):
            k.health.breaker("dram").failure("disk on fire")
        assert k.health.breaker("dram").state == "open"
        time.sleep(0.05)  # past the cooldown: the next allow() is the one trial
        assert k.reads.hindsight(req) == 0.0  # judged with the tier unusable, and nothing changed
        assert k.health.breaker("dram").state == "open"
        assert k.health.allow("dram") and k.health.breaker("dram").state == "half-open"  # the trial is a real plan's
