import pytest

from nexuskv import ConfigError
from nexuskv_sim.profile import ModelProfile, default_profile, load_profile


def test_default_profile_models_and_sizes():
    p = default_profile()
    assert set(p.models) == {"llama-8b", "llama-70b", "qwen-moe-30b"}
    assert p.model("default") is p.model(p.default_model)
    assert p.block_bytes("llama-8b") == 131072 * 512
    # 70b is several times slower per prefill token, and more expensive to recompute per byte
    small, big = p.model("llama-8b"), p.model("llama-70b")
    assert big.per_token_ms / small.per_token_ms >= 6
    assert big.per_token_ms / big.kv_bytes_per_token > small.per_token_ms / small.kv_bytes_per_token
    with pytest.raises(ConfigError, match="no model"):
        p.model("gpt-5")


def test_congested_scales_nic_and_disk_only():
    p = default_profile()
    c = p.congested()
    for kind in ("nic", "disk"):
        assert c.links[kind].bandwidth == pytest.approx(p.links[kind].bandwidth * p.congestion[kind])
    assert c.links["pcie"] == p.links["pcie"]
    with pytest.raises(ConfigError):
        p.congested({"warp": 0.5})


def test_step_time_follows_the_formula():
    m = ModelProfile("x", 1, overhead_ms=2.0, per_token_ms=0.1, attn_ms=0.001, per_decode_ms=0.5, decode_ctx_ms=0.01)
    chunks = [(100, 0), (50, 300)]
    want = 2.0 + 100 * 0.1 + 100 * 50 * 0.001 + 50 * 0.1 + 50 * 325 * 0.001 + 3 * 0.5 + 900 * 0.01
    assert m.step_ms(chunks, decodes=3, decode_ctx=900) == pytest.approx(want)
    # alone, a 300-token prefill with 100-token chunks is three iterations
    alone = sum(2.0 + 100 * 0.1 + 100 * (c + 50) * 0.001 for c in (0, 100, 200))
    assert m.prefill_alone_ms(300, 0, 100) == pytest.approx(alone)


def test_load_profile_reports_missing_fields(tmp_path):
    bad = tmp_path / "p.toml"
    bad.write_text('[models.a]\nkv_bytes_per_token = 1\n')
    with pytest.raises(ConfigError, match="invalid simulator profile"):
        load_profile(bad)
