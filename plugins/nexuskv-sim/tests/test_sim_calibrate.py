"""NexusKV's measured profile: a fit of isolated prefills, never the simulator's own numbers."""

import pytest
from _sim_fakes import tiny_profile

from nexuskv_sim.calibrate import PRIORS, measured_profile, prefill_samples


def test_samples_are_the_simulated_prefill_times_of_isolated_requests():
    prof = tiny_profile(overhead_ms=2.0, per_token_ms=0.01)
    samples = prefill_samples(prof, "m", lengths=(512, 8192))
    assert samples == [(512, pytest.approx(prof.model("m").prefill_alone_ms(512, 0, prof.chunk_tokens))),
                       (8192, pytest.approx(prof.model("m").prefill_alone_ms(8192, 0, prof.chunk_tokens)))]  # fmt: skip


def test_the_fit_predicts_the_samples_and_links_start_from_priors():
    prof = tiny_profile(overhead_ms=3.0, per_token_ms=0.02, attn_ms=1e-6)
    cost = measured_profile(prof, "m")
    p = cost.prefill
    for n, ms in prefill_samples(prof, "m"):
        assert p.base_ms + p.per_token_ms * n + p.per_token_sq_ms * n * n == pytest.approx(ms, rel=0.1)
    assert cost.bytes_per_token == prof.model("m").kv_bytes_per_token
    assert cost.tiers["disk"].bandwidth_bytes_per_s == PRIORS["disk"][0]  # not the simulator's disk
    assert cost.calibration.method == "sim-isolated-prefill"
