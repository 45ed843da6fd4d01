"""The planning budget (issue 30, build 1): sized by what a request stands to gain, between a floor and a cap."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from nexuskv import CostModel, Kernel, KernelConfig, PlanAction, Slo
from nexuskv.planning.budget import budget_for
from tests.conftest import SECRET, make_request

COST = CostModel()  # the documented default profile: 1k tokens ~122 ms of prefill, 32k ~13.9 s


def test_a_short_request_keeps_a_sub_millisecond_budget_and_a_long_one_gets_milliseconds(monkeypatch):
    monkeypatch.delenv("NEXUSKV_DEADLINE_MS", raising=False)  # the tests' generous floor: the defaults here
    cfg = KernelConfig()
    got = {n: budget_for(make_request(range(n)), cfg, COST) for n in (64, 1024, 4096, 9000, 32768)}
    assert got[64].ms == cfg.deadline_ms == 0.5 and got[64].why.startswith("the floor")
    assert 0.5 < got[1024].ms < 1.0  # 0.8% of 122 ms: a short request keeps a sub-millisecond budget
    assert abs(got[4096].ms - 0.008 * COST.recompute_ms(4096)) < 1e-9 and 4.5 < got[4096].ms < 5.5
    assert got[32768].ms == cfg.deadline_cap_ms == 50.0 and got[32768].why.startswith("the cap")
    assert got[4096].reason() == "budget 4.87 ms (0.8% of 609 ms predicted prefill)"


@given(st.integers(0, 1 << 20), st.integers(0, 1 << 20))
def test_the_budget_grows_with_the_stakes_and_stays_between_floor_and_cap(a, b):
    cfg = KernelConfig(deadline_ms=0.25, deadline_fraction=0.01, deadline_cap_ms=15.0)
    lo, hi = sorted((a, b))
    small, large = (budget_for(make_request(range(n)), cfg, COST).ms for n in (lo, hi))
    assert 0.25 <= small <= large <= 15.0


@given(st.integers(0, 1 << 21))
def test_the_stake_is_the_cost_models_recompute_time(n):
    cfg = KernelConfig(deadline_ms=1e-9, deadline_fraction=1.0, deadline_cap_ms=1e12, max_deadline_ms=1e12)
    got = budget_for(make_request(range(n)), cfg, COST).ms
    assert got == max(1e-9, COST.recompute_ms(n)) or abs(got - COST.recompute_ms(n)) <= 1e-9 * COST.recompute_ms(n)


def test_a_callers_deadline_or_a_requests_slo_replaces_the_rule_the_slo_never_above_the_maximum():
    cfg = KernelConfig(max_deadline_ms=50.0)
    req = make_request(range(32768))
    assert budget_for(req, cfg, COST, deadline_ms=0.1).ms == 0.1
    assert budget_for(attrs.evolve(req, slo=Slo(deadline_ms=7.0)), cfg, COST).ms == 7.0
    capped = budget_for(attrs.evolve(req, slo=Slo(deadline_ms=3_600_000)), cfg, COST)
    assert capped.ms == 50.0 and "capped at max_deadline_ms" in capped.why
    assert budget_for(req, KernelConfig(deadline_ms=600.0), COST).ms == 600.0  # a floor above the cap wins
    over = budget_for(req, KernelConfig(deadline_ms=60_000.0), COST)  # ... never past max_deadline_ms (1 s)
    assert over.ms == 1000.0 and over.why.endswith("capped at max_deadline_ms")


def test_every_plan_says_its_budget_and_a_fallback_says_why_it_had_that_budget():
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}}, deadline_ms=0.5,
                       deadline_cap_ms=30_000.0, deadline_fraction=1.0)  # no busy machine misses it  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        plan = k.plan(make_request(range(4096)))
        assert plan.reasons[0].startswith("budget ") and "predicted prefill" in plan.reasons[0]
        late = k.plan(make_request(range(4096), request_id="late"), deadline_ms=0.0)
        assert late.action == PlanAction.RECOMPUTE and late.reasons == ("fail-open: deadline 0 ms passed in keys",)
        gone = k.plan(make_request(range(64), request_id="gone", slo=Slo(deadline_ms=0.0)))
        assert gone.reasons[0].startswith("fail-open: deadline 0 ms passed in") and "slo.deadline_ms" in gone.reasons[0]


def test_a_busy_machine_stretches_the_rule_never_a_callers_deadline_nor_past_the_maximum():
    cfg = KernelConfig(deadline_ms=0.5, max_deadline_ms=100.0)
    req = make_request(range(4096))
    quiet, busy = budget_for(req, cfg, COST), budget_for(req, cfg, COST, slowdown=3.0)
    assert busy.ms == 3 * quiet.ms and busy.why.endswith("x3 for this machine's load")
    assert budget_for(req, cfg, COST, deadline_ms=0.2, slowdown=3.0).ms == 0.2
    assert budget_for(make_request(range(32768)), cfg, COST, slowdown=8.0).ms == 100.0


def test_the_read_path_learns_the_slowdown_from_its_own_plans():
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        reads = k.reads
        reads.slowdown = 1.0
        for _ in range(60):  # plans whose wall time is 4x their CPU time (descheduled three quarters of it)
            reads._observe(0.004, 0.001)
        assert 3.9 < reads.slowdown <= 4.0
        for _ in range(60):
            reads._observe(1.0, 0.001)  # a plan descheduled for a second: judged slow, not the machine 1000x slower
        assert reads.slowdown <= 8.0
        reads.slowdown = 1.0
        k.plan(make_request(range(64)))
        assert 1.0 <= reads.slowdown <= 8.0
