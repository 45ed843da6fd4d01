"""P/D disaggregation: the two-phase world (prefill, then transfer or recompute, then decode) and its strategies."""

import ast
from pathlib import Path

import pytest
from _sim_fakes import BLOCK, BLOCK_BYTES, FakeView, request, tiny_profile

from nexuskv_sim.api import BaseStrategy, Decision, Fetch
from nexuskv_sim.pd import PDWorld, Pools, pd_cluster, pd_summary, simulate_pd
from nexuskv_sim.pd_routers import Aggregated, AlwaysTransfer, NexusPD, make_pd_strategy
from nexuskv_sim.trace import generate
from nexuskv_sim.world import World


def pd_world(reqs, strategy, pools, profile=None, delay=0.0):
    nodes = pools.nodes
    return PDWorld(reqs, strategy, pools=pools, node_model={n: "m" for n in nodes},
                   node_host={n: f"h-{n}" for n in nodes}, profile=profile or tiny_profile(),
                   report_delay_ms=delay)  # fmt: skip


def spaced(n, blocks=4, gap=10_000.0, out=3):
    """`n` requests sharing nothing, `gap` ms apart: each runs alone."""
    return [request(i, [1000 * i + j for j in range(blocks)], at=i * gap, out=out) for i in range(n)]


def test_always_transfer_sends_every_prompt_and_never_recomputes():
    pools = Pools(["p0", "p1"], ["d0", "d1"])
    recs = generate(40, seed=4, rate_per_s=20.0)
    res = simulate_pd(recs, ["always-transfer"], prefill=2, decode=2, profile=tiny_profile())["always-transfer"]
    assert res.completed == res.requests == 40 and len(res.ttft_ms) == 40
    assert res.recomputes == 0 and res.transfers + res.held == 40 and res.transfers >= 30
    assert res.transfer_bytes == res.bytes_by_link["nic"]  # P -> D only: nothing else crosses the NICs
    assert res.decode_prefill_tokens <= 40 * BLOCK  # the decode side computes at most a partial block each
    assert pools == pd_cluster(["m"], 2, 2)[0]


def test_the_transfers_of_one_decode_node_queue_and_the_ttft_includes_the_wait():
    p = tiny_profile()  # 5 ms of NIC per block, prefill 0.01 ms a token + 1 ms an iteration
    pools = Pools(["p0", "p1"], ["d0"])
    alone = pd_world([request(0, [1, 2, 3, 4])], AlwaysTransfer(pools), pools, p).run()
    m = p.model("m")
    prefill = m.overhead_ms + m.chunk_ms(4 * BLOCK, 0)
    last = m.overhead_ms + m.chunk_ms(1, 4 * BLOCK - 1)  # the decode node computes the last token: the first out
    assert alone.ttft_ms == [pytest.approx(prefill + 4 * 5.0 + last)]
    assert (alone.transfers, alone.transfer_bytes, alone.mean_transfer_ms) == (1, 4 * BLOCK_BYTES, pytest.approx(20.0))
    # two prompts prefilled at once on the two prefill nodes, both sent to d0: its NIC in takes their blocks in
    # turn (FIFO), so the first arrives after 7 block times and the second after 8
    both = pd_world([request(0, [1, 2, 3, 4]), request(1, [5, 6, 7, 8])], AlwaysTransfer(pools), pools, p).run()
    assert sorted(both.ttft_ms) == [pytest.approx(prefill + 7 * 5.0 + last), pytest.approx(prefill + 8 * 5.0 + last)]
    assert both.transfer_bytes == both.bytes_by_link["nic"] == 8 * BLOCK_BYTES


class _Spy(Aggregated):
    def __init__(self):
        super().__init__()
        self.ran: dict[int, str] = {}
        self.first: dict[int, str] = {}

    def decide(self, req, view):
        d = super().decide(req, view)
        self.ran[req.rid] = d.node
        return d

    def observe_done(self, req, node, ttft_ms):
        self.first[req.rid] = node


def test_aggregated_runs_each_request_whole_on_one_node_as_the_plain_world_does():
    pools = Pools(["p0", "p1"], ["d0", "d1"])
    reqs = [request(i, [i % 3, 10 + i], at=i * 3.0, out=5) for i in range(30)]
    spy = _Spy()
    res = pd_world(reqs, spy, pools).run()
    assert spy.first == spy.ran and len(set(spy.ran.values())) == 4  # first token where it ran; all four used
    assert (res.transfers, res.recomputes, res.held, res.transfer_bytes) == (0, 0, 0, 0)
    plain = World(reqs, Aggregated(), node_model={n: "m" for n in pools.nodes},
                  node_host={n: f"h-{n}" for n in pools.nodes}, profile=tiny_profile(), report_delay_ms=0.0).run()
    assert res.ttft_ms == plain.ttft_ms and res.completed == plain.completed == 30


@pytest.fixture
def nexus_on():
    made = []

    def make(profile, pools, **kw):
        s = NexusPD(profile, pools, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_on_a_near_dead_link_nexuskv_recomputes_once_it_has_measured_it_and_beats_always_transfer(nexus_on):
    p = tiny_profile(block_ms={"nic": 3000.0})  # 3 s a block: recomputing 4 blocks on the decode node takes 22 ms
    pools = Pools(["p0"], ["d0", "d1"])
    reqs = spaced(8)
    nexus = nexus_on(p, pools, links={"max_age_s": 3600.0})  # a measured link stays measured for the whole run
    res = pd_world(reqs, nexus, pools, p).run()
    base = pd_world(reqs, AlwaysTransfer(pools), pools, p).run()
    # the first handoffs trust the datasheet prior and transfer; their 12 s each teach the scheduler the link (the
    # kernel's estimator weighs its prior against the first sample), after which it recomputes every time
    assert 1 <= res.transfers <= 2 and res.recomputes == 8 - res.transfers
    assert nexus.handoffs == {"transfer": res.transfers, "recompute": res.recomputes}
    assert (base.transfers, base.recomputes) == (8, 0)
    assert res.transfer_bytes == res.transfers * 4 * BLOCK_BYTES and base.transfer_bytes == 8 * 4 * BLOCK_BYTES
    assert res.decode_prefill_tokens >= res.recomputes * 4 * BLOCK
    assert res.mean_ttft_ms < base.mean_ttft_ms / 5
    assert res.completed == base.completed == 8


def test_a_slow_links_estimate_ages_on_simulated_time_and_the_link_is_measured_again(nexus_on):
    # The kernels' clock is simulated time: with the default max_age_s (30 s), a link judged too slow is tried again
    # once its estimate is 30 simulated seconds old (the kernel's design for a link that may have recovered).
    p = tiny_profile(block_ms={"nic": 3000.0})
    pools = Pools(["p0"], ["d0", "d1"])
    reqs = spaced(8)  # 70 simulated seconds
    kept = pd_world(reqs, nexus_on(p, pools, links={"max_age_s": 3600.0}), pools, p).run()
    aged = pd_world(reqs, nexus_on(p, pools), pools, p).run()
    assert kept.transfers < aged.transfers < 8
    again = pd_world(reqs, nexus_on(p, pools), pools, p).run()
    assert (again.transfers, again.ttft_ms) == (aged.transfers, aged.ttft_ms)  # deterministic


def test_on_a_fast_link_nexuskv_transfers(nexus_on):
    p = tiny_profile(block_ms={"nic": 0.1}, per_token_ms=0.1)  # a block: 0.1 ms to send, 51 ms to recompute
    pools = Pools(["p0", "p1"], ["d0", "d1"])
    nexus = nexus_on(p, pools)
    res = pd_world(spaced(8, blocks=6, gap=500.0), nexus, pools, p).run()
    assert (res.transfers, res.recomputes) == (8, 0) and res.transfer_bytes == 8 * 6 * BLOCK_BYTES
    assert res.decode_prefill_tokens == 8  # one token each: the one that emits the first token


def test_nexuskv_hands_off_to_the_decode_node_that_holds_the_prefix(nexus_on):
    p = tiny_profile(block_ms={"nic": 20.0})
    pools = Pools(["p0"], ["d0", "d1"])
    nexus = nexus_on(p, pools)
    nexus.decide(request(0, [1]), FakeView(pools.nodes))  # builds the model's kernel
    view = FakeView(pools.nodes, held={"d1": (6, 6, 6)})
    d = nexus.handoff(request(1, list(range(8))), "p0", view)
    assert d.node == "d1"
    assert d.fetches == (Fetch("d1", "hbm", 0, 6), Fetch("p0", "hbm", 6, 8))  # only the missing suffix is sent


def test_the_decision_side_knows_links_only_from_measurements(nexus_on):
    pools = Pools(["p0"], ["d0"])
    fast = nexus_on(tiny_profile(block_ms={"nic": 0.01}), pools)
    dead = nexus_on(tiny_profile(block_ms={"nic": 1e7}), pools)
    req = request(0, list(range(10)))
    for s in (fast, dead):
        s.decide(req, FakeView(pools.nodes))
    # the simulator's links differ a billionfold; before any measurement both schedulers decide alike (the prior)
    first = [s.handoff(req, "p0", FakeView(pools.nodes)) for s in (fast, dead)]
    assert first[0] == first[1] and first[0].fetches == (Fetch("p0", "hbm", 0, 10),)
    for _ in range(3):  # what the world reports after slow transfers: only then does it recompute
        dead.observe_transfer("nic", 10 * BLOCK_BYTES, 60_000.0, source="p0", tier="hbm", node="d0")
    assert dead.handoff(request(1, list(range(10))), "p0", FakeView(pools.nodes)).fetches == ()
    # and the strategies' module reads nothing of the simulator's ground truth: no profile timing, links, engines
    src = (Path(__file__).resolve().parents[1] / "nexuskv_sim" / "pd_routers.py").read_text()
    tree = ast.parse(src)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not imported & {"World", "PDWorld", "Engine", "Link", "hold", "DelayedView", "ModelProfile"}
    attrs_read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs_read & {"links", "engines", "hosts", "hbm", "chunk_ms", "step_ms", "prefill_alone_ms",
                             "bytes_per_ms", "per_token_ms", "models", "profile"}  # fmt: skip


def test_runs_are_deterministic():
    recs = generate(60, seed=3, rate_per_s=10.0)
    prof = tiny_profile(block_ms={"nic": 40.0})
    runs = [simulate_pd(recs, ["always-transfer", "nexuskv", "aggregated"], profile=prof) for _ in range(2)]
    for name in ("always-transfer", "nexuskv", "aggregated"):
        a, b = runs[0][name], runs[1][name]
        assert a.ttft_ms == b.ttft_ms and a.completed == 60
        assert (a.transfers, a.recomputes, a.held, a.transfer_bytes) == (b.transfers, b.recomputes, b.held,
                                                                          b.transfer_bytes)  # fmt: skip
    assert "always-transfer" in pd_summary(runs[0]) and "recomputes" in pd_summary(runs[0])


class _Wrong(BaseStrategy):
    name = "wrong"
    disaggregated = True

    def __init__(self, prefill_to, decode_to):
        self.prefill_to, self.decode_to = prefill_to, decode_to

    def decide(self, req, view):
        return Decision(self.prefill_to)

    def handoff(self, req, prefill_node, view):
        return Decision(self.decode_to, (Fetch(prefill_node, "hbm", 0, req.blocks),))


def test_a_strategy_must_keep_to_the_pools():
    pools = Pools(["p0"], ["d0"])
    with pytest.raises(ValueError, match="not a prefill node"):
        pd_world([request(0, [1])], _Wrong("d0", "d0"), pools).run()
    with pytest.raises(ValueError, match="not a decode node"):
        pd_world([request(0, [1])], _Wrong("p0", "p0"), pools).run()
    with pytest.raises(ValueError):
        Pools(["a"], ["a"])
    with pytest.raises(ValueError, match="unknown P/D strategy"):
        make_pd_strategy("round-robin", pools, tiny_profile())


def test_decode_contends_with_a_recompute_on_the_decode_node():
    # request 0 decodes 200 tokens on d0 (0.5 ms a decode step); request 1 is recomputed there meanwhile: its
    # prefill chunk rides in the same iterations, so it is slower than alone and request 0's decode is too
    p = tiny_profile(per_decode_ms=0.5)
    pools = Pools(["p0"], ["d0"])

    class Recompute(AlwaysTransfer):
        def handoff(self, req, prefill_node, view):
            return Decision("d0") if req.rid == 1 else super().handoff(req, prefill_node, view)

    alone = pd_world([request(1, [5, 6, 7, 8], at=30.0)], Recompute(pools), pools, p).run()
    both = pd_world([request(0, [1, 2], out=200), request(1, [5, 6, 7, 8], at=30.0)], Recompute(pools), pools,
                    p).run()  # fmt: skip
    assert alone.recomputes == 1 and alone.decode_prefill_tokens == 4 * BLOCK
    assert both.ttft_ms[1] > alone.ttft_ms[0]
