import pytest
from _sim_fakes import tiny_profile

from nexuskv_sim.simulate import assign_nodes, plot_ttft, simulate, to_requests
from nexuskv_sim.trace import generate, generate_mixed


def test_assign_nodes_round_robins_models_and_packs_hosts():
    nm, nh = assign_nodes(["a", "b", "c"], 6, engines_per_host=3)
    assert list(nm.values()) == ["a", "b", "c", "a", "b", "c"]
    assert list(nh.values()) == ["h0", "h0", "h0", "h1", "h1", "h1"]
    with pytest.raises(ValueError):
        assign_nodes([], 2)


def test_default_model_requests_use_the_profile_default():
    reqs = to_requests(generate(5, seed=1), tiny_profile(), limit=3)
    assert len(reqs) == 3 and {r.model for r in reqs} == {"m"}


def test_reuse_beats_never_on_a_reuse_heavy_trace(tmp_path):
    recs = generate(150, seed=2, rate_per_s=2.0)
    res = simulate(recs, ["never", "round-robin", "sglang", "dynamo", "llm-d", "mooncake"], nodes=2)
    assert set(res) == {"never", "round-robin", "sglang", "dynamo", "llm-d", "mooncake"}
    for r in res.values():
        assert r.completed == r.requests == 150 and r.failed == 0
    assert res["never"].hit_ratio == 0 and res["never"].gb_moved == 0
    for name in ("sglang", "dynamo", "llm-d", "mooncake"):
        assert res[name].hit_ratio > 0.2
        assert res[name].mean_ttft_ms < res["never"].mean_ttft_ms
    out = plot_ttft(res, tmp_path / "ttft.png", "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mixed_trace_runs_on_shared_hosts_and_congestion_slows_the_network():
    recs = generate_mixed(120, seed=5, rate_per_s=3.0)
    normal = simulate(recs, ["mooncake"], nodes=3, engines_per_host=3)["mooncake"]
    slow = simulate(recs, ["mooncake"], nodes=3, engines_per_host=3, congested=True)["mooncake"]
    assert normal.completed == slow.completed == 120
    assert slow.mean_ttft_ms >= normal.mean_ttft_ms
