"""planning.fleet: every node's source runs from one match equal the planner's own per-node answer."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv import RESIDENT_TIER, BlockKeyer, DictIndex, Location
from nexuskv.planning.breakers import Health
from nexuskv.planning.cost import CostModel, default_profile
from nexuskv.planning.fleet import SELF, FleetRuns, one_pass_applies
from nexuskv.planning.planner import Planner
from tests.conftest import layout_of, make_request

PAGE = 16
KEYER = BlockKeyer(bytes(range(32)), page_size=PAGE)
NODES = ("a", "b", "c", "d")
TIERS = ("dram", "disk", "shm")  # shm: a shared tier (every node reads it itself)
LAYOUT = layout_of("dense", "dense")  # two groups: a location may hold one of them only

locations = st.lists(st.tuples(st.sampled_from((*TIERS, RESIDENT_TIER)), st.sampled_from(NODES),
                               st.sampled_from((1, 2, 3, 3, 3))), max_size=4)  # fmt: skip


def build(holdings, broken, remote, resident, extra):
    req = make_request(range(PAGE * len(holdings) + extra), layout=LAYOUT)
    keys = KEYER.request_keys(req)
    idx = DictIndex()
    for key, held in zip(keys, holdings, strict=False):
        for tier, node, mask in held:
            idx.insert(key, Location(tier, node, 1), mask)
    health = Health(threshold=1)
    for name in broken:
        health.breaker(name).failure("down", severe=True)
    planner = Planner(CostModel(default_profile()), health, TIERS, transport="local",
                      remote_transport="tcp" if remote else "", shared_tiers=("shm",))  # fmt: skip
    if resident:
        planner = planner.routing()
    return req, idx.match(keys, req.layout), planner


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(holdings=st.lists(locations, min_size=1, max_size=12),
       broken=st.sets(st.sampled_from(("dram", "disk", "shm", "peer:a", "peer:b", "peer:c"))),
       remote=st.booleans(), resident=st.booleans(), extra=st.integers(0, 20),
       cap=st.one_of(st.none(), st.integers(0, 12)))  # fmt: skip
def test_every_nodes_candidates_equal_the_planners(holdings, broken, remote, resident, extra, cap):
    req, match, planner = build(holdings, broken, remote, resident, extra)
    fleet = FleetRuns(planner, req, match)
    for node in (*NODES, "z"):  # z holds nothing
        runs, end = fleet.runs(node)
        got = planner.priced(runs, end, node=node, page=PAGE, max_blocks=cap)
        assert got == planner.candidates(req, match, node=node, max_blocks=cap), node
    assert set(fleet.holders) <= {n for held in holdings for _, n, _ in held}


@settings(max_examples=200, deadline=None)
@given(holdings=st.lists(locations, min_size=1, max_size=10), remote=st.booleans())
def test_equal_signatures_mean_equal_candidates_up_to_the_name(holdings, remote):
    req, match, planner = build(holdings, (), remote, True, 0)
    fleet = FleetRuns(planner, req, match)
    seen = {}
    for node in (*NODES, "y", "z"):
        sig = fleet.signature(node)
        named = [(c.blocks, tuple((f, e, t, SELF if n == node else n) for f, e, t, n in c.sources), c.gain_ms)
                 for c in planner.candidates(req, match, node=node)]  # fmt: skip
        if sig in seen:
            assert named == seen[sig]
        seen[sig] = named


def test_a_holder_whose_own_copy_is_unusable_reads_the_next_best_location():
    # b holds the block on a broken disk; the best other source is c's DRAM, never b's own disk over the network
    req, match, planner = build([[("disk", "b", 3), ("dram", "c", 3)]], ("disk",), True, False, 0)
    fleet = FleetRuns(planner, req, match)
    assert fleet.runs("b") == ([(0, 1, "dram", "c")], 1)
    assert fleet.runs("z") == ([(0, 1, "dram", "c")], 1)
    assert fleet.runs("c") == ([(0, 1, "dram", "c")], 1)  # its own


def test_checkpointed_layouts_take_the_per_node_path():
    assert one_pass_applies(make_request(range(32), layout=layout_of("dense")))
    assert not one_pass_applies(make_request(range(32), layout=layout_of("dense", "recurrent")))


@pytest.mark.parametrize("tier", ["dram", RESIDENT_TIER])
def test_a_node_reads_its_own_blocks_and_the_rest_from_the_best_peer(tier):
    held = [[(tier, "a", 3), ("dram", "b", 3)]] * 2 + [[("dram", "b", 3)]] * 2
    req, match, planner = build(held, (), True, True, 0)
    fleet = FleetRuns(planner, req, match)
    assert fleet.runs("a") == ([(0, 2, tier, "a"), (2, 4, "dram", "b")], 4)
    assert fleet.signature("a") == ((tier, SELF), ("dram", "b"))  # the source of each run of the match
    # another node: a's DRAM copy is as good as b's (ties go to the name); a's engine cache is a's alone
    assert fleet.runs("z") == (([(0, 2, "dram", "a"), (2, 4, "dram", "b")] if tier == "dram"
                                else [(0, 4, "dram", "b")]), 4)  # fmt: skip


def test_more_than_256_distinct_holdings_are_runs_too():
    # every block held at its own epoch: 300 distinct holdings in one match, as long prompts over a fleet give
    req = make_request(range(PAGE * 300), layout=LAYOUT)
    keys = KEYER.request_keys(req)
    idx = DictIndex()
    for i, key in enumerate(keys):
        idx.insert(key, Location("dram", "a", i), 3)
    planner = Planner(CostModel(default_profile()), Health(), TIERS, remote_transport="tcp")
    match = idx.match(keys, req.layout)
    fleet = FleetRuns(planner, req, match)
    for node in ("a", "b"):
        runs, end = fleet.runs(node)
        assert planner.priced(runs, end, node=node, page=PAGE) == planner.candidates(req, match, node=node)
    assert fleet.runs("b") == ([(0, 300, "dram", "a")], 300)


def test_a_location_without_a_node_name_is_read_like_any_other():
    # a shared tier's entry with no node (as some stores publish): every node reads it, holder or not
    req, match, planner = build([[("shm", "", 3)]], (), False, False, 0)
    fleet = FleetRuns(planner, req, match)
    for node in ("a", "z"):
        runs, end = fleet.runs(node)
        assert planner.priced(runs, end, node=node, page=PAGE) == planner.candidates(req, match, node=node)
    assert fleet.runs("z") == ([(0, 1, "shm", "")], 1)


def test_a_node_named_like_a_placeholder_is_just_another_node():
    # node names are whatever a peer publishes: a copy on a node of any name is never "the candidate's own"
    for odd in ("\x00self", "SELF", repr(SELF)):
        req, match, planner = build([[("dram", odd, 3)]], (), True, False, 0)
        fleet = FleetRuns(planner, req, match)
        runs, end = fleet.runs("z")
        assert (runs, end) == ([(0, 1, "dram", odd)], 1)
        assert planner.priced(runs, end, node="z", page=PAGE) == planner.candidates(req, match, node="z")
