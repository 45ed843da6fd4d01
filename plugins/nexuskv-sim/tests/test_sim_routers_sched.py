import pytest
from _sim_fakes import BLOCK_BYTES, FakeView, request, tiny_profile

from nexuskv_sim.api import Fetch
from nexuskv_sim.profile import ModelProfile
from nexuskv_sim.routers_sched import STRATEGIES, LlmdScheduler, MooncakeConductor, PrefillTable, make_strategy


def test_llmd_scores_are_the_weighted_scorers():
    view = FakeView(("n0", "n1", "n2"), load={"n0": {"waiting": 4, "used": 50}, "n1": {"waiting": 2, "used": 0},
                                               "n2": {"waiting": 0, "used": 100}})  # fmt: skip
    s = LlmdScheduler()
    scores = s.scores(request(0, [1, 2]), view)
    # no prefix anywhere; kv 1 - used/100; queue (4 - q) / 4
    assert scores == {"n0": pytest.approx(2 * 0.5 + 0), "n1": pytest.approx(2 * 1 + 2 * 0.5),
                      "n2": pytest.approx(0 + 2 * 1)}  # fmt: skip
    assert s.decide(request(0, [1, 2]), view).node == "n1"
    # the prefix scorer now sees the prompt on n1 (weight 3); only the first 4096 tokens (8 blocks) count
    after = s.scores(request(1, [1, 2, 3, 4]), view)
    assert after["n1"] == pytest.approx(3 * 2 / 4 + 2 + 1)
    long = s.scores(request(2, [1, 2, *range(10, 30)]), view)
    assert long["n1"] == pytest.approx(3 * 2 / 8 + 2 + 1)


def test_prefill_table_reproduces_its_samples_and_grows():
    m = ModelProfile("x", 1, 5.0, 0.05, 2e-6, 0.0, 0.0)
    t = PrefillTable.from_profile(m, 8192)
    for n in (512, 8192, 65536):
        for c in (0, 16384):
            assert t.ms(n, c) == pytest.approx(m.prefill_alone_ms(n, c, 8192))
    assert t.ms(3000, 0) < t.ms(3000, 20000) < t.ms(6000, 20000)


def test_mooncake_fetches_the_best_prefix_for_an_idle_instance():
    p = tiny_profile()
    mc = MooncakeConductor(p)
    r = request(0, list(range(20)))
    # n1 holds all 20 blocks but has a long queue; n0 holds 2 on disk and is idle
    view = FakeView(("n0", "n1"), held={"n0": (0, 0, 2), "n1": (20, 20, 20)}, load={"n1": {"queued": 500_000}})
    d = mc.decide(r, view)
    assert d.node == "n0"
    assert d.fetches == (Fetch("n0", "disk", 0, 2), Fetch("n1", "hbm", 2, 20))
    # with n1 idle, its own prefix wins and nothing crosses the network
    view.load = {}
    d = mc.decide(r, view)
    assert d.node == "n1" and d.fetches == (Fetch("n1", "hbm", 0, 20),)


def test_mooncake_balancing_threshold_keeps_a_close_local_prefix():
    p = tiny_profile()
    r = request(0, list(range(20)))
    view = FakeView(("n0", "n1"), held={"n0": (15, 15, 15), "n1": (20, 20, 20)}, load={"n1": {"queued": 500_000}})
    d = MooncakeConductor(p).decide(r, view)  # 20 / 15 < 1.5: n0 uses its own 15 blocks
    assert d.node == "n0" and d.fetches == (Fetch("n0", "hbm", 0, 15),)
    d = MooncakeConductor(p, kvcache_balancing_threshold=1.2).decide(r, view)
    assert d.fetches[-1] == Fetch("n1", "hbm", 15, 20)


def test_mooncake_learns_nic_bandwidth_from_transfers():
    mc = MooncakeConductor(tiny_profile())
    before = mc._nic_bytes_per_ms
    for _ in range(60):
        mc.observe_transfer("nic", BLOCK_BYTES, 50.0)  # ten times slower than nominal
    mc.observe_transfer("pcie", BLOCK_BYTES, 0.001)  # other links do not count
    assert mc._nic_bytes_per_ms == pytest.approx(BLOCK_BYTES / 50.0, rel=0.01)
    assert mc._nic_bytes_per_ms < before


def test_registry_makes_fresh_named_strategies():
    for name in STRATEGIES:
        a, b = make_strategy(name), make_strategy(name)
        assert a.name == name and a is not b
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("oracle")
