"""Routing in one pass equals pricing every node by its own plan: same node, same prediction, same options.

The reference is the router with `one_pass = False`: every candidate node runs the planner's whole `decide`
(what `route` did before the one pass). Random holdings (own tiers, peers, engine-resident blocks, partial group
masks), queues, link estimates, broken breakers and route rules; the one pass must choose the same node with the
same option, and every option it reports must equal the reference's for that node.
"""

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv import RESIDENT_TIER, Kernel, KernelConfig, Location, NodeState
from tests.conftest import SECRET, layout_of, make_request

PAGE = 16
NODES = tuple("abcdef")
LAYOUT = layout_of("dense", "dense")
RULES = {
    "none": None,
    "exclude": """
[[route]]
name = "not-in-ap"
when = "target.labels['zone'] == 'ap'"
[[route]]
name = "watch"
effect = "audit"
when = "target.reuse_tokens > 0"
""",
    "weight": """
[[route]]
name = "not-in-ap"
when = "target.labels['zone'] == 'ap'"
[[route]]
name = "busy"
effect = "weight"
when = "target.running_decodes > 4"
weight_expr = "0.5 + double(target.running_decodes) / 8.0"
""",
    "min-gain": "min_gain_ms = 40.0\n",
}


def kernel(rules: str | None) -> Kernel:
    """A scheduler's kernel that reaches peers over tcp (25 Gbit/s in its profile until links are measured)."""
    tmp = Path(tempfile.mkdtemp(prefix="nexuskv-route-"))
    profile = json.loads(Path("profiles/replay-llama-8b-gpu.json").read_text())
    profile["transports"]["tcp"] = {"bandwidth_bytes_per_s": 3.125e9, "latency_ms": 0.05}
    (tmp / "profile.json").write_text(json.dumps(profile))
    if rules is not None:
        (tmp / "policies").mkdir()
        (tmp / "policies" / "default.toml").write_text(rules)
    cfg = KernelConfig(node="router", profile=str(tmp / "profile.json"),
                       policies=str(tmp / "policies") if rules is not None else None,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"},
                              "disk": {"store": "dram", "capacity_bytes": "1MiB"}},
                       transports=("local", "tcp"), prefetch_max_tasks=0,
                       breaker_cooldown_s=0.0)  # broken breakers are half-open at once: routes only peek at them
    return Kernel(cfg, secret=SECRET)


@pytest.fixture(scope="module")
def kernels():
    """One kernel per rule set for the whole module (examples use fresh token ranges; what earlier ones left in
    the index, the links and the breakers is seen alike by both routers)."""
    ks = {name: kernel(rules) for name, rules in RULES.items()}
    yield ks
    for k in ks.values():
        k.close()


holding = st.lists(st.tuples(st.sampled_from(("dram", "disk", RESIDENT_TIER)), st.sampled_from(NODES),
                             st.sampled_from((1, 3, 3))), max_size=3)  # fmt: skip
node_state = st.builds(
    NodeState, node=st.just("x"), queued_prefill_tokens=st.integers(0, 30_000), waiting_requests=st.integers(0, 4),
    running_decodes=st.integers(0, 12), decode_ms=st.sampled_from((0.0, 0.5, 2.0)),
    queue_ms=st.one_of(st.none(), st.floats(0, 3000)), overlap_loads=st.booleans(),
    labels=st.sampled_from(({"zone": "us"}, {"zone": "eu"}, {"zone": "ap"})))  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=st.sampled_from(sorted(RULES)), blocks=st.lists(holding, min_size=1, max_size=40),
       states=st.lists(node_state, min_size=1, max_size=len(NODES) + 2), extra=st.integers(0, 15),
       links=st.dictionaries(st.sampled_from(NODES), st.floats(1e6, 1e11), max_size=3),
       broken=st.sets(st.sampled_from(("disk", "peer:a", "peer:b"))), prefix=st.integers(0, 10**9))  # fmt: skip
def test_one_pass_equals_every_nodes_own_plan(kernels, rules, blocks, states, extra, links, broken, prefix):
    names = [*NODES, "g", "h"]  # g and h hold nothing
    nodes = [NodeState(names[i], **{k: getattr(s, k) for k in ("queued_prefill_tokens", "waiting_requests",
                                                                  "running_decodes", "decode_ms", "queue_ms",
                                                                  "overlap_loads", "labels")})
             for i, s in enumerate(states)]  # fmt: skip
    req = make_request(range(prefix, prefix + PAGE * len(blocks) + extra), layout=LAYOUT,
                       tenant="acme")  # fmt: skip
    k = kernels[rules]
    k.router.one_pass = True
    keys = k.keys(req)
    for key, held in zip(keys, blocks, strict=False):
        for tier, node, mask in held:
            k.index.insert(key, Location(tier, node, 1), mask)
    for node, bps in links.items():
        for _ in range(3):
            k.links.observe(f"peer:{node}", 1e6, 1e6 / bps)
    for name in broken:
        k.health.breaker(name).failure("down", severe=True)
    try:
        fast = k.route(req, nodes, keys=keys, deadline_ms=10_000)
        k.router.one_pass = False
        full = k.route(req, nodes, keys=keys, deadline_ms=10_000)
    finally:
        for name in broken:  # closed again for the next example
            k.health.breaker(name).success()
    assert not fast.fail_open and not full.fail_open
    assert fast.node == full.node
    assert fast.reasons[0] == full.reasons[0]
    if fast.node is not None:
        assert fast.option(fast.node) == full.option(full.node)
    for option in fast.options:  # whatever the one pass priced, it priced as the node's own plan does
        assert option == full.option(option.node)


def test_nodes_that_cannot_win_are_not_priced_and_the_decision_says_the_same(kernels):
    req = make_request(range(7, 7 + PAGE * 32))
    nodes = [NodeState(f"n{i}", queued_prefill_tokens=100 * i) for i in range(40)]
    k = kernels["none"]
    k.router.one_pass = True
    keys = k.keys(req)
    k.index.insert_many(keys, Location("dram", "n30", 1))
    fast = k.route(req, nodes, keys=keys, deadline_ms=10_000)
    k.router.one_pass = False
    full = k.route(req, nodes, keys=keys, deadline_ms=10_000)  # 40 whole plans: more than the default budget
    # n30 holds the prefix but waits 240 ms; n0 recomputes 512 tokens in 62 ms: only n0 and n1 can win
    assert {o.node for o in fast.options} == {"n0", "n1"}
    assert len(full.options) == 40
    assert fast.node == full.node == "n0" and fast.reasons == full.reasons
    idle = [NodeState(n.node) for n in nodes]  # now the holder wins
    k.router.one_pass = True
    fast = k.route(req, idle, keys=keys)
    assert fast.node == "n30" and {o.node for o in fast.options} == {"n30", "n0"}  # the best, the next best
    every = k.route(req, idle, keys=keys, all_options=True)
    assert len(every.options) == 40 and every.node == "n30" and every.option("n30") == fast.option("n30")


def test_a_route_leaves_a_half_open_breakers_trial_to_the_plan(kernels):
    # a route is judged, never executed: it peeks at breakers; the trial is the chosen node's plan's to take
    k = kernels["none"]
    req = make_request(range(11, 11 + PAGE * 8))
    keys = k.keys(req)
    k.index.insert_many(keys, Location("disk", "router", 1))
    k.health.breaker("disk").failure("down", severe=True)  # cooldown 0: the next `allow` would take the trial
    try:
        for one_pass in (True, False):
            k.router.one_pass = one_pass
            d = k.route(req, [NodeState("router"), NodeState("other")], keys=keys, deadline_ms=10_000)
            assert d.option(d.node).reuse_tokens == 0  # the disk is not closed: nobody plans on it
            assert k.health.breaker("disk").state == "open"  # and the route took no trial
    finally:
        k.health.breaker("disk").success()
