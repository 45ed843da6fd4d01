"""The decode-cost fit: what running decodes add to TTFT, from (decodes x prefill ahead, TTFT error) pairs only."""

import random

from _sim_fakes import FakeView, request, tiny_profile
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv_sim.decode_fit import DecodeFit
from nexuskv_sim.nexus import NexusKVStrategy


@settings(max_examples=40, deadline=None)
@given(st.floats(0.0, 50.0), st.floats(-200.0, 200.0), st.integers(0, 2**31))
def test_it_recovers_the_slope_of_a_noisy_line(slope, offset, seed):
    rng = random.Random(seed)
    fit = DecodeFit(decay=0.999)
    for _ in range(3000):
        decodes = rng.randrange(0, 128)
        fit.observe(decodes, offset + slope * decodes + rng.gauss(0.0, 20.0))
    assert abs(fit.decode_ms - slope) < 0.5


def test_it_says_nothing_before_enough_samples_without_spread_or_for_a_falling_line():
    fit = DecodeFit(min_samples=32)
    for i in range(31):
        fit.observe(i, 10.0 * i)
    assert fit.decode_ms == 0.0  # 31 samples: not yet
    fit.observe(31, 310.0)
    assert 9.9 < fit.decode_ms < 10.1
    flat = DecodeFit(min_samples=1)
    for _ in range(100):
        flat.observe(7, 500.0)  # the same decodes every time: no slope to see
    assert flat.decode_ms == 0.0
    falling = DecodeFit(min_samples=1)
    for i in range(100):
        falling.observe(i, -3.0 * i)  # decodes never make a prefill faster: clamped
    assert falling.decode_ms == 0.0


def test_the_strategy_learns_from_measured_ttfts_and_reports_it_to_the_route():
    s = NexusKVStrategy(tiny_profile())
    try:
        busy, idle = FakeView(("n0", "n1"), load={"n0": {"decodes": 40}}), FakeView(("n0", "n1"))
        assert s.decide(request(0, [7, 8, 9]), busy).node == "n0"  # decodes cost nothing yet: the name decides
        for i in range(64):  # one node whose measured TTFT grows by 100 ms per decode per 1,000 tokens ahead
            view = FakeView(("n0",), load={"n0": {"decodes": i % 41}})
            req = request(i + 1, [1000 * i + j for j in range(4)])
            s.observe_done(req, s.decide(req, view).node, 100.0 * (i % 41) * req.input_tokens / 1e3)
        assert 90 < s._fits["m"].decode_ms < 110
        assert s.decide(request(99, [7, 8, 9]), busy).node == "n1"  # the busy decoder now loses
        assert s.decide(request(98, [7, 8, 9]), idle).node == "n0"
    finally:
        s.close()
