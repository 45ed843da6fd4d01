"""Online estimates of each link's latency and bandwidth, measured from the kernel's own loads.

Every span loaded from a tier (or over a transport) is a sample: `nbytes` took `seconds`. A link's time is modelled as
latency + bytes / bandwidth, fitted by least squares with exponential forgetting (the newest samples weigh
most, about the last `1 / (1 - decay)` count), started from the cost profile's figures as two pseudo-samples
(at 0 bytes and 1 MiB) that fade like any sample, down to a floor of one millionth so that one payload size
alone still gives a line (through the measured point, sloped like the profile). Outlier guard: once a link has
samples, a sample further than `guard` times the running mean absolute residual from the current line is
clipped to that distance before it counts, unless the two samples before it were such outliers in the same
direction: one or two stalls move the estimate a little; a lasting change, confirmed by its third sample, counts
in full and makes the samples from before it fade at once. The bandwidth is capped at 10x the profile's (a flat
fitted line must not price large transfers as free). `LinkEstimates.get` answers only after
`min_samples` samples. An estimate no sample refreshed for `max_age_s` is looked at anew: for the `probe_s`
that follow (a probe window) the profile prices the link, so a link judged too slow to load from is tried
again and measured again; the first sample after that counts in full and the samples before it fade at once
(a recovered link is believed after one load, a still-slow one stays priced slow). Outside the window the last
estimate stands until a sample lands or `max_age_s` more pass (then another window): on a link that stays
slow, only the decisions of one short window per `max_age_s` pay for the look, not every decision until a
slow load comes back. Time is the kernel's clock (a simulator's when it passes one). Updates and reads are safe
from many threads: each link has a lock, and readers take an immutable `LinkEstimate`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping

from attrs import frozen

from nexuskv.contracts import CostProfile, LinkCost
from nexuskv.errors import ConfigError

__all__ = ["LinkEstimate", "LinkEstimates", "LinkEstimator", "link_estimates"]

_X1 = float(1 << 20)  # the size of the profile's second pseudo-sample (1 MiB)
_CONFIRM = 3  # consecutive outliers the same way that make a change, not a stall


@frozen
class LinkEstimate:
    """A link's fitted latency (ms) and bandwidth (bytes/s), from `samples` measured loads."""

    latency_ms: float
    bandwidth_bytes_per_s: float
    samples: int

    def transfer_ms(self, nbytes: float) -> float:
        """Predicted time to move `nbytes`."""
        return self.latency_ms + nbytes / self.bandwidth_bytes_per_s * 1e3


class LinkEstimator:
    """The fitted line of one link (see the module docstring)."""

    def __init__(self, prior: LinkCost, decay: float = 0.9, prior_weight: float = 0.5, guard: float = 6.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay, self.guard = decay, guard
        y0 = prior.latency_ms
        y1 = prior.latency_ms + _X1 / prior.bandwidth_bytes_per_s * 1e3
        self._prior_weight = prior_weight
        self._min_slope = 1e3 / prior.bandwidth_bytes_per_s / 10  # ms per byte: at most 10x the profile's bandwidth
        self._prior = (2.0, _X1, _X1 * _X1, y0 + y1, _X1 * y1)  # the sums of the two pseudo-samples, weight 1
        self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # decayed sums of w, w x, w x^2, w y, w x y
        self._scale = 0.0  # running mean absolute residual (ms)
        self._strikes, self._strike_up = 0, False  # consecutive outliers, and their direction
        self._lock = threading.Lock()
        self._clock = clock
        self.updated = clock()
        self._probe_from = -math.inf  # when the last probe window opened
        self.estimate = self._solve(0)

    def _solve(self, samples: int) -> LinkEstimate:
        w = max(self._prior_weight * self.decay**samples, 1e-6)
        s0, s1, s2, t0, t1 = (a + w * b for a, b in zip(self._sums, self._prior, strict=True))
        det = s0 * s2 - s1 * s1
        slope = (s0 * t1 - s1 * t0) / det if det > 0 else 0.0
        # A flat or falling line (one payload size, noise) would price large transfers as free: the bandwidth is
        # capped at 10x the profile's, and the latency refitted to that slope.
        slope = max(slope, self._min_slope)
        latency = max((t0 - slope * s1) / s0, 0.0)
        return LinkEstimate(latency, 1e3 / slope, samples)

    def observe(self, nbytes: float, seconds: float, max_age_s: float | None = None) -> LinkEstimate:
        """Add one measured transfer and return the new estimate.

        When the estimate is older than `max_age_s`, this is a first new look at the link: it counts in full (no
        outlier guard) and the samples from before fade at once.
        """
        x, y = float(nbytes), seconds * 1e3
        if not (math.isfinite(x) and math.isfinite(y)):
            return self.estimate  # a broken measurement says nothing about the link
        with self._lock:
            current = self.estimate
            fresh = max_age_s is not None and self._clock() - self.updated > max_age_s
            if fresh and current.samples:
                self._sums = [v * 0.01 for v in self._sums]  # stale history: the new look all but decides
                self._strikes = 0
                self._scale = abs(y - current.transfer_ms(x))
            elif current.samples:
                predicted = current.transfer_ms(x)
                limit = self.guard * max(self._scale, 0.01 * predicted, 1e-3)
                residual = y - predicted
                if abs(residual) <= limit:
                    self._strikes = 0
                elif self._strikes >= _CONFIRM - 1 and (residual > 0) == self._strike_up:
                    self._strikes += 1  # outliers the same way, again and again: the link changed; count it in
                    if self._strikes == _CONFIRM:  # full, and let the samples from before the change fade now
                        self._sums = [v * 0.1 for v in self._sums]
                else:
                    same = self._strikes and (residual > 0) == self._strike_up
                    self._strikes = self._strikes + 1 if same else 1
                    self._strike_up = residual > 0  # a stall (or two: one GC pause hits concurrent spans)
                    residual = math.copysign(limit, residual)
                y = predicted + residual
                self._scale = self.decay * self._scale + (1 - self.decay) * abs(residual)
            else:
                self._scale = abs(y - current.transfer_ms(x))
            d = self.decay
            s = self._sums
            self._sums = [d * s[0] + 1.0, d * s[1] + x, d * s[2] + x * x, d * s[3] + y, d * s[4] + x * y]
            self.estimate = self._solve(current.samples + 1)
            self.updated = self._clock()
            return self.estimate


    def probing(self, now: float, max_age_s: float, window_s: float, *, open_one: bool = True) -> bool:
        """Whether an estimate older than `max_age_s` is in its probe window now.

        A window opens (with `open_one`) when none is open and the last one opened `max_age_s` or more ago.
        """
        with self._lock:
            if open_one and now - self._probe_from >= max_age_s:
                self._probe_from = now
            return now - self._probe_from < window_s


class LinkEstimates:
    """Estimators of every link a kernel reads from, keyed by tier or transport name."""

    def __init__(self, profile: CostProfile, decay: float = 0.9, min_samples: int = 8,
                 max_age_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 probe_s: float = 1.0) -> None:  # fmt: skip
        """`clock`: monotonic seconds that estimates age on (`max_age_s`, `probe_s`); a simulator passes its own."""
        self.profile = profile
        self.probe_s = probe_s
        self.clock = clock
        self.decay = decay
        self.min_samples = min_samples
        self.max_age_s = max_age_s
        self._links: dict[str, LinkEstimator] = {}
        self._lock = threading.Lock()

    def _estimator(self, name: str) -> LinkEstimator:
        est = self._links.get(name)
        if est is None:
            prior = self.profile.tiers.get(name) or self.profile.transports.get(name)
            if prior is None:
                prior = LinkCost(bandwidth_bytes_per_s=1e9, latency_ms=0.1)  # a link the profile does not know
            with self._lock:
                est = self._links.setdefault(name, LinkEstimator(prior, decay=self.decay, clock=self.clock))
        return est

    def observe(self, name: str, nbytes: float, seconds: float) -> None:
        """Record that reading `nbytes` over link `name` took `seconds`."""
        if nbytes >= 0 and seconds >= 0:
            est = self._estimator(name)
            est.observe(nbytes, seconds, max_age_s=self.max_age_s)

    def get(self, name: str, *, probe: bool = True) -> LinkEstimate | None:
        """The link's estimate once it has `min_samples` samples (None before: the profile prices it).

        None too while an aged estimate is in its probe window; `probe=False` (a metrics scrape) never opens one.
        """
        est = self._links.get(name)
        if est is None or est.estimate.samples < self.min_samples:
            return None
        now = self.clock()
        if now - est.updated > self.max_age_s and est.probing(now, self.max_age_s, self.probe_s, open_one=probe):
            return None  # too old to trust, in its probe window: the profile prices it, a load measures it again
        return est.estimate

    def snapshot(self) -> Mapping[str, dict[str, float]]:
        """Every measured link as plain numbers (for the cluster view)."""
        return {name: {"latency_ms": round(e.estimate.latency_ms, 6),
                       "bandwidth_bytes_per_s": round(e.estimate.bandwidth_bytes_per_s, 1),
                       "samples": e.estimate.samples}
                for name, e in sorted(dict(self._links).items())}  # fmt: skip (a copy: links are added meanwhile)


def link_estimates(config: Mapping[str, object], profile: CostProfile,
                   clock: Callable[[], float] = time.monotonic) -> LinkEstimates | None:  # fmt: skip
    """The `[links]` table of a kernel config: estimates unless `measure = false`.

    Keys: decay, min_samples, max_age_s, probe_s.
    """
    unknown = set(config) - {"measure", "decay", "min_samples", "max_age_s", "probe_s"}
    if unknown:
        raise ConfigError(f"[links]: unknown keys {sorted(unknown)} "
                          "(known: measure, decay, min_samples, max_age_s, probe_s)")  # fmt: skip
    if not config.get("measure", True):
        return None
    try:
        decay = float(config.get("decay", 0.9))  # type: ignore[arg-type]
        min_samples = int(config.get("min_samples", 8))  # type: ignore[call-overload]
        max_age_s = float(config.get("max_age_s", 30.0))  # type: ignore[arg-type]
        probe_s = float(config.get("probe_s", 1.0))  # type: ignore[arg-type]
        if not 0.0 < decay < 1.0 or min_samples < 1 or not 0 < max_age_s < math.inf or not 0 < probe_s < math.inf:
            raise ValueError  # NaN fails every comparison: refused too
    except (TypeError, ValueError):
        raise ConfigError("[links]: decay must be in (0, 1), min_samples a positive integer, max_age_s and "
                          "probe_s finite and > 0") from None  # fmt: skip
    return LinkEstimates(profile, decay=decay, min_samples=min_samples, max_age_s=max_age_s, clock=clock,
                         probe_s=probe_s)  # fmt: skip
