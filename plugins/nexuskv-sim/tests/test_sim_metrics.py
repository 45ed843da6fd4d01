import pytest

from nexuskv_sim.metrics import SimResult, percentile, summary


def test_percentile_interpolates():
    vals = [float(v) for v in range(1, 101)]
    assert percentile(vals, 50) == pytest.approx(50.5)
    assert percentile(vals, 99) == pytest.approx(99.01)
    assert percentile([], 90) == 0.0 and percentile([7.0], 90) == 7.0


def test_result_ratios_and_table():
    r = SimResult("x", slo_ms=100.0, ttft_ms=[50.0, 100.0, 150.0], requests=4, input_tokens=1000,
                  reused_tokens=250, bytes_by_link={"nic": 2_000_000_000, "pcie": 1_000_000_000})  # fmt: skip
    assert r.slo_attainment == pytest.approx(2 / 4)  # the failed fourth request misses the SLO too
    assert r.hit_ratio == pytest.approx(0.25) and r.gb_moved == pytest.approx(3.0)
    assert r.mean_ttft_ms == pytest.approx(100.0)
    d = r.to_dict()
    assert d["p50_ttft_ms"] == pytest.approx(100.0) and d["bytes_by_link"]["nic"] == 2_000_000_000
    table = summary({"x": r})
    assert table.splitlines()[1].split()[:2] == ["x", "4"]
