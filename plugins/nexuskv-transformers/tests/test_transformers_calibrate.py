"""Calibration: the fits recover known coefficients, a real (small) calibration produces a valid profile and plot."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import SECRET, model
from nexuskv import CostProfile, Kernel, KernelConfig, from_dict
from nexuskv_transformers.calibrate import (
    PrefillSample,
    calibrate,
    fit_link,
    fit_prefill,
    heldout_error,
    measurable,
    plot,
    save,
)
from nexuskv_transformers.connector import TransformersConnector


@given(base=st.floats(0, 20), a=st.floats(0.001, 1), b=st.floats(0, 1e-3))
def test_fit_prefill_recovers_exact_coefficients(base, a, b):
    samples = [PrefillSample(n, m, base + a * (n - m) + b * (n * n - m * m))
               for n in (64, 128, 256, 512, 1024) for m in (0, n // 2)]  # fmt: skip
    got = fit_prefill(samples)
    assert got.base_ms == pytest.approx(base, abs=1e-6)
    assert got.per_token_ms == pytest.approx(a, rel=1e-6)
    assert got.per_token_sq_ms == pytest.approx(b, rel=1e-5, abs=1e-12)
    assert heldout_error(got, samples) < 1e-6


def test_fit_prefill_never_goes_negative():
    # A decreasing "time" would need a negative slope: the fit clamps to what is physically possible.
    samples = [PrefillSample(n, 0, 100.0 - n / 100) for n in (64, 256, 1024, 2048)]
    got = fit_prefill(samples)
    assert min(got.base_ms, got.per_token_ms, got.per_token_sq_ms) >= 0


def test_fit_link():
    pts = [(b, 0.5 + b / 2e6) for b in (1 << 10, 1 << 16, 1 << 20, 1 << 22)]  # 0.5 ms + 2 GB/s
    link = fit_link(pts)
    assert link.latency_ms == pytest.approx(0.5, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)


def test_heldout_error_is_mean_relative_error():
    from nexuskv import PrefillCost

    cost = PrefillCost(base_ms=0, per_token_ms=1.0)
    assert heldout_error(cost, [PrefillSample(10, 0, 8.0), PrefillSample(20, 0, 25.0)]) == pytest.approx(
        (25 + 20) / 2)  # fmt: skip


def test_a_real_calibration_writes_a_valid_profile_and_plot(tmp_path):
    """Small lengths on the test model: the point is the pipeline (measure, fit, save, load, plot), not accuracy."""
    ref = model("dense")
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"},
                                         "remote": {"store": "shaped-link", "capacity_bytes": "64MiB",
                                                    "bandwidth_bytes_per_s": 50e6, "latency_ms": 0.5}})  # fmt: skip
    with measurable(cfg) as cfg, Kernel(cfg, secret=SECRET) as k:  # "remote" has no cost yet: measuring it
        report = calibrate(TransformersConnector(k, ref), repeats=1, lengths=((32, 64, 128), (48, 96)),
                           blocks=(1, 2, 4))  # fmt: skip
    prof = report.profile
    assert set(prof.tiers) == {"dram", "remote"}
    span = 4 * prof.bytes_per_token * 16  # the largest span measured: 4 blocks of 16 tokens

    def read_ms(tier: str) -> float:  # what the profile predicts for it (a busy machine can flatten one term)
        cost = prof.tiers[tier]
        return cost.latency_ms + span / cost.bandwidth_bytes_per_s * 1e3

    assert read_ms("remote") > read_ms("dram")  # the shaped link (50 MB/s + 0.5 ms) is measured slower
    assert prof.bytes_per_token == ref.kv_bytes_per_token()
    assert {s.length for s in report.heldout} == {48, 96} and report.heldout_error_pct >= 0
    assert prof.calibration.heldout_error_pct == pytest.approx(report.heldout_error_pct, abs=0.01)
    path = tmp_path / "p.json"
    save(report, path)
    assert from_dict(CostProfile, json.loads(path.read_text())) == prof
    png = plot(report, tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.isfinite(report.predicted_ms(1000))
