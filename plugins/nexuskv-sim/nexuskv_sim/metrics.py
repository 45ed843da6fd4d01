"""What one simulation run measured for one strategy (`SimResult`), and the table the CLI prints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attrs import define, field

__all__ = ["SimResult", "percentile", "summary"]


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, linearly interpolated; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@define
class SimResult:
    """Per-strategy outcome of a simulation."""

    strategy: str
    slo_ms: float
    ttft_ms: list[float] = field(factory=list)
    requests: int = 0  # requests offered
    completed: int = 0  # requests that decoded their last token
    failed: int = 0  # requests no node could serve (no node serves their model)
    rejected: int = 0  # requests the strategy refused (`Decision.node == ""`: route rules allow no node)
    input_tokens: int = 0
    reused_tokens: int = 0  # tokens not prefilled: held in hbm or loaded
    bytes_by_link: dict[str, int] = field(factory=dict)  # "pcie", "disk", "nic"
    fetches_by_source: dict[str, int] = field(factory=dict)  # "local:dram", "peer:hbm", ...
    prefetched_blocks: int = 0  # blocks background prefetches moved into a node's hbm
    load_misses: int = 0  # fetches cut short because their blocks were gone when they ran
    load_miss_blocks: int = 0  # blocks planned but not loaded because of those
    sim_ms: float = 0.0  # simulated time until the last request finished
    wall_s: float = 0.0  # host time the run took
    decide_s: float = 0.0  # host time spent in the strategy's decide
    decide_ms: list[float] = field(factory=list)  # host time of each decide (the first pays one-time set-up)

    @property
    def decide_p50_ms(self) -> float:
        """Median host time of one routing decision (a strategy's one-time set-up does not move it)."""
        return percentile(self.decide_ms, 50)

    @property
    def mean_ttft_ms(self) -> float:
        """Mean TTFT."""
        return sum(self.ttft_ms) / len(self.ttft_ms) if self.ttft_ms else 0.0

    @property
    def p50_ttft_ms(self) -> float:
        """Median TTFT."""
        return percentile(self.ttft_ms, 50)

    @property
    def p90_ttft_ms(self) -> float:
        """90th percentile TTFT."""
        return percentile(self.ttft_ms, 90)

    @property
    def p99_ttft_ms(self) -> float:
        """99th percentile TTFT."""
        return percentile(self.ttft_ms, 99)

    @property
    def slo_attainment(self) -> float:
        """Fraction of offered requests with a first token within `slo_ms` (failed ones miss it)."""
        return sum(1 for t in self.ttft_ms if t <= self.slo_ms) / self.requests if self.requests else 0.0

    @property
    def hit_ratio(self) -> float:
        """Reused (cached or loaded) tokens / input tokens."""
        return self.reused_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def gb_moved(self) -> float:
        """GB moved over all links (a remote disk read counts on the disk and on the NIC)."""
        return sum(self.bytes_by_link.values()) / 1e9

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-request list)."""
        return {"strategy": self.strategy, "requests": self.requests, "completed": self.completed,
                "failed": self.failed, "rejected": self.rejected, "mean_ttft_ms": self.mean_ttft_ms,
                "p50_ttft_ms": self.p50_ttft_ms,
                "p90_ttft_ms": self.p90_ttft_ms, "p99_ttft_ms": self.p99_ttft_ms, "slo_ms": self.slo_ms,
                "slo_attainment": self.slo_attainment, "hit_ratio": self.hit_ratio,
                "bytes_by_link": dict(self.bytes_by_link), "fetches_by_source": dict(self.fetches_by_source),
                "load_misses": self.load_misses, "load_miss_blocks": self.load_miss_blocks,
                "prefetched_blocks": self.prefetched_blocks,
                "sim_ms": self.sim_ms, "wall_s": self.wall_s, "decide_s": self.decide_s,
                "decide_p50_ms": self.decide_p50_ms}  # fmt: skip


def summary(results: Mapping[str, SimResult]) -> str:
    """A table of the strategies side by side (`decide ms`: the median host time of one routing decision)."""
    head = (f"{'strategy':<12} {'requests':>8} {'done':>6} {'mean TTFT':>10} {'p90 TTFT':>10} {'p99 TTFT':>10} "
            f"{'SLO':>6} {'hit':>6} {'GB moved':>9} {'misses':>6} {'wall s':>7} {'decide ms':>9}")  # fmt: skip
    lines = [head]
    for name, r in results.items():
        lines.append(f"{name:<12} {r.requests:>8} {r.completed:>6} {r.mean_ttft_ms:>10.0f} {r.p90_ttft_ms:>10.0f} "
                     f"{r.p99_ttft_ms:>10.0f} {r.slo_attainment:>6.3f} {r.hit_ratio:>6.3f} {r.gb_moved:>9.1f} "
                     f"{r.load_misses:>6} {r.wall_s:>7.1f} {r.decide_p50_ms:>9.3f}")  # fmt: skip
    return "\n".join(lines)
