import json
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import nexuskv
from nexuskv import CostProfile, LinkCost
from nexuskv.planning.cost import CostModel, Terms, default_profile, load_profile

ROOT = Path(__file__).resolve().parents[2]
REPLAY_PROFILE = ROOT / "profiles" / "replay-llama-8b-gpu.json"

MODEL = CostModel(default_profile())
lengths = st.integers(min_value=1, max_value=200_000)


# ------------------------------------------------------------------------------------------------ profiles


def test_default_profile_roundtrips_through_the_contract():
    p = default_profile()
    d = nexuskv.to_dict(p)
    assert d["schema_version"] == 1
    again = nexuskv.from_dict(CostProfile, json.loads(json.dumps(d)))
    assert again == p
    assert {"dram", "disk", "redis"} <= set(p.tiers)
    assert "raw" in p.codecs


@pytest.mark.parametrize(("tokens", "documented_ms"), [(512, 45.0), (2048, 270.0), (8192, 1540.0)])
def test_default_profile_reproduces_documented_prefill_figures(tokens, documented_ms):
    got = MODEL.prefill_ms(tokens)
    assert got == pytest.approx(documented_ms, rel=0.35)


def test_cost_model_without_profile_uses_the_default():
    assert CostModel().profile == default_profile()


def test_load_profile_reads_the_shipped_replay_profile():
    p = load_profile(REPLAY_PROFILE)
    assert p.name == "replay-llama-8b-gpu"
    assert p.bytes_per_token == 131072
    assert set(p.tiers) == {"dram", "disk", "redis"}
    assert p.tiers["disk"] == LinkCost(bandwidth_bytes_per_s=3e9, latency_ms=0.1)
    assert load_profile(str(REPLAY_PROFILE)) == p  # str or Path
    assert nexuskv.from_dict(CostProfile, nexuskv.to_dict(p)) == p


def test_load_profile_bad_file_names_every_field_path(tmp_path):
    d = json.loads(REPLAY_PROFILE.read_text())
    d["tiers"]["disk"]["bandwidth_bytes_per_s"] = -1
    d["bytes_per_token"] = "lots"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(nexuskv.ContractError) as ei:
        load_profile(bad)
    paths = [path for path, _ in ei.value.problems]
    assert "tiers.disk.bandwidth_bytes_per_s" in paths
    assert "bytes_per_token" in paths
    assert ei.value.contract == "cost-profile"
    assert "tiers.disk.bandwidth_bytes_per_s" in str(ei.value)


def test_load_profile_unknown_schema_version(tmp_path):
    d = json.loads(REPLAY_PROFILE.read_text())
    d["schema_version"] = 99
    bad = tmp_path / "v99.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(nexuskv.SchemaVersionError):
        load_profile(bad)


def test_load_profile_malformed_json_is_a_nexuskv_error_naming_the_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"name": "x", ')
    with pytest.raises(nexuskv.NexusKVError, match=r"broken\.json"):
        load_profile(bad)


# ------------------------------------------------------------------------------------------------ prefill


@given(st.data())
def test_prefill_with_cached_prefix_plus_recompute_equals_full_prefill(data):
    total = data.draw(lengths)
    cached = data.draw(st.integers(min_value=0, max_value=total - 1))
    split = MODEL.prefill_ms(total, cached) + MODEL.recompute_ms(cached)
    assert split == pytest.approx(MODEL.prefill_ms(total), rel=1e-9, abs=1e-9)


@given(lengths)
def test_prefill_fully_cached_costs_nothing(n):
    assert MODEL.prefill_ms(n, n) == 0.0
    assert MODEL.prefill_ms(n, n + 5) == 0.0
    assert MODEL.prefill_ms(n) > 0.0


def test_recompute_of_nothing_is_free():
    assert MODEL.recompute_ms(0) == 0.0


@given(st.integers(min_value=0, max_value=100_000))
def test_recompute_is_increasing_and_convex(m):
    r0, r1, r2 = MODEL.recompute_ms(m), MODEL.recompute_ms(m + 1), MODEL.recompute_ms(m + 2)
    assert r1 > r0
    assert (r2 - r1) > (r1 - r0)  # strictly convex: the attention term is quadratic


@given(st.integers(min_value=1, max_value=100_000))
def test_recompute_is_superlinear(m):
    assert MODEL.recompute_ms(2 * m) > 2 * MODEL.recompute_ms(m)


def test_prefill_is_superlinear_in_length():
    per_token = [MODEL.prefill_ms(n) / n for n in (1024, 4096, 16384)]
    assert per_token == sorted(per_token)
    assert per_token[0] < per_token[-1]


# ------------------------------------------------------------------------------------------------ transfers


def test_transfer_of_nothing_is_free():
    assert MODEL.transfer_ms(0, "disk") == 0.0
    assert MODEL.transfer_ms(-5, "disk") == 0.0


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    link = MODEL.profile.tiers["disk"]
    n = 3_000_000
    assert MODEL.transfer_ms(n, "disk") == pytest.approx(link.latency_ms + n / link.bandwidth_bytes_per_s * 1e3)
    # even one byte pays the latency
    assert MODEL.transfer_ms(1, "redis") >= MODEL.profile.tiers["redis"].latency_ms


@given(st.sampled_from(["dram", "disk", "redis"]), st.integers(min_value=1, max_value=10**10),
       st.integers(min_value=1, max_value=10**10))  # fmt: skip
def test_transfer_grows_with_bytes(tier, a, b):
    lo, hi = sorted((a, b))
    assert MODEL.transfer_ms(lo, tier) <= MODEL.transfer_ms(hi, tier)
    if lo < hi:
        assert MODEL.transfer_ms(lo, tier) < MODEL.transfer_ms(hi, tier)


def test_faster_tiers_are_cheaper_in_the_default_profile():
    n = 64 << 20
    assert MODEL.transfer_ms(n, "dram") < MODEL.transfer_ms(n, "disk") < MODEL.transfer_ms(n, "redis")


@given(st.integers(min_value=1, max_value=10**9), st.floats(min_value=1, max_value=1e12))
def test_inflight_bytes_queue_ahead_of_a_transfer(n, busy):
    alone = MODEL.transfer_ms(n, "disk")
    shared = MODEL.transfer_ms(n, "disk", inflight={"disk": busy})
    assert shared > alone
    link = MODEL.profile.tiers["disk"]
    # FIFO: everything already queued on the link drains first
    assert shared == pytest.approx(link.latency_ms + (n + busy) / link.bandwidth_bytes_per_s * 1e3)


def test_inflight_on_another_link_does_not_matter():
    n = 10 << 20
    assert MODEL.transfer_ms(n, "disk", inflight={"redis": 1e12}) == MODEL.transfer_ms(n, "disk")


def test_more_inflight_means_slower():
    n = 10 << 20
    times = [MODEL.transfer_ms(n, "disk", inflight={"disk": b}) for b in (0, n / 4, n / 2, n, 4 * n)]
    assert times == sorted(times) and len(set(times)) == 5


@given(st.floats(min_value=1e-6, max_value=0.999))
def test_bandwidth_scale_below_one_slows_a_link(scale):
    n = 10 << 20
    assert MODEL.transfer_ms(n, "disk", bandwidth_scale={"disk": scale}) > MODEL.transfer_ms(n, "disk")
    assert MODEL.transfer_ms(n, "dram", bandwidth_scale={"disk": scale}) == MODEL.transfer_ms(n, "dram")


def test_bandwidth_scale_is_exactly_a_bandwidth_multiplier():
    n = 10 << 20
    link = MODEL.profile.tiers["disk"]
    got = MODEL.transfer_ms(n, "disk", bandwidth_scale={"disk": 0.25})
    assert got == pytest.approx(link.latency_ms + n / (0.25 * link.bandwidth_bytes_per_s) * 1e3)


def test_unknown_tier_is_a_key_error_naming_the_known_ones():
    with pytest.raises(KeyError) as ei:
        MODEL.transfer_ms(100, "tape")
    msg = str(ei.value)
    assert "tape" in msg
    for known in ("dram", "disk", "redis", "local"):
        assert known in msg
    with pytest.raises(KeyError, match="tape"):
        MODEL.link("tape")


def test_non_local_transport_adds_its_own_hop():
    p = attrs.evolve(default_profile(), transports={"local": LinkCost(8e9, 0.0), "tcp": LinkCost(1e9, 0.2)})
    m = CostModel(p)
    n = 10 << 20
    tier_only = m.transfer_ms(n, "disk")
    assert m.transfer_ms(n, "disk", transport="local") == tier_only
    assert m.transfer_ms(n, "disk", transport="tcp") == pytest.approx(tier_only + 0.2 + n / 1e9 * 1e3)
    # in-flight bytes on the transport slow that hop too
    assert m.transfer_ms(n, "disk", transport="tcp", inflight={"tcp": n}) > m.transfer_ms(n, "disk", transport="tcp")


def test_codec_decode_time_is_added_for_non_raw_codecs():
    n = 100 << 20
    link = MODEL.profile.tiers["disk"]
    zstd = MODEL.profile.codecs["zstd"]
    raw = MODEL.transfer_ms(n, "disk", codec="raw")
    assert raw == MODEL.transfer_ms(n, "disk")  # raw adds no decode time
    got = MODEL.transfer_ms(n, "disk", codec="zstd")
    expected = link.latency_ms + n / zstd.ratio / link.bandwidth_bytes_per_s * 1e3 + n / zstd.decode_bytes_per_s * 1e3
    assert got == pytest.approx(expected)
    # a slow decoder makes compression lose against raw even though fewer bytes move
    slow = attrs.evolve(zstd, decode_bytes_per_s=1e6)
    m = CostModel(attrs.evolve(default_profile(), codecs={"raw": MODEL.profile.codecs["raw"], "zstd": slow}))
    assert m.transfer_ms(n, "disk", codec="zstd") > raw


# ------------------------------------------------------------------------------------------------ terms, values


def test_terms_gain_is_recompute_minus_the_costs():
    t = Terms(t_recompute_ms=10.0, t_lookup_ms=0.5, t_transfer_ms=2.0, t_mount_ms=0.25)
    assert t.gain_ms == pytest.approx(7.25)
    assert Terms(1.0, 0.5, 2.0, 0.0).gain_ms == pytest.approx(-1.5)


def test_cost_model_terms():
    t = MODEL.terms(128, 3.0, 8)
    assert t.t_recompute_ms == MODEL.recompute_ms(128)
    assert t.t_lookup_ms == MODEL.lookup_ms() == MODEL.profile.lookup_ms
    assert t.t_transfer_ms == 3.0
    assert t.t_mount_ms == pytest.approx(MODEL.mount_ms(8)) == pytest.approx(8 * MODEL.profile.mount_ms_per_block)
    empty = MODEL.terms(0, 0.0, 0)
    assert empty.gain_ms == 0.0 and empty.t_lookup_ms == 0.0


@given(st.integers(min_value=16, max_value=100_000), st.integers(min_value=0, max_value=1000))
def test_value_per_byte_increases_with_hits(depth, hits):
    v0 = MODEL.value_per_byte(depth, 16, hits)
    v1 = MODEL.value_per_byte(depth, 16, hits + 1)
    assert 0 < v0 < v1


@given(st.integers(min_value=16, max_value=100_000))
def test_deeper_blocks_are_worth_more(depth):
    # the same block size saves more recompute further into the prompt (attention is quadratic)
    assert MODEL.value_per_byte(depth + 16, 16) > MODEL.value_per_byte(depth, 16)


def test_value_per_byte_formula():
    saved = MODEL.recompute_ms(64) - MODEL.recompute_ms(48)
    assert MODEL.value_per_byte(64, 16, hits=2) == pytest.approx(saved * 3 / (16 * MODEL.bytes_per_token))


def test_a_peers_state_costs_its_tier_and_the_transport_until_measured_then_what_was_measured():
    from nexuskv.planning.links import LinkEstimates

    cost = CostModel(default_profile(), links=LinkEstimates(default_profile(), min_samples=2))
    tcp = default_profile().transports["tcp"]
    mib = float(1 << 20)
    by_profile = cost.transfer_ms(mib, "dram") + tcp.latency_ms + mib / tcp.bandwidth_bytes_per_s * 1e3
    assert cost.remote_ms(mib, "dram", "n2", transport="tcp") == pytest.approx(by_profile)
    # a tier this node does not have: the transport alone
    tape = cost.remote_ms(mib, "tape", "n2", transport="tcp")
    assert tape == pytest.approx(by_profile - cost.transfer_ms(mib, "dram"))
    for _ in range(30):
        cost.links.observe("peer:n2", mib, 0.1)  # 10 MB/s, end to end
    assert cost.remote_ms(mib, "dram", "n2", transport="tcp") == pytest.approx(100, rel=0.05)
    assert cost.remote_ms(mib, "dram", "n2", transport="tcp", bandwidth_scale={"peer:n2": 0.5}) == \
        pytest.approx(200, rel=0.05)  # fmt: skip
    assert cost.remote_ms(0, "dram", "n2", transport="tcp") == 0.0
    with pytest.raises(KeyError, match="no tier or transport 'rdma'"):
        CostModel(default_profile()).remote_ms(mib, "dram", "n2", transport="rdma")


def test_eviction_priority_cost_and_lru():
    m = CostModel(load_profile(REPLAY_PROFILE))
    assert m.eviction_priority("lru", 5.0, 512) == 0.0
    v = m.value_per_byte(512, 512) * 1e6
    assert m.eviction_priority("cost", 5.0, 512) == pytest.approx(5.0 + v)
    assert m.eviction_priority("cost", 0.0, 512, hits=1) == pytest.approx(2 * v)


def test_eviction_value_is_the_gain_net_of_reading_the_block_back():
    m = CostModel(load_profile(REPLAY_PROFILE))
    gross = m.eviction_priority("cost", 0.0, 512)
    nbytes = 512 * m.bytes_per_token
    for tier in ("dram", "disk"):
        net = m.eviction_priority("cost", 0.0, 512, tier=tier)
        assert net == pytest.approx(gross - m.transfer_ms(nbytes, tier) / nbytes * 1e6)
    assert m.eviction_priority("cost", 0.0, 512, tier="dram") > m.eviction_priority("cost", 0.0, 512, tier="disk")
    assert m.eviction_priority("cost", 0.0, 512, tier="nowhere") == gross  # a tier without a cost: gross value
