"""Link estimates: fitted from measured loads, anchored by the profile, robust to outliers, safe from threads."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv.contracts import LinkCost
from nexuskv.planning.cost import default_profile
from nexuskv.planning.links import LinkEstimates, LinkEstimator
from tests.conftest import make_request

PRIOR = LinkCost(bandwidth_bytes_per_s=1e9, latency_ms=0.1)


def feed(est: LinkEstimator, latency_ms: float, bandwidth: float, n: int, rng: random.Random, noise: float = 0.02):
    for _ in range(n):
        nbytes = rng.choice([16 << 10, 64 << 10, 256 << 10, 1 << 20])
        true_ms = latency_ms + nbytes / bandwidth * 1e3
        est.observe(nbytes, true_ms * (1 + rng.uniform(-noise, noise)) / 1e3)


@given(st.floats(0.01, 5.0), st.floats(1e7, 1e10))  # up to the cap: 10x the profile's bandwidth
@settings(max_examples=40, deadline=None)
def test_it_converges_to_the_true_link(latency_ms, bandwidth):
    est = LinkEstimator(PRIOR, decay=0.9)
    feed(est, latency_ms, bandwidth, 120, random.Random(1))
    got = est.estimate
    for nbytes in (16 << 10, 1 << 20):  # predictions at the sizes it saw are within the noise
        true_ms = latency_ms + nbytes / bandwidth * 1e3
        assert got.transfer_ms(nbytes) == pytest.approx(true_ms, rel=0.08, abs=0.01)


def test_one_stall_moves_it_little_a_lasting_change_moves_it_soon():
    rng = random.Random(2)
    est = LinkEstimator(PRIOR)
    feed(est, 0.1, 1e9, 60, rng)
    before = est.estimate.transfer_ms(1 << 20)
    est.observe(1 << 20, 2.0)  # one 2-second stall, and another (one GC pause hits concurrent spans)
    est.observe(1 << 18, 2.0)
    assert est.estimate.transfer_ms(1 << 20) < before * 2
    feed(est, 0.1, 1e8, 40, rng)  # the link really got 10x slower
    assert est.estimate.transfer_ms(1 << 20) == pytest.approx(0.1 + (1 << 20) / 1e8 * 1e3, rel=0.15)


def test_a_flat_line_never_prices_large_transfers_as_free():
    est = LinkEstimator(LinkCost(bandwidth_bytes_per_s=1.5e9, latency_ms=0.1))
    for _ in range(50):  # one size only, slower than the profile: the fitted slope would fall
        est.observe(65536, (1.0 + 65536 / 100e6 * 1e3) / 1e3)
    assert est.estimate.bandwidth_bytes_per_s <= 1.5e10
    assert est.estimate.transfer_ms(64 << 20) > 64 * 2**20 / 1.5e10 * 1e3
    est.observe(65536, float("inf"))  # a broken measurement is ignored
    est.observe(65536, float("nan"))
    assert est.estimate.latency_ms == est.estimate.latency_ms and est.estimate.samples == 50


def test_one_size_alone_still_gives_a_usable_line():
    est = LinkEstimator(PRIOR)
    for _ in range(50):
        est.observe(64 << 10, (0.1 + (64 << 10) / 1e8 * 1e3) / 1e3)
    assert est.estimate.transfer_ms(64 << 10) == pytest.approx(0.1 + (64 << 10) / 1e8 * 1e3, rel=0.05)
    assert est.estimate.latency_ms >= 0 and est.estimate.bandwidth_bytes_per_s > 0


def test_estimates_answer_after_enough_samples_and_publish_plain_numbers():
    links = LinkEstimates(default_profile(), min_samples=4)
    for _ in range(3):
        links.observe("dram", 4096, 1e-5)
    assert links.get("dram") is None and links.get("disk") is None
    links.observe("dram", 4096, 1e-5)
    assert links.get("dram") is not None and links.get("dram").samples == 4
    snap = links.snapshot()
    assert set(snap) == {"dram"} and set(snap["dram"]) == {"latency_ms", "bandwidth_bytes_per_s", "samples"}
    links.observe("peer:n2", 4096, 1e-3)  # a link the profile does not know starts from a generic prior
    assert "peer:n2" in links.snapshot()
    with pytest.raises(ValueError, match="decay"):
        LinkEstimator(PRIOR, decay=1.0)


def test_after_aging_one_look_decides_a_recovered_link_fast_a_slow_one_stays_slow():
    mib = float(1 << 20)
    for recovered in (True, False):
        links = LinkEstimates(default_profile(), min_samples=1, max_age_s=0.05)
        for _ in range(12):
            links.observe("peer:x", mib, 0.100)  # 10 MB/s
        assert links.get("peer:x").transfer_ms(mib) > 80
        time.sleep(0.06)
        assert links.get("peer:x") is None  # aged: the profile prices it, a load looks again
        links.observe("peer:x", mib, 0.001 if recovered else 0.100)
        got = links.get("peer:x").transfer_ms(mib)
        assert (got < 20) if recovered else (got > 80), (recovered, got)


def test_many_threads_observe_at_once():
    links = LinkEstimates(default_profile(), min_samples=1)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        rng = random.Random(i)
        try:
            for _ in range(500):
                nbytes = rng.choice([4096, 65536])
                links.observe(rng.choice(["dram", "disk"]), nbytes, (0.01 + nbytes / 2e9 * 1e3) / 1e3)
                links.get("dram")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    counts = {name: v["samples"] for name, v in links.snapshot().items()}
    assert sum(counts.values()) == 8 * 500  # no sample lost to a race
    for name in ("dram", "disk"):  # every sample lay on one line: the fit is that line
        assert links.get(name).transfer_ms(65536) == pytest.approx(0.01 + 65536 / 2e9 * 1e3, rel=0.02)


# --------------------------------------------------------------------------------------------- in the kernel


class SlowStore:
    """A tier store that takes `delay_s` longer per read (fault injection: a slowed link)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.delay_s = 0.0

    def get(self, slot):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inner.get(slot)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_kernel_prices_by_what_it_measures_and_tries_again_when_estimates_age(monkeypatch):
    from nexuskv import Kernel, KernelConfig, PlanAction

    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}},
                       links={"measure": True, "min_samples": 3, "max_age_s": 3600}, promote_on_hit=False,
                       prefetch_max_tasks=0, load_timeout_ms=60_000)  # fmt: skip
    with Kernel(cfg, secret=bytes(32)) as k:
        slow = SlowStore(k.hierarchy.tiers["dram"])
        k.hierarchy.tiers["dram"] = slow
        req = make_request(range(512))
        keys = k.keys(req)
        block = k.cost.bytes_per_token * req.layout.page_size  # payloads as large as the planner assumes
        for b in range(len(keys)):
            data = bytes([b % 256]) * block
            assert k.put(k.describe(req, b, data, tier="dram", keys=keys), data)

        def load(n: int) -> None:
            for i in range(n):
                short = make_request(range(16 * (8 + 8 * i)))  # spans of several sizes: latency and bandwidth
                plan = k.plan(short)
                if plan.action == PlanAction.MATERIALIZE:
                    assert k.materialize(plan, short).complete

        assert k.plan(req).action == PlanAction.MATERIALIZE
        load(3)
        assert k.links.get("dram") is not None and k.plan(req).action == PlanAction.MATERIALIZE
        slow.delay_s = 0.01  # 10 ms per block: 32 blocks cost 320 ms, recomputing 512 tokens about 60 ms
        load(4)
        assert k.plan(req).action == PlanAction.RECOMPUTE  # measured, not told (bandwidth_scale is unset)
        assert k.links.get("dram").transfer_ms(32 * block) > k.cost.recompute_ms(512)  # why: it costs more
        slow.delay_s = 0.0
        assert k.plan(req).action == PlanAction.RECOMPUTE  # no load, so no sample: the slow estimate stands...
        monkeypatch.setattr(k.links, "max_age_s", 0.0)  # ...until it ages out: the profile prices dram again
        assert k.plan(req).action == PlanAction.MATERIALIZE
        load(6)  # and the loads measure it again, fast now (the first look after aging decides)
        monkeypatch.setattr(k.links, "max_age_s", 3600)
        assert k.links.get("dram").transfer_ms(32 * block) < 50
        assert k.plan(req).action == PlanAction.MATERIALIZE


def test_links_config_is_checked():
    from nexuskv import ConfigError
    from nexuskv.planning.links import link_estimates

    assert link_estimates({}, default_profile()) is not None  # measured by default
    assert link_estimates({"measure": False}, default_profile()) is None
    assert link_estimates({"measure": True, "decay": 0.8}, default_profile()).decay == 0.8
    with pytest.raises(ConfigError, match="unknown keys"):
        link_estimates({"measure": True, "decay_rate": 0.8}, default_profile())
    with pytest.raises(ConfigError, match=r"decay must be in \(0, 1\)"):
        link_estimates({"measure": True, "decay": 2}, default_profile())


def test_an_aged_estimate_is_looked_at_in_one_probe_window_per_max_age():
    # On a link that stays slow, only the decisions of a short window per max_age_s price it by the profile: the
    # others keep the last estimate until a sample lands (a load in the window measures the link again).
    now = [0.0]
    links = LinkEstimates(default_profile(), min_samples=1, max_age_s=30.0, probe_s=1.0, clock=lambda: now[0])
    mib = float(1 << 20)
    for _ in range(4):
        links.observe("peer:x", mib, 0.100)
    slow = links.get("peer:x")
    assert slow is not None and slow.transfer_ms(mib) > 80
    now[0] = 31.0
    assert links.get("peer:x") is None  # aged: the window opens, the profile prices the link
    now[0] = 31.9
    assert links.get("peer:x") is None  # still in the window
    now[0] = 32.0
    assert links.get("peer:x") == slow  # no sample came: the last estimate stands again
    now[0] = 60.9
    assert links.get("peer:x") == slow
    now[0] = 61.0
    assert links.get("peer:x") is None  # max_age_s after the last window: another one
    links.observe("peer:x", mib, 0.100)  # the window's load: still slow, counted in full
    now[0] = 61.5
    assert links.get("peer:x").transfer_ms(mib) > 50  # fresh again (the prior fades): no window


def test_probe_s_is_checked():
    from nexuskv import ConfigError
    from nexuskv.planning.links import link_estimates

    assert link_estimates({"probe_s": 0.25}, default_profile()).probe_s == 0.25
    with pytest.raises(ConfigError, match="probe_s"):
        link_estimates({"probe_s": -1}, default_profile())
    with pytest.raises(ConfigError, match="probe_s"):  # no window: an aged slow link would never be looked at again
        link_estimates({"probe_s": 0}, default_profile())


def test_max_age_s_is_finite_and_positive():
    from nexuskv import ConfigError
    from nexuskv.planning.links import link_estimates

    assert link_estimates({"max_age_s": 5}, default_profile()).max_age_s == 5.0
    for bad in (0, -1, float("nan"), float("inf"), "soon"):  # NaN compared false everywhere: an estimate never aged
        with pytest.raises(ConfigError, match="max_age_s and probe_s finite and > 0"):
            link_estimates({"max_age_s": bad}, default_profile())
