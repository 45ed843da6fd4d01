from _sim_fakes import FakeView, request

from nexuskv_sim.api import Fetch, NodeLoad
from nexuskv_sim.reuse import ApproxPrefixIndex, RecentRoutes, always_reuse, tier_prefixes


def test_always_reuse_takes_each_part_from_its_fastest_tier():
    r = request(0, [1, 2, 3, 4, 5])
    view = FakeView(("n0",), held={"n0": (0, 3, 3)})
    assert tier_prefixes(view, "n0", r) == (0, 3, 3)
    assert always_reuse(view, "n0", r) == (Fetch("n0", "dram", 0, 3),)
    view.held = {"n0": (2, 2, 5)}
    assert always_reuse(view, "n0", r) == (Fetch("n0", "hbm", 0, 2), Fetch("n0", "disk", 2, 5))
    view.held = {}
    assert always_reuse(view, "n0", r) == ()


def load(node, at):
    return NodeLoad(node, at, 0, 0, 0, 0, 10, "m")


def test_recent_routes_counts_only_what_reports_do_not_show_yet():
    rr = RecentRoutes()
    rr.add(5.0, "n0", 100, 2)
    rr.add(20.0, "n0", 50, 1)
    rr.add(20.0, "n1", 10, 1)
    assert rr.since({"n0": load("n0", 10.0), "n1": load("n1", 30.0)}) == {"n0": (1, 50, 1)}
    assert rr.since({"n0": load("n0", 0.0), "n1": load("n1", 0.0)}) == {"n0": (1, 50, 1), "n1": (1, 10, 1)}


def test_approx_index_matches_leading_keys_and_forgets_least_recent():
    idx = ApproxPrefixIndex(capacity_blocks=4)
    idx.insert("w", ["a", "b", "c"])
    assert idx.match("w", ["a", "b", "x"]) == 2 and idx.match("other", ["a"]) == 0
    idx.insert("w", ["d", "e"])  # a is the least recent: dropped
    assert idx.size("w") == 4 and idx.match("w", ["a", "b"]) == 0 and idx.match("w", ["d", "e"]) == 2
