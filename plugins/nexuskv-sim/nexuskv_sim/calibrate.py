"""What NexusKV knows about a simulated cluster before it runs: a cost profile measured once, as on real hardware.

NexusKV never reads the simulator's hardware profile. Like an operator calibrating a deployment (`nexuskv
calibrate` against the reference engine), `measured_profile` times isolated prefills of a few lengths on an
idle one-node simulated cluster and fits the kernel's own prefill model (base + a*L + b*L^2) to them by least
squares; tier and link bandwidths start from datasheet-style priors (`PRIORS`, deliberately rounder than the
simulator's numbers) and are then learned from the transfers NexusKV observes while the simulation runs
(`[links]` estimates, as in production).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from nexuskv import CostProfile, from_dict
from nexuskv_sim.api import BaseStrategy, Decision, SimRequest
from nexuskv_sim.profile import Profile
from nexuskv_sim.trace import TraceRecord

__all__ = ["PRIORS", "measured_profile", "prefill_samples"]

# Datasheet priors (bytes/s, ms) an operator would write before measuring: PCIe 4 x16, an NVMe SSD, 100 GbE.
PRIORS: Mapping[str, tuple[float, float]] = {"hbm": (1e13, 0.0), "dram": (16e9, 0.02), "disk": (2e9, 0.2),
                                             "nic": (10e9, 0.05)}  # fmt: skip
LENGTHS = (512, 2048, 8192, 16384, 32768, 65536)


class _Idle(BaseStrategy):
    name = "calibration"

    def decide(self, req: SimRequest, view: object) -> Decision:
        return Decision(node=view.nodes_for(req.model)[0])  # type: ignore[attr-defined]


def prefill_samples(profile: Profile, model: str, lengths: tuple[int, ...] = LENGTHS) -> list[tuple[int, float]]:
    """(prompt tokens, measured TTFT ms) of isolated requests on an idle one-node cluster (one output token)."""
    from nexuskv_sim.simulate import simulate

    gap = 10_000_000.0  # far apart: each request runs alone
    bt = profile.block_tokens
    records = [TraceRecord(i * gap, n, 1, list(range(10**9 + i * 1000, 10**9 + i * 1000 + -(-n // bt))), model)
               for i, n in enumerate(lengths)]  # fmt: skip
    res = simulate(records, [_Idle()], node_models={"n0": model}, profile=profile)["calibration"]
    return list(zip(lengths, res.ttft_ms, strict=True))


def measured_profile(profile: Profile, model: str) -> CostProfile:
    """The kernel cost profile NexusKV would measure for `model` on this cluster (see the module docstring)."""
    samples = prefill_samples(profile, model)
    x = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    coef, *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x, x * x], axis=1), y, rcond=None)
    base, a, b = (max(0.0, float(c)) for c in coef)
    tiers = {t: {"bandwidth_bytes_per_s": bw, "latency_ms": lat} for t, (bw, lat) in PRIORS.items() if t != "nic"}
    bw, lat = PRIORS["nic"]
    return from_dict(CostProfile, {
        "schema_version": 1, "name": f"sim-measured-{model}", "model": model,
        "hardware": "simulated cluster, measured by timing isolated prefills (nexuskv_sim.calibrate)",
        "bytes_per_token": profile.model(model).kv_bytes_per_token,
        "prefill": {"base_ms": base, "per_token_ms": a, "per_token_sq_ms": b},
        "tiers": tiers,
        "transports": {"local": {"bandwidth_bytes_per_s": 1e13, "latency_ms": 0.0},
                       "tcp": {"bandwidth_bytes_per_s": bw, "latency_ms": lat}},
        "lookup_ms": 0.1, "mount_ms_per_block": 0.0,
        "calibration": {"method": "sim-isolated-prefill", "samples": len(samples)},
    })  # fmt: skip
