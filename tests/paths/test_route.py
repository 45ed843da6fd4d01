"""Kernel.route: predicted TTFT per node from its holdings and its queue, route rules, fail-open, concurrency."""

import asyncio
import random
import threading
import time

import pytest

from nexuskv import Kernel, KernelConfig, Location, NodeState
from tests.conftest import SECRET, make_request, run_threads

PROFILE = "profiles/replay-llama-8b-gpu.json"


def make_kernel(tmp_path=None, policies: str | None = None) -> Kernel:
    cfg = KernelConfig(node="a", profile=PROFILE, policies=policies,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"},
                              "disk": {"store": "dram", "capacity_bytes": "1MiB"}})  # fmt: skip
    return Kernel(cfg, secret=SECRET)


def hold(kernel: Kernel, req, node: str, tier: str, blocks: int) -> None:
    """Say in the index that `node` holds the first `blocks` blocks of `req` in `tier` (a cluster index would)."""
    keys = kernel.keys(req)
    kernel.index.insert_many(keys[:blocks], Location(tier, node, 1))


def expected_ms(kernel: Kernel, req, ns: NodeState, blocks: int, tier: str) -> float:
    """The documented prediction, written out: queue estimate + lookup + transfer + mount + prefill of the rest."""
    p = kernel.cost.profile.prefill
    queue = ns.queue_ms if ns.queue_ms is not None else (
        ns.waiting_requests * p.base_ms + ns.queued_prefill_tokens * p.per_token_ms + ns.running_decodes * ns.decode_ms)
    tokens = len(req.token_ids)
    reused = blocks * req.layout.page_size
    plan = kernel.cost.prefill_ms(tokens, reused)
    if blocks:
        nbytes = kernel.cost.bytes_per_token * reused
        plan += kernel.cost.lookup_ms() + kernel.cost.transfer_ms(nbytes, tier) + kernel.cost.mount_ms(blocks)
    return queue + plan


def test_the_node_holding_the_state_wins_when_queues_are_equal():
    req = make_request(range(16 * 40))
    with make_kernel() as k:
        hold(k, req, "b", "dram", 40)
        d = k.route(req, [NodeState("a"), NodeState("b"), NodeState("c")])
        assert d.node == "b" and not d.fail_open
        b = d.option("b")
        assert b.reuse_tokens == 640 and b.sources == ("dram@b",) and b.spans == ((0, 40, "dram", "b"),)
        assert b.predicted_ttft_ms == pytest.approx(expected_ms(k, req, NodeState("b"), 40, "dram"))
        assert d.option("a").reuse_tokens == 0  # no remote transport: a cannot read b's state
        assert d.option("a").predicted_ttft_ms == pytest.approx(k.cost.prefill_ms(640))
        assert "b: predicted TTFT" in d.reasons[0] and "reuse 640 tokens from dram@b" in d.reasons[0]


def test_a_long_queue_sends_the_request_elsewhere_and_the_prediction_says_why():
    req = make_request(range(16 * 40))
    with make_kernel() as k:
        hold(k, req, "b", "dram", 40)
        busy = NodeState("b", queued_prefill_tokens=50_000, waiting_requests=4)
        d = k.route(req, [NodeState("a"), busy])
        assert d.node == "a"
        assert d.option("b").queue_ms == pytest.approx(4 * 20.0 + 50_000 * 0.08)
        assert d.option("b").predicted_ttft_ms == pytest.approx(expected_ms(k, req, busy, 40, "dram"))
        assert "next best b" in d.reasons[1]


def test_the_schedulers_queue_ms_wins_over_the_estimate_and_decodes_count():
    req = make_request(range(64))
    with make_kernel() as k:
        d = k.route(req, [NodeState("a", queued_prefill_tokens=10**6, queue_ms=5.0),
                          NodeState("b", running_decodes=10, decode_ms=2.0)])  # fmt: skip
        assert d.option("a").queue_ms == 5.0 and d.option("b").queue_ms == 20.0 and d.node == "a"


def test_ties_break_on_queue_then_name_and_the_answer_is_deterministic():
    req = make_request(range(64))
    with make_kernel() as k:
        nodes = [NodeState("c"), NodeState("b"), NodeState("a")]
        assert {k.route(req, nodes).node for _ in range(5)} == {"a"}
        assert k.route(req, list(reversed(nodes))).node == "a"


def test_slower_tier_on_one_node_loses_to_a_faster_tier_on_another():
    req = make_request(range(16 * 64))
    with make_kernel() as k:
        hold(k, req, "a", "disk", 64)
        hold(k, req, "b", "dram", 64)
        k.bandwidth_scale = {"disk": 0.001}  # a congested disk: reading it costs more than recomputing
        d = k.route(req, [NodeState("a"), NodeState("b")])
        assert d.node == "b" and d.option("b").sources == ("dram@b",)
        assert d.option("a").reuse_tokens == 0  # the planner recomputes rather than read a crawling disk


def write_rules(tmp_path, text: str) -> str:
    (tmp_path / "default.toml").write_text(text)
    return str(tmp_path)


RULES = """
[[route]]
name = "eu-only"
when = "request.tenant == 'acme' && target.labels['zone'] != 'eu'"
message = "acme stays in the EU"

[[route]]
name = "avoid-busy"
effect = "weight"
when = "target.running_decodes > 32"
weight_expr = "1.0 + double(target.running_decodes) / 64.0"

[[route]]
name = "watch-gpu"
effect = "audit"
when = "target.labels['gpu'] == 'a10'"
"""


def test_route_rules_exclude_weight_and_audit(tmp_path):
    req = make_request(range(16 * 8))
    with make_kernel(policies=write_rules(tmp_path, RULES)) as k:
        nodes = [NodeState("us", labels={"zone": "us", "gpu": "h100"}),
                 NodeState("eu1", running_decodes=64, labels={"zone": "eu", "gpu": "h100"}),
                 NodeState("eu2", running_decodes=8, labels={"zone": "eu", "gpu": "a10"})]  # fmt: skip
        d = k.route(req, nodes)
        us, eu1, eu2 = d.option("us"), d.option("eu1"), d.option("eu2")
        assert us.excluded and us.rules == ("eu-only",) and us.messages == ("eu-only: acme stays in the EU",)
        assert eu1.weight == 2.0 and eu1.score_ms == pytest.approx(2 * eu1.predicted_ttft_ms)
        assert not eu2.excluded and eu2.weight == 1.0 and eu2.messages == ("watch-gpu",)
        assert d.node == "eu2" and any("excluded: us (eu-only)" in r for r in d.reasons)
        other = k.route(make_request(range(16 * 8), tenant="globex"), nodes)
        assert not other.option("us").excluded  # the rule is about acme only


def test_every_node_excluded_gives_no_node_and_says_so(tmp_path):
    req = make_request(range(64))
    with make_kernel(policies=write_rules(tmp_path, RULES)) as k:
        d = k.route(req, [NodeState("x", labels={"zone": "us", "gpu": "h100"}),
                          NodeState("y", labels={"zone": "ap", "gpu": "h100"})])  # fmt: skip
        assert d.node is None and not d.fail_open
        assert d.reasons == ("every node excluded by route rules: x: eu-only; y: eu-only",)


def test_an_ignored_failing_rule_is_skipped_and_its_error_reported(tmp_path):
    rules = """
[[route]]
name = "zone-check"
failure = "ignore"
when = "target.labels['zone'] == 'ap'"

[[route]]
name = "no-weight-on-exclude"
when = "target.running_decodes > 100"
"""
    req = make_request(range(64))
    with make_kernel(policies=write_rules(tmp_path, rules)) as k:
        d = k.route(req, [NodeState("x")])
        assert d.node == "x" and not d.option("x").excluded
        assert d.option("x").messages == ("error: zone-check: 1:14: no such key: 'zone'",)


def test_a_failing_route_rule_excludes_its_node_by_default(tmp_path):
    req = make_request(range(64))
    with make_kernel(policies=write_rules(tmp_path, RULES)) as k:
        d = k.route(req, [NodeState("nolabels"), NodeState("eu", labels={"zone": "eu", "gpu": "h100"})])
        bad = d.option("nolabels")
        assert bad.excluded and "evaluation failed" in bad.messages[0] and d.node == "eu"


def test_failures_fail_open_to_the_least_loaded_node_and_are_counted(monkeypatch):
    req = make_request(range(64))
    with make_kernel() as k:
        def broken(*a, **kw):
            raise RuntimeError("matcher down")

        monkeypatch.setattr(k.reads, "match", broken)
        nodes = [NodeState("a", queued_prefill_tokens=900), NodeState("b", queued_prefill_tokens=100),
                 NodeState("c", queued_prefill_tokens=100, running_decodes=3)]  # fmt: skip
        d = k.route(req, nodes)
        assert d.fail_open and d.node == "b" and d.options == ()
        assert d.reasons == ("fail-open: match failed: RuntimeError: matcher down; least-loaded b",)
        assert k.router.fallbacks == 1


def test_a_passed_deadline_fails_open():
    req = make_request(range(16 * 40))
    with make_kernel() as k:
        d = k.route(req, [NodeState("a"), NodeState("b")], deadline_ms=0.0)
        assert d.fail_open and d.node == "a" and "deadline 0 ms passed" in d.reasons[0]


def test_failing_open_still_keeps_the_tenants_route_exclusions(tmp_path, monkeypatch):
    req = make_request(range(64))
    with make_kernel(policies=write_rules(tmp_path, RULES)) as k:
        nodes = [NodeState("us", labels={"zone": "us", "gpu": "h100"}),
                 NodeState("eu", queued_prefill_tokens=9000, labels={"zone": "eu", "gpu": "h100"})]  # fmt: skip
        d = k.route(req, nodes, deadline_ms=0.0)
        assert d.fail_open and d.node == "eu"  # the idle node is in the US: acme may not go there
        assert d.reasons[0].endswith("least-loaded eu (excluded by route rules: us)")
        d = k.route(req, nodes[:1], deadline_ms=0.0)
        assert d.fail_open and d.node is None and "route rules excluded every node" in d.reasons[0]

        class Broken:
            def for_tenant(self, tenant):
                raise RuntimeError("policy store down")

        monkeypatch.setattr(k.live, "current", Broken())
        d = k.route(req, nodes)
        assert d.fail_open and d.node is None and "could not be evaluated" in d.reasons[0]


def test_bad_node_lists_and_reports_are_errors():
    req = make_request(range(64))
    with make_kernel() as k:
        with pytest.raises(ValueError, match="at least one"):
            k.route(req, [])
        with pytest.raises(ValueError, match=r"repeat: \['a'\]"):
            k.route(req, [NodeState("a"), NodeState("a")])
    past = r"must be an int >= 0 and < 2\^53, got"
    for bad, match in ((dict(queued_prefill_tokens=-1), f"queued_prefill_tokens {past} -1"),
                       (dict(waiting_requests=10**400), f"waiting_requests {past} 'an int of 1329 bits'"),
                       (dict(running_decodes=2**53), f"running_decodes {past} 9007"),
                       (dict(queue_ms=10**400), "queue_ms must be a finite number >= 0, got inf"),
                       (dict(running_decodes=1.5), "running_decodes must be an int"),
                       (dict(waiting_requests=True), "waiting_requests must be an int"),
                       (dict(decode_ms=float("inf")), "decode_ms must be a finite number >= 0, got inf"),
                       (dict(queue_ms=float("nan")), "queue_ms must be a finite number"),
                       (dict(labels={"zone": 1}), "labels must map strings to strings"),
                       (dict(labels=None), "labels must map strings to strings")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            NodeState("a", **bad)
    for node in (None, ""):
        with pytest.raises(ValueError, match="node must be a non-empty string"):
            NodeState(node)
    from types import MappingProxyType

    scraped = NodeState("a", queued_prefill_tokens=3.0, running_decodes=2, queue_ms=5, labels=MappingProxyType({}))
    assert scraped.queued_prefill_tokens == 3 and type(scraped.queued_prefill_tokens) is int
    assert scraped.queue_ms == 5.0 and scraped.labels == {}  # whole numbers and mappings from other sources


def test_a_generator_of_nodes_is_read_once_and_priced():
    req = make_request(range(64))
    with make_kernel() as k:
        d = k.route(req, (NodeState(n) for n in "ab"))
        assert d.node == "a" and len(d.options) == 2


def test_aroute_answers_like_route():
    req = make_request(range(16 * 8))
    with make_kernel() as k:
        hold(k, req, "b", "dram", 8)
        nodes = [NodeState("a"), NodeState("b")]
        assert asyncio.run(k.aroute(req, nodes)) == k.route(req, nodes)


def test_many_threads_route_like_one_thread_against_a_reference():
    """Eight threads route random requests while others change the index; each answer equals the reference
    answer computed alone for the same index state (holdings of a request never change while it is routed)."""
    rng = random.Random(7)
    with make_kernel() as k:
        cases = []
        for i in range(24):
            req = make_request(range(i * 10_000, i * 10_000 + 16 * rng.randint(1, 30)))
            holder, tier = rng.choice("abc"), rng.choice(["dram", "disk"])
            hold(k, req, holder, tier, rng.randint(0, len(k.keys(req))))
            nodes = [NodeState(n, queued_prefill_tokens=rng.randint(0, 4000)) for n in "abc"]
            cases.append((req, nodes, k.route(req, nodes)))
        noise = make_request(range(900_000, 900_000 + 16 * 20))
        stop = threading.Event()
        mismatches = []

        def churn() -> None:
            while not stop.is_set():
                hold(k, noise, "c", "dram", 20)
                for key in k.keys(noise):
                    k.index.remove(key)

        t = threading.Thread(target=churn)
        t.start()
        try:
            def worker(i: int) -> None:
                for j in range(60):
                    req, nodes, want = cases[(i * 7 + j) % len(cases)]
                    got = k.route(req, nodes)
                    if got != want:
                        mismatches.append((req.request_id, got.node, want.node))

            run_threads(worker, 8)
        finally:
            stop.set()
            t.join()
        assert mismatches == []
        assert k.router.fallbacks == 0


def test_the_scheduler_loop_in_the_docs_runs(tmp_path):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "routing.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "def schedule" in b)
    ns: dict = {}
    exec(compile(code, "docs/routing.md", "exec"), ns)
    (tmp_path / "default.toml").write_text(RULES)
    with make_kernel(policies=str(tmp_path)) as k:
        shared = make_request(range(16 * 30), tenant="globex")
        hold(k, shared, "b", "dram", 30)
        reqs = [make_request(range(16 * 30), tenant="globex", request_id=f"g{i}") for i in range(3)]
        reqs.append(make_request(range(64), tenant="acme", request_id="a0"))
        reports = {"a": {"queued_tokens": 0, "waiting": 0, "decoding": 0, "labels": {"zone": "us", "gpu": "h100"}},
                   "b": {"queued_tokens": 0, "waiting": 0, "decoding": 0, "labels": {"zone": "us", "gpu": "h100"}}}
        got = ns["schedule"](k, reqs, reports)
    assert got[0] == ("g0", "b")  # b holds the prefix
    assert [n for _, n in got[:3]].count("b") >= 2  # what it sent counts as queued: not everything piles onto b
    assert got[3][0] == "a0" and got[3][1].startswith("rejected: every node excluded by route rules")


def test_route_stops_hashing_and_matching_when_its_deadline_passes(monkeypatch):
    """A long request's keys are hashed in chunks with the deadline checked between them, as in `plan`."""
    import time

    from tests.paths.test_read import TickClock

    cfg = KernelConfig(node="a", keyer={"name": "python"}, matcher={"name": "dict"})  # Python's clock, not C's
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request([(i * 7919) % 30_000 for i in range(16 * 2048)])
        chunks = []
        keyer = type(k.keyer)
        real = keyer._blocks
        monkeypatch.setattr(keyer, "_blocks", lambda *a: chunks.append(1) or real(*a))
        monkeypatch.setattr(time, "perf_counter", TickClock())
        d = k.route(req, [NodeState("a"), NodeState("b")], deadline_ms=0.35)
        monkeypatch.undo()
    assert d.fail_open and "deadline 0.35 ms passed in keys" in d.reasons[0]
    assert 1 <= len(chunks) <= 3 < 2048 // k.keyer.deadline_chunk  # not every chunk hashed


def test_route_checks_its_deadline_between_nodes(monkeypatch):
    """One-pass routing prices 500 nodes holding nothing from about five clock reads (one plan for all of them), so
    the clock moves 2 ms a read: the 5 ms deadline passes in the middle of routing and the route fails open."""
    import time

    from tests.paths.test_read import TickClock

    with make_kernel() as k:
        req = make_request(range(64))
        keys = k.keys(req)
        monkeypatch.setattr(time, "perf_counter", TickClock(2e-3))
        d = k.route(req, [NodeState(f"n{i}") for i in range(500)], deadline_ms=5.0, keys=keys)
        monkeypatch.undo()
    assert d.fail_open and "deadline 5 ms passed in" in d.reasons[0]


def test_route_bounds_the_candidate_count():
    from nexuskv.paths.route import MAX_NODES

    with make_kernel() as k:
        with pytest.raises(ValueError, match=f"at most {MAX_NODES}"):
            k.route(make_request(range(64)), [NodeState(f"n{i}") for i in range(MAX_NODES + 1)])
        assert k.route(make_request(range(64)), [NodeState(f"n{i}") for i in range(64)]).node is not None


def test_failing_open_over_thousands_of_nodes_is_bounded_and_never_picks_an_unjudged_node(tmp_path, monkeypatch):
    """Review of finding 7: fail-open judged every node's route rules after the deadline had passed, unbounded."""
    req = make_request(range(64))
    with make_kernel(policies=write_rules(tmp_path, RULES)) as k:
        nodes = [NodeState(f"n{i:04d}", queued_prefill_tokens=1000 + i, labels={"zone": "us", "gpu": "h100"})
                 for i in range(4095)] + [NodeState("eu-idle", labels={"zone": "eu", "gpu": "h100"})]  # fmt: skip
        judged = []
        real = type(k.policies.for_tenant("acme")).evaluate

        def counting(self, kind, activation, *a, **kw):
            judged.append(activation["node"])
            time.sleep(0.0005)  # a slow rule: 4096 of them would take seconds
            return real(self, kind, activation, *a, **kw)

        monkeypatch.setattr(type(k.policies.for_tenant("acme")), "evaluate", counting)
        d = k.route(req, nodes, deadline_ms=0.0)
        assert d.fail_open and len(judged) < len(nodes)  # stopped at the grace budget, not after every node
        assert d.node is None and "route rules excluded every node" in d.reasons[0]  # eu-idle, last, was not judged


def test_engine_resident_blocks_count_for_their_node_only_at_no_transfer_and_no_mount():
    """A node's engine cache (RESIDENT_TIER, fed from its KV events) prices its own routes; never a peer's or a plan."""
    from nexuskv import RESIDENT_TIER

    req = make_request(range(16 * 40))
    with make_kernel() as k:
        hold(k, req, "b", RESIDENT_TIER, 30)  # b's engine holds 30 blocks on its GPU
        hold(k, req, "b", "dram", 40)  # and NexusKV's dram on b the whole prompt
        d = k.route(req, [NodeState("a"), NodeState("b")])
        b = d.option("b")
        assert d.node == "b" and b.reuse_tokens == 640
        assert b.spans == ((0, 30, RESIDENT_TIER, "b"), (30, 40, "dram", "b"))
        nbytes = k.cost.bytes_per_token * 16 * 10  # only the 10 dram blocks move and are mounted
        want = (k.cost.prefill_ms(640, 640) + k.cost.lookup_ms() + k.cost.transfer_ms(nbytes, "dram")
                + k.cost.mount_ms(10))  # fmt: skip
        assert b.predicted_ttft_ms == pytest.approx(want)
        assert b.predicted_ttft_ms < expected_ms(k, req, NodeState("b"), 40, "dram")
        assert d.option("a").reuse_tokens == 0  # b's GPU is no source for a: nothing fetches engine blocks
        hold(k, req, "a", RESIDENT_TIER, 40)  # this kernel's own node's engine holds it all
        assert d.option("a").reuse_tokens == 0 and k.route(req, [NodeState("a")]).options[0].reuse_tokens == 640
        plan = k.plan(req)  # a plan loads state: the engine's cache is never one of its sources
        assert plan.action.value == "recompute" and not plan.spans


def test_a_node_holding_only_engine_resident_blocks_wins_and_the_reason_names_them():
    from nexuskv import RESIDENT_TIER

    req = make_request(range(16 * 40))
    with make_kernel() as k:
        hold(k, req, "c", RESIDENT_TIER, 40)
        d = k.route(req, [NodeState("a"), NodeState("c")])
        c = d.option("c")
        assert d.node == "c" and c.sources == (f"{RESIDENT_TIER}@c",) and not c.prefetch
        assert c.predicted_ttft_ms == pytest.approx(k.cost.prefill_ms(640, 640) + k.cost.lookup_ms())
        assert f"reuse 640 tokens from {RESIDENT_TIER}@c" in d.reasons[0]


def test_a_tier_cannot_take_the_engine_caches_name():
    """A NexusKV tier named like RESIDENT_TIER would be priced free in routes and never read by plans."""
    from nexuskv import RESIDENT_TIER, ConfigError

    for name in (RESIDENT_TIER, RESIDENT_TIER.upper()):
        cfg = KernelConfig(node="a", profile=PROFILE, tiers={name: {"store": "dram", "capacity_bytes": "1MiB"}})
        with pytest.raises(ConfigError, match=f"tiers.{name}: the name {RESIDENT_TIER!r} is reserved"):
            Kernel(cfg, secret=SECRET)
