"""Reuse lost to fallbacks is a measured quantity (issue 30, build 3): per reason, and the gain given up."""

from __future__ import annotations

import threading

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
        late = k.plan(make_request(range(64 * 16), request_id="late"), deadline_ms=0.0)
        empty = k.plan(make_request(range(900_000, 900_064), request_id="empty"), deadline_ms=0.0)
        assert late.reasons[0].startswith("fail-open: deadline") and empty.action == PlanAction.RECOMPUTE
        assert k.reads.lost.drain(10)
        got = k.reads.lost.snapshot()
        assert got == {"deadline": {"fallbacks": 2, "judged": 2, "unjudged": 0,
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
    assert 0 < judged <= 257 and snap["deadline"]["lost_gain_ms"] + snap["error"]["lost_gain_ms"] == 1.5 * judged
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
