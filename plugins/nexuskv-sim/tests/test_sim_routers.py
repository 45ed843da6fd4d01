import pytest
from _sim_fakes import FakeView, request

from nexuskv_sim.api import Fetch
from nexuskv_sim.routers import DynamoKV, NeverReuse, RoundRobin, SGLangCacheAware

NODES = ("n0", "n1", "n2")


def test_round_robin_cycles_and_reuses_what_the_node_holds():
    view = FakeView(NODES, held={"n1": (1, 2, 3)})
    rr = RoundRobin()
    picks = [rr.decide(request(i, [1, 2, 3, 4]), view) for i in range(4)]
    assert [d.node for d in picks] == ["n0", "n1", "n2", "n0"]
    assert picks[0].fetches == ()
    assert picks[1].fetches == (Fetch("n1", "hbm", 0, 1), Fetch("n1", "dram", 1, 2), Fetch("n1", "disk", 2, 3))


def test_never_reuse_loads_nothing():
    view = FakeView(NODES, held={n: (4, 4, 4) for n in NODES})
    assert all(NeverReuse().decide(request(i, [1, 2, 3, 4]), view).fetches == () for i in range(3))


def test_sglang_shortest_queue_when_imbalanced():
    s = SGLangCacheAware()
    view = FakeView(NODES)
    first = s.decide(request(0, [1, 2, 3, 4]), view)  # its tree now holds the prompt
    view.load = {first.node: {"waiting": 80}, **{n: {"waiting": 10} for n in NODES if n != first.node}}
    view.load["n2" if first.node != "n2" else "n1"] = {"waiting": 5}
    d = s.decide(request(1, [1, 2, 3, 4]), view)  # 80 - 5 > 64 and 80 > 1.5 * 5
    assert d.node == min(view.load, key=lambda n: view.load[n]["waiting"])
    assert "shortest queue" in d.reason


def test_sglang_best_match_above_threshold_else_smallest_tree():
    s = SGLangCacheAware()
    view = FakeView(NODES, load={n: {"waiting": 10 * i} for i, n in enumerate(NODES)})  # 20 apart: balanced
    a = s.decide(request(0, [1, 2, 3, 4]), view)
    b = s.decide(request(1, [7, 8, 9]), view)  # no match: the smallest tree, not a's worker
    assert b.node != a.node
    again = s.decide(request(2, [1, 2, 3, 4, 5]), view)  # 4 of 5 blocks match: 0.8 > 0.3
    assert again.node == a.node and "match rate 0.80" in again.reason
    low = s.decide(request(3, [1, 20, 21, 22, 23]), view)  # 1 of 5: 0.2 <= 0.3
    assert "smallest tree" in low.reason
    sizes = {n: s._tree.size(n) for n in NODES}
    assert sizes[low.node] <= min(sizes.values()) + 5  # it was the smallest before this insert


def test_sglang_thresholds_follow_the_configuration():
    s = SGLangCacheAware(cache_threshold=0.9)
    view = FakeView(NODES)
    a = s.decide(request(0, [1, 2, 3, 4]), view)
    d = s.decide(request(1, [1, 2, 3, 4, 5]), view)  # 0.8 is not above 0.9
    assert d.node != a.node


def test_dynamo_logit_trades_overlap_against_load_with_tier_weights():
    r = request(0, list(range(20)))
    view = FakeView(("n0", "n1"), held={"n0": (10, 10, 10)}, load={"n0": {"queued": 4096}})
    dyn = DynamoKV()
    logits = dyn.logits(r, view)
    # n0: (4096 + 10240) / 512 - 10 device blocks, + 20 decode blocks; n1: 20 + 20
    assert logits == {"n0": pytest.approx(28 - 10 + 20), "n1": pytest.approx(40)}
    assert dyn.decide(r, view).node == "n0"
    # the same 10 blocks in host memory only earn 0.75 each: n1 wins
    view.held = {"n0": (0, 10, 10)}
    assert DynamoKV().logits(r, view)["n0"] == pytest.approx(28 - 7.5 + 20)
    assert DynamoKV().decide(r, view).node == "n1"
    # and on disk only 0.25 each
    view.held = {"n0": (0, 0, 10)}
    assert DynamoKV().logits(r, view)["n0"] == pytest.approx(28 - 2.5 + 20)


def test_dynamo_counts_what_it_routed_since_the_last_report():
    dyn = DynamoKV()
    view = FakeView(("n0", "n1"), now=10.0)
    first = dyn.decide(request(0, list(range(8))), view)
    second = dyn.decide(request(1, list(range(100, 108))), view)  # reports still show nothing: it remembers
    assert first.node != second.node
