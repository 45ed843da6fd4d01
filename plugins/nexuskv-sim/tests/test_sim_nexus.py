"""The NexusKV strategy: Kernel.route on the cluster view, plans become fetches, links are learned."""

import time

import attrs
import pytest
from _sim_fakes import BLOCK_BYTES, FakeView, request, tiny_profile

from nexuskv_sim.api import Fetch
from nexuskv_sim.nexus import NexusKVStrategy
from nexuskv_sim.simulate import simulate
from nexuskv_sim.trace import TraceRecord

NODES = ("n0", "n1", "n2")


@pytest.fixture
def nexus():
    s = NexusKVStrategy(tiny_profile(per_token_ms=0.1))
    yield s
    s.close()


def test_it_runs_where_the_prefix_is_and_loads_it_from_that_nodes_tiers(nexus):
    view = FakeView(NODES, held={"n1": (2, 6, 10)})
    d = nexus.decide(request(0, list(range(12))), view)
    assert d.node == "n1"
    assert d.fetches == (Fetch("n1", "hbm", 0, 2), Fetch("n1", "dram", 2, 6), Fetch("n1", "disk", 6, 10))
    assert "n1: predicted TTFT" in d.reason


def test_a_busy_holder_loses_to_an_idle_node_that_pulls_from_it_over_the_network(nexus):
    view = FakeView(NODES, held={"n1": (10, 10, 10)}, load={"n1": {"queued": 200_000, "waiting": 20}})
    d = nexus.decide(request(0, list(range(12))), view)
    assert d.node != "n1"
    assert d.fetches == (Fetch("n1", "hbm", 0, 10),)  # from the peer's GPU memory, over the NIC


def test_requests_routed_since_the_last_report_count_as_queued(nexus):
    view = FakeView(NODES, now=5.0)  # the last reports are from t=0
    first = [nexus.decide(request(i, [100 * i + j for j in range(8)]), view).node for i in range(3)]
    assert sorted(first) == sorted(NODES)  # the reports show nothing yet: the scheduler spreads what it sent


def test_measured_transfers_change_what_it_plans(nexus):
    req = request(0, list(range(12)))
    view = FakeView(("n0",), held={"n0": (0, 0, 10)})
    assert nexus.decide(req, view).fetches == (Fetch("n0", "disk", 0, 10),)  # the prior: a 2 GB/s disk
    for _ in range(20):  # the disk turns out to take 10 s per block
        nexus.observe_transfer("disk", BLOCK_BYTES, 10_000.0, source="n0", tier="disk", node="n0")
    assert nexus.decide(request(1, list(range(12))), view).fetches == ()  # recomputing is cheaper now


def test_it_serves_a_whole_trace_in_the_simulator():
    records = [TraceRecord(i * 50.0, 4 * 512, 4, [1, 2, 3, 10 + i]) for i in range(30)]
    s = NexusKVStrategy(tiny_profile())
    try:
        res = simulate(records, [s], nodes=3, profile=tiny_profile())["nexuskv"]
        assert s.stats() == {"m": 0}  # no route failed open
    finally:
        s.close()
    assert res.completed == 30 and res.failed == 0
    assert res.reused_tokens >= 29 * 3 * 512 * 0.9  # the shared 3-block prefix is reused almost every time


def test_transfers_from_another_node_are_learned_per_peer(nexus):
    nexus.decide(request(0, [1]), FakeView(NODES))  # builds the model's kernel
    nexus.observe_transfer("pcie", BLOCK_BYTES, 7.0, source="n1", tier="hbm", node="n0")  # same host, other engine
    nexus.observe_transfer("pcie", BLOCK_BYTES, 3.0, source="n0", tier="dram", node="n0")
    links = nexus._kernels["m"].links.snapshot()
    assert set(links) == {"peer:n1", "dram"} and links["peer:n1"]["samples"] == 1


def test_a_request_every_node_is_excluded_from_is_refused_not_run(tmp_path):
    (tmp_path / "default.toml").write_text('[[route]]\nname = "nowhere"\nwhen = "request.tenant == \'locked\'"\n')
    records = [TraceRecord(i * 50.0, 2 * 512, 2, [1, 2 + i], tenant="locked" if i % 2 else "open")
               for i in range(6)]  # fmt: skip
    s = NexusKVStrategy(tiny_profile(), policies=str(tmp_path))
    try:
        res = simulate(records, [s], nodes=2, profile=tiny_profile())["nexuskv"]
    finally:
        s.close()
    assert res.rejected == 3 and res.completed == 3 and res.requests == 6
    assert res.slo_attainment == 0.5  # the refused ones never got a first token


def _judged(slow: bool):
    """The figures of one run on congested links whose estimates age out after 20 simulated ms (host time: 10 ms
    of sleep per decision when `slow`, a host under load)."""
    records = [TraceRecord(i * 15.0, 4 * 512, 4, [1, 2, 10 + i % 5, 20 + i]) for i in range(60)]
    s = NexusKVStrategy(tiny_profile(), links={"max_age_s": 0.02})
    if slow:
        decide = s.decide

        def slowly(req, view):
            time.sleep(0.01)
            return decide(req, view)

        s.decide = slowly
    try:
        res = simulate(records, [s], nodes=3, profile=tiny_profile(), congested=True)["nexuskv"]
    finally:
        s.close()
    return {k: v for k, v in attrs.asdict(res).items() if k not in ("wall_s", "decide_s", "decide_ms")}


def test_the_judge_gives_the_same_figures_however_loaded_the_host_is():
    # The kernels' link estimates age on simulated time: a host ten times slower changes no decision.
    fast, slow = _judged(False), _judged(True)
    assert fast["completed"] == 60 and fast["reused_tokens"] > 0
    assert slow == fast
