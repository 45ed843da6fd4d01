from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nexuskv
from nexuskv import BlockKeyer, DictIndex, Location, Plan, PlanAction, PlanSpan
from nexuskv.planning.breakers import Health
from nexuskv.planning.cost import CostModel, default_profile
from nexuskv.planning.decision import decide, to_plan
from nexuskv.planning.planner import Candidate, Planner, best
from nexuskv.policy.loader import Policies
from tests.conftest import layout_of, make_request

ROOT = Path(__file__).resolve().parents[2]
KEYER = BlockKeyer(bytes(range(32)), page_size=16)
TIERS = ("dram", "disk", "redis")
PAGE = 16
SLOW_DISK = {"disk": 1e-4}


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def setup(holdings, *, layout=None, extra_tokens=0, node="n1", tokens=None, tenant="acme"):
    """A request of len(holdings) blocks (+ extra tokens) and an index holding block i in holdings[i].

    holdings[i] is None (not held), a tier name, or a list of (tier, node, group_mask).
    """
    n = len(holdings) if tokens is None else tokens
    req = make_request(range(PAGE * n + extra_tokens), layout=layout, tenant=tenant)
    keys = KEYER.request_keys(req)
    idx = DictIndex()
    for key, held in zip(keys, holdings, strict=False):
        if held is None:
            continue
        for tier, where, mask in [(held, node, 1)] if isinstance(held, str) else held:
            idx.insert(key, Location(tier, where, 1), mask)
    return req, keys, idx


def make_planner(health=None, profile=None):
    return Planner(CostModel(profile or default_profile()), health or Health(), TIERS)


def plan_of(planner, req, keys, idx, policy=None, node="n1", decision_id="d-1", **kw):
    return decide(planner, req, idx.match(keys, req.layout), policy, node=node, decision_id=decision_id, epoch=7,
                  **kw)  # fmt: skip


def roundtrip(plan: Plan) -> Plan:
    again = nexuskv.from_dict(Plan, nexuskv.to_dict(plan))
    assert again == plan
    return again


def write_policy(tmp_path, text: str):
    root = tmp_path / "policies"
    root.mkdir(exist_ok=True)
    (root / "default.toml").write_text(text)
    return Policies.load(root).for_tenant("acme")


# ------------------------------------------------------------------------------------------------ candidates


def test_candidates_are_zero_the_tier_boundaries_and_the_longest_cut():
    req, keys, idx = setup(["dram"] * 4 + ["disk"] * 3 + ["redis"] * 2 + [None] * 3, extra_tokens=5)
    cands = make_planner().candidates(req, idx.match(keys, req.layout), node="n1")
    assert [c.blocks for c in cands] == [0, 4, 7, 9]
    assert cands[0].sources == () and cands[0].gain_ms == 0.0
    assert cands[1].sources == ((0, 4, "dram", "n1"),)
    assert cands[-1].sources == ((0, 4, "dram", "n1"), (4, 7, "disk", "n1"), (7, 9, "redis", "n1"))
    assert cands[-1].slowest_tier == "redis" and cands[0].slowest_tier == ""
    # each candidate is priced with G = T_recompute - (T_lookup + T_transfer + T_mount)
    cost = CostModel(default_profile())
    for c in cands[1:]:
        assert c.t_recompute_ms == pytest.approx(cost.recompute_ms(c.blocks * PAGE))
        assert c.gain_ms == pytest.approx(c.t_recompute_ms - c.t_lookup_ms - c.t_transfer_ms - c.t_mount_ms)


def test_a_paged_prefix_cannot_skip_a_block():
    req, keys, idx = setup(["dram", "dram", None, "dram", "dram"])
    cands = make_planner().candidates(req, idx.match(keys, req.layout), node="n1")
    assert [c.blocks for c in cands] == [0, 2]


def test_the_fastest_tier_holding_a_block_is_its_source():
    both = [("disk", "n1", 1), ("dram", "n1", 1)]
    req, keys, idx = setup([both, both, "disk"])
    cands = make_planner().candidates(req, idx.match(keys, req.layout), node="n1")
    assert cands[-1].sources == ((0, 2, "dram", "n1"), (2, 3, "disk", "n1"))


def test_local_copies_are_preferred_over_remote_ones():
    held = [("dram", "n2", 1), ("disk", "n1", 1)]
    req, keys, idx = setup([held] * 3)
    cands = make_planner().candidates(req, idx.match(keys, req.layout), node="n1")
    assert cands[-1].sources == ((0, 3, "disk", "n1"),)
    # without a node of its own the fastest tier wins wherever it is
    cands = make_planner().candidates(req, idx.match(keys, req.layout), node="")
    assert cands[-1].sources == ((0, 3, "dram", "n2"),)


def peer_planner(health=None, shared=(), links=None):
    return Planner(CostModel(default_profile(), links=links), health or Health(), TIERS, remote_transport="tcp",
                   shared_tiers=shared)  # fmt: skip


def test_a_peers_state_is_planned_only_with_a_transport_to_it_and_priced_over_that_link():
    req, keys, idx = setup([[("dram", "n2", 1)]] * 8)
    match = idx.match(keys, req.layout)
    assert [c.blocks for c in make_planner().candidates(req, match, node="n1")] == [0]  # no way to reach n2
    planner = peer_planner()
    cands = planner.candidates(req, match, node="n1")
    assert cands[-1].sources == ((0, 8, "dram", "n2"),)
    nbytes = 8 * PAGE * planner.cost.bytes_per_token
    assert cands[-1].t_transfer_ms == pytest.approx(planner.cost.remote_ms(nbytes, "dram", "n2", transport="tcp"))
    tcp = default_profile().transports["tcp"]  # not measured yet: the profile's tier cost plus the transport's
    assert cands[-1].t_transfer_ms == pytest.approx(planner.cost.transfer_ms(nbytes, "dram") + tcp.latency_ms
                                                    + nbytes / tcp.bandwidth_bytes_per_s * 1e3)  # fmt: skip
    plan = plan_of(planner, req, keys, idx).plan
    assert plan.action == PlanAction.MATERIALIZE
    assert [(s.node, s.transport) for s in plan.spans] == [("n2", "tcp")]


def test_a_peer_whose_link_breaker_is_open_is_not_planned_on():
    health = Health(threshold=1)
    req, keys, idx = setup([[("dram", "n2", 1), ("disk", "n3", 1)]] * 4)
    health.breaker("peer:n2").failure("refused", severe=True)
    cands = peer_planner(health).candidates(req, idx.match(keys, req.layout), node="n1")
    assert cands[-1].sources == ((0, 4, "disk", "n3"),)


def test_a_measured_slow_peer_turns_reuse_into_recompute():
    from nexuskv.planning.links import LinkEstimates

    links = LinkEstimates(default_profile(), min_samples=1)
    for _ in range(10):
        links.observe("peer:n2", 1 << 20, 1.0)  # 1 MB/s
    req, keys, idx = setup([[("dram", "n2", 1)]] * 32)
    plan = plan_of(peer_planner(links=links), req, keys, idx).plan
    assert plan.action == PlanAction.RECOMPUTE
    assert any("would lose" in r for r in plan.reasons)


def test_another_nodes_state_in_a_shared_tier_is_read_in_place():
    req, keys, idx = setup([[("disk", "n2", 1)]] * 4)  # a host-wide tier another process wrote
    planner = peer_planner(shared=("disk",))
    plan = plan_of(planner, req, keys, idx).plan
    assert [(s.tier, s.node, s.transport) for s in plan.spans] == [("disk", "n2", "local")]
    assert plan.predicted.t_transfer_ms == pytest.approx(
        planner.cost.transfer_ms(4 * PAGE * planner.cost.bytes_per_token, "disk", transport="local"))


def test_no_prefetch_is_proposed_for_a_peers_state():
    req, keys, idx = setup([[("disk", "n2", 1)]] * 16)
    plan = plan_of(peer_planner(), req, keys, idx, prefetch_target="dram").plan
    assert plan.prefetch == ()


def test_tiers_outside_the_planner_order_are_ignored():
    req, keys, idx = setup(["tape"] * 4)
    cands = make_planner().candidates(req, idx.match(keys, req.layout), node="n1")
    assert [c.blocks for c in cands] == [0]


# ------------------------------------------------------------------------------------------------ decisions


def test_fast_tiers_reuse_everything():
    req, keys, idx = setup(["dram"] * 8 + ["disk"] * 8, extra_tokens=3)
    d = plan_of(make_planner(), req, keys, idx)
    plan = roundtrip(d.plan)
    assert plan.action == PlanAction.MATERIALIZE
    assert plan.tokens_total == 16 * 16 + 3 and plan.tokens_reused == 256
    assert plan.spans == (PlanSpan(start=0, end=128, tier="dram", node="n1", transport="local"),
                          PlanSpan(start=128, end=256, tier="disk", node="n1", transport="local"))  # fmt: skip
    assert (plan.decision_id, plan.request_id, plan.tenant, plan.epoch) == ("d-1", "r", "acme", 7)
    assert plan.predicted.gain_ms > 0
    assert plan.predicted.ttft_ms < CostModel(default_profile()).prefill_ms(plan.tokens_total)
    assert plan.reasons[0] == "match: 16 of 16 blocks reusable (disk 8, dram 8)"
    assert any(r.startswith("reuse 256 tokens") for r in plan.reasons)
    assert d.detail.chosen is not None and d.detail.chosen.blocks == 16


def test_a_slow_tier_is_cut_off_at_the_tier_boundary():
    req, keys, idx = setup(["dram"] * 8 + ["disk"] * 8)
    d = plan_of(make_planner(), req, keys, idx, bandwidth_scale=SLOW_DISK)
    plan = roundtrip(d.plan)
    assert plan.action == PlanAction.MATERIALIZE
    assert plan.tokens_reused == 128
    assert [(s.start, s.end, s.tier) for s in plan.spans] == [(0, 128, "dram")]
    full = max(d.detail.candidates, key=lambda c: c.blocks)
    assert full.blocks == 16 and full.gain_ms < d.detail.chosen.gain_ms


def test_in_flight_bytes_on_a_tier_count_as_contention():
    req, keys, idx = setup(["dram"] * 4 + ["disk"] * 4)
    pl = make_planner()
    quiet = plan_of(pl, req, keys, idx)
    busy = plan_of(pl, req, keys, idx, inflight={"disk": 1e12})
    assert busy.detail.candidates[-1].t_transfer_ms > quiet.detail.candidates[-1].t_transfer_ms


def test_nothing_held_recomputes_with_a_reason():
    req, keys, idx = setup([None] * 6)
    plan = roundtrip(plan_of(make_planner(), req, keys, idx).plan)
    assert plan.action == PlanAction.RECOMPUTE
    assert plan.tokens_reused == 0 and plan.spans == () and plan.prefetch == ()
    assert plan.reasons == ("match: nothing reusable",)
    assert plan.predicted.ttft_ms == pytest.approx(CostModel(default_profile()).prefill_ms(6 * PAGE))


def test_nothing_usable_here_names_the_nodes_that_hold_the_prefix():
    """Issue 35: a request for edge-3 whose prefix is held on gpu-0 (no peer transport) says where the state is."""
    req, keys, idx = setup(["dram"] * 4 + [None] * 2, node="gpu-0")
    plan = plan_of(make_planner(), req, keys, idx, node="edge-3").plan
    assert plan.action == PlanAction.RECOMPUTE
    assert plan.reasons[0] == "match: nothing reusable on edge-3; the prefix is held on gpu-0"


def test_reuse_that_loses_recomputes_and_says_by_how_much():
    req, keys, idx = setup(["disk"] * 8)
    plan = plan_of(make_planner(), req, keys, idx, bandwidth_scale=SLOW_DISK).plan
    assert plan.action == PlanAction.RECOMPUTE and plan.tokens_reused == 0
    assert any(r.startswith("recompute: reusing 128 tokens would lose") for r in plan.reasons)


def test_an_unhealthy_tier_is_not_planned_on():
    clock = FakeClock()
    health = Health(cooldown_s=5.0, clock=clock)
    health.breaker("dram").failure("x", severe=True)
    pl = make_planner(health=health)
    req, keys, idx = setup(["dram"] * 6)
    plan = plan_of(pl, req, keys, idx).plan
    assert plan.action == PlanAction.RECOMPUTE and plan.tokens_reused == 0
    # a block also held on a healthy tier is read from there instead
    both = [("dram", "n1", 1), ("disk", "n1", 1)]
    req2, keys2, idx2 = setup([both] * 6)
    plan2 = plan_of(pl, req2, keys2, idx2).plan
    assert plan2.action == PlanAction.MATERIALIZE
    assert {s.tier for s in plan2.spans} == {"disk"}
    # once the cooldown is over, the half-open breaker lets the tier be used again
    clock.t += 5.0
    plan3 = plan_of(pl, req2, keys2, idx2).plan
    assert {s.tier for s in plan3.spans} == {"dram"}


tier_or_none = st.sampled_from([None, "dram", "disk", "redis"])
holding = st.one_of(
    tier_or_none,
    st.lists(st.tuples(st.sampled_from(TIERS), st.sampled_from(["n1", "n2"]), st.just(1)), min_size=1, max_size=3),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(holding, min_size=0, max_size=24), st.integers(0, 15),
       st.sampled_from([None, SLOW_DISK, {"redis": 0.001}, {"dram": 0.5, "disk": 10.0}]),
       st.sampled_from(["n1", "n2", ""]))  # fmt: skip
def test_same_inputs_same_plan(holdings, extra, scale, node):
    req, keys, idx = setup(holdings, extra_tokens=extra)
    a = plan_of(make_planner(), req, keys, idx, node=node, decision_id="first", bandwidth_scale=scale,
                prefetch_target="dram")  # fmt: skip
    # an index built in the opposite order, a snapshot of it and a fresh planner: the same inputs
    _, _, idx2 = setup([])
    for key, held in reversed(list(zip(keys, holdings, strict=False))):
        if held is not None:
            for tier, where, mask in [(held, "n1", 1)] if isinstance(held, str) else reversed(held):
                idx2.insert(key, Location(tier, where, 1), mask)
    snap = idx2.snapshot()
    b = decide(make_planner(), req, snap.match(keys, req.layout), None, node=node, decision_id="second", epoch=7,
               bandwidth_scale=scale, prefetch_target="dram")  # fmt: skip
    assert a.plan.decision_id == "first" and b.plan.decision_id == "second"
    assert attrs.evolve(b.plan, decision_id="first") == a.plan
    assert b.detail.candidates == a.detail.candidates
    # and the plan is a valid contract and the best priced candidate
    plan = roundtrip(a.plan)
    top = max(c.gain_ms for c in a.detail.candidates)
    if plan.action == PlanAction.MATERIALIZE:
        assert plan.predicted.gain_ms == pytest.approx(top) and top > 0
        assert 0 < plan.tokens_reused <= len(keys) * PAGE and plan.tokens_reused % PAGE == 0
        assert plan.predicted.ttft_ms < CostModel(default_profile()).prefill_ms(plan.tokens_total)
    else:
        assert top <= 0 and plan.tokens_reused == 0


# ------------------------------------------------------------------------------------------------ policies


def test_min_gain_from_a_policy_turns_a_small_gain_into_recompute(tmp_path):
    strict_gain = write_policy(tmp_path, 'name = "default"\nmin_gain_ms = 5.0\n')
    req, keys, idx = setup(["dram"] * 2)  # G of 32 tokens from DRAM is about 3.5 ms
    pl = make_planner()
    free = plan_of(pl, req, keys, idx).plan
    assert free.action == PlanAction.MATERIALIZE and 0 < free.predicted.gain_ms < 5.0
    plan = roundtrip(plan_of(pl, req, keys, idx, policy=strict_gain).plan)
    assert plan.action == PlanAction.RECOMPUTE and plan.tokens_reused == 0
    assert any("does not beat min gain 5 ms" in r for r in plan.reasons)
    assert plan.policy_revision == strict_gain.revision


def test_shipped_chat_policy_allows_small_reuse_and_warns():
    chat = Policies.load(ROOT / "policies").for_tenant("chat")
    assert chat.min_gain_ms == pytest.approx(0.2)
    req, keys, idx = setup(["dram"], tenant="chat")  # one block: G about 1.7 ms, above 0.2, below the 2 ms warning
    plan = plan_of(make_planner(), req, keys, idx, policy=chat).plan
    assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 16
    assert any(r.startswith("policy warning: watch-slow-reuse") for r in plan.reasons)
    assert plan.policy_revision == chat.revision


def test_reuse_rule_with_max_tokens_caps_the_reused_tokens(tmp_path):
    policy = write_policy(tmp_path, '''name = "default"
[[reuse]]
name = "cap-64"
when = "match.tokens > 64"
max_tokens = "64"
message = "at most 64 tokens"
''')
    req, keys, idx = setup(["dram"] * 10)
    plan = roundtrip(plan_of(make_planner(), req, keys, idx, policy=policy).plan)
    assert plan.action == PlanAction.MATERIALIZE
    assert plan.tokens_reused == 64
    assert [(s.start, s.end) for s in plan.spans] == [(0, 64)]
    assert "cap-64" in plan.rules
    assert any("caps reuse at 64 tokens" in r for r in plan.reasons)


def test_shipped_chat_policy_caps_reuse_on_edge_nodes():
    chat = Policies.load(ROOT / "policies").for_tenant("chat")
    req, keys, idx = setup(["dram"] * 600, node="edge-1", tenant="chat")
    plan = plan_of(make_planner(), req, keys, idx, policy=chat, node="edge-1").plan
    assert plan.action == PlanAction.MATERIALIZE
    assert plan.tokens_reused == 8192
    assert "cap-untrusted-node" in plan.rules
    # the same holdings on an ordinary node are reused in full
    req, keys, idx = setup(["dram"] * 600, node="n1", tenant="chat")
    assert plan_of(make_planner(), req, keys, idx, policy=chat).plan.tokens_reused == 9600


def test_plain_deny_recomputes_and_names_the_rule():
    strict = Policies.load(ROOT / "policies").for_tenant("strict")
    req, keys, idx = setup(["disk"] * 6, tenant="strict")
    plan = roundtrip(plan_of(make_planner(), req, keys, idx, policy=strict).plan)
    assert plan.action == PlanAction.RECOMPUTE and plan.tokens_reused == 0
    assert "dram-only" in plan.rules
    assert "recompute: policy allows no reuse" in plan.reasons


def test_a_denied_candidate_falls_back_to_an_allowed_shorter_one():
    strict = Policies.load(ROOT / "policies").for_tenant("strict")
    req, keys, idx = setup(["dram"] * 4 + ["disk"] * 4, tenant="strict")
    plan = plan_of(make_planner(), req, keys, idx, policy=strict).plan
    assert plan.action == PlanAction.MATERIALIZE
    assert plan.tokens_reused == 64 and {s.tier for s in plan.spans} == {"dram"}
    assert "dram-only" in plan.rules


def test_dram_only_rule_holds_when_the_slow_tier_comes_first():
    strict = Policies.load(ROOT / "policies").for_tenant("strict")
    # older blocks demoted to disk, the newer ones still in DRAM: a realistic layout after cost-aware eviction
    req, keys, idx = setup(["disk"] * 4 + ["dram"] * 4, tenant="strict")
    plan = plan_of(make_planner(), req, keys, idx, policy=strict).plan
    assert "disk" not in {s.tier for s in plan.spans}
    assert "dram-only" in plan.rules


def test_dram_only_rule_holds_for_hybrid_pages_on_disk():
    strict = Policies.load(ROOT / "policies").for_tenant("strict")
    holdings = [[("disk", "n1", 1)] for _ in range(4)]
    holdings[3] = [("disk", "n1", 1), ("dram", "n1", 2)]  # pages on disk, the recurrent checkpoint in DRAM
    req, keys, idx = setup(holdings, layout=layout_of("dense", "recurrent"), tenant="strict")
    plan = plan_of(make_planner(), req, keys, idx, policy=strict).plan
    assert "disk" not in {s.tier for s in plan.spans}


def test_slowest_tier_of_a_candidate_in_the_usual_order():
    req, keys, idx = setup(["dram"] * 2 + ["disk"] * 2 + ["redis"] * 2)
    cands = make_planner().candidates(req, idx.match(keys, req.layout), node="n1")
    assert [c.slowest_tier for c in cands] == ["", "dram", "disk", "redis"]


# ------------------------------------------------------------------------------------------------ state kinds


@pytest.mark.parametrize("kind", ["windowed", "recurrent"])
@settings(max_examples=40, deadline=None)
@given(ckpts=st.sets(st.integers(0, 11), max_size=6))
def test_checkpointed_layouts_cut_only_at_checkpoints(kind, ckpts):
    holdings = ["dram" if i in ckpts else None for i in range(12)]
    req, keys, idx = setup(holdings, layout=layout_of(kind))
    d = plan_of(make_planner(), req, keys, idx)
    valid = {0} | {b + 1 for b in ckpts}
    assert {c.blocks for c in d.detail.candidates} <= valid
    plan = roundtrip(d.plan)
    assert plan.tokens_reused // PAGE in valid and plan.tokens_reused % PAGE == 0


@pytest.mark.parametrize("kind", ["windowed", "recurrent"])
def test_checkpointed_layout_restores_its_last_checkpoint(kind):
    lay = layout_of(kind)
    holdings = ["dram" if i in (3, 7) else None for i in range(12)]
    req, keys, idx = setup(holdings, layout=lay)
    assert idx.match(keys, lay).longest() == 8  # the index finds the checkpoint after block 8
    d = plan_of(make_planner(), req, keys, idx)
    assert [c.blocks for c in d.detail.candidates] == [0, 8]
    plan = roundtrip(d.plan)
    assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 8 * PAGE
    # only the checkpoint itself is read: its key commits to the whole prefix
    assert [(s.start, s.end, s.tier) for s in plan.spans] == [(7 * PAGE, 8 * PAGE, "dram")]


@pytest.mark.parametrize("kind", ["windowed", "recurrent"])
def test_checkpointed_layout_can_cut_at_an_earlier_checkpoint_in_a_faster_tier(kind):
    holdings = [None] * 3 + ["dram"] + [None] * 3 + ["disk"] + [None] * 2
    req, keys, idx = setup(holdings, layout=layout_of(kind))
    plan = plan_of(make_planner(), req, keys, idx, bandwidth_scale=SLOW_DISK).plan
    # restoring the DRAM checkpoint after block 4 saves ~7 ms; the disk one after block 8 loses ~200 ms
    assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 4 * PAGE


def test_hybrid_layout_cuts_where_every_group_can_be_restored():
    lay = layout_of("dense", "recurrent")  # bit 0 dense (paged), bit 1 recurrent (checkpointed)
    holdings = [[("dram", "n1", 1)] for _ in range(10)]
    for b in (3, 7):
        holdings[b] = [("dram", "n1", 3)]
    req, keys, idx = setup(holdings, layout=lay)
    d = plan_of(make_planner(), req, keys, idx)
    assert {c.blocks for c in d.detail.candidates} <= {0, 4, 8}
    plan = roundtrip(d.plan)
    assert plan.tokens_reused == 8 * PAGE
    spans = {(s.start, s.end, s.tier) for s in plan.spans}
    assert (0, 128, "dram") in spans and (112, 128, "dram") in spans  # the pages and the checkpoint


def test_hybrid_layout_stops_where_the_paged_group_stops():
    lay = layout_of("dense", "recurrent")
    holdings = [[("dram", "n1", 1)] for _ in range(10)]
    for b in (3, 7):
        holdings[b] = [("dram", "n1", 3)]
    holdings[5] = None  # dense pages end after block 5: the checkpoint after block 8 is unusable
    req, keys, idx = setup(holdings, layout=lay)
    plan = plan_of(make_planner(), req, keys, idx).plan
    assert plan.tokens_reused == 4 * PAGE


def test_hybrid_layout_without_checkpoints_recomputes():
    req, keys, idx = setup(["dram"] * 8, layout=layout_of("dense", "windowed"))  # only group 0 held
    plan = plan_of(make_planner(), req, keys, idx).plan
    assert plan.action == PlanAction.RECOMPUTE


def test_hybrid_tier_boundaries_map_to_checkpoints():
    lay = layout_of("dense", "recurrent")
    holdings = [[("dram", "n1", 1)] for _ in range(6)] + [[("disk", "n1", 1)] for _ in range(4)]
    holdings[3] = [("dram", "n1", 3)]
    holdings[7] = [("disk", "n1", 3)]
    req, keys, idx = setup(holdings, layout=lay)
    d = plan_of(make_planner(), req, keys, idx, bandwidth_scale=SLOW_DISK)
    assert [c.blocks for c in d.detail.candidates] == [0, 4, 8]
    assert d.plan.tokens_reused == 4 * PAGE and {s.tier for s in d.plan.spans} == {"dram"}


# ------------------------------------------------------------------------------------------------ prefetch


def test_prefetch_proposed_when_nothing_pays_now_but_would_from_dram():
    req, keys, idx = setup(["disk"] * 8)
    pl = make_planner()
    plan = roundtrip(plan_of(pl, req, keys, idx, bandwidth_scale=SLOW_DISK, prefetch_target="dram").plan)
    assert plan.action == PlanAction.PREFETCH and plan.tokens_reused == 0 and plan.spans == ()
    assert plan.prefetch == (PlanSpan(start=0, end=128, tier="disk", node="n1", transport="local",
                                      target_tier="dram"),)  # fmt: skip
    assert "prefetch 128 tokens into dram for the next request of this prefix" in plan.reasons
    # no prefetch target: a plain recompute
    plain = plan_of(pl, req, keys, idx, bandwidth_scale=SLOW_DISK).plan
    assert plain.action == PlanAction.RECOMPUTE and plain.prefetch == ()


def test_prefetch_of_the_slow_part_alongside_reuse_of_the_fast_part():
    req, keys, idx = setup(["dram"] * 4 + ["disk"] * 4)
    plan = plan_of(make_planner(), req, keys, idx, bandwidth_scale=SLOW_DISK, prefetch_target="dram").plan
    assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 64
    assert [(s.start, s.end, s.tier, s.target_tier) for s in plan.prefetch] == [(64, 128, "disk", "dram")]


def test_no_prefetch_when_everything_is_already_in_the_target():
    req, keys, idx = setup(["dram"] * 8)
    plan = plan_of(make_planner(), req, keys, idx, prefetch_target="dram").plan
    assert plan.action == PlanAction.MATERIALIZE and plan.prefetch == ()


def test_no_prefetch_when_it_would_not_pay_even_from_dram(tmp_path):
    greedy = write_policy(tmp_path, 'name = "default"\nmin_gain_ms = 100000.0\n')
    req, keys, idx = setup(["disk"] * 8)
    plan = plan_of(make_planner(), req, keys, idx, policy=greedy, prefetch_target="dram").plan
    assert plan.action == PlanAction.RECOMPUTE and plan.prefetch == ()


# ------------------------------------------------------------------------------------------------ best, to_plan


def cand(blocks, gain, tiers=("dram",)):
    sources = tuple((i, i + 1, t, "n1") for i, t in enumerate(tiers)) if blocks else ()
    return Candidate(blocks, sources, t_recompute_ms=gain, t_lookup_ms=0.0, t_transfer_ms=0.0, t_mount_ms=0.0)


def test_best_takes_the_highest_gain():
    assert best([cand(0, 0.0), cand(2, 5.0), cand(4, 3.0)]).blocks == 2


def test_best_breaks_ties_on_fewer_blocks():
    assert best([cand(4, 5.0), cand(2, 5.0), cand(3, 5.0 + 1e-12)]).blocks == 2
    assert best([cand(0, 0.0), cand(1, 0.0)]).blocks == 0


def test_best_is_independent_of_candidate_order():
    cs = [cand(2, 5.0, ("disk",)), cand(2, 5.0, ("dram",)), cand(1, 1.0)]
    assert best(cs) == best(list(reversed(cs)))


def test_to_plan_materialize_and_recompute():
    cost = CostModel(default_profile())
    req = make_request(range(100))
    c = Candidate(3, ((0, 2, "dram", "n1"), (2, 3, "disk", "n2")), 10.0, 0.05, 1.0, 0.01)
    plan = roundtrip(to_plan(req, c, action=PlanAction.MATERIALIZE, decision_id="x", page=16, transport="local",
                             reasons=["why"], rules=["r1"], revision="rev", epoch=2, cost=cost))  # fmt: skip
    assert plan.tokens_total == 100 and plan.tokens_reused == 48
    assert [(s.start, s.end, s.tier, s.node) for s in plan.spans] == [(0, 32, "dram", "n1"), (32, 48, "disk", "n2")]
    assert plan.predicted.gain_ms == pytest.approx(c.gain_ms)
    assert plan.predicted.ttft_ms == pytest.approx(cost.prefill_ms(100, 48) + 0.05 + 1.0 + 0.01)
    assert (plan.reasons, plan.rules, plan.policy_revision, plan.epoch) == (("why",), ("r1",), "rev", 2)
    rec = roundtrip(to_plan(req, c, action=PlanAction.RECOMPUTE, decision_id="y", page=16, transport="local",
                            cost=cost))  # fmt: skip
    assert rec.tokens_reused == 0 and rec.spans == ()
    assert rec.predicted.ttft_ms == pytest.approx(cost.prefill_ms(100))
    none = to_plan(req, None, action=PlanAction.RECOMPUTE, decision_id="z", page=16, transport="local", cost=cost)
    assert none.tokens_reused == 0 and none.predicted.gain_ms == 0.0
