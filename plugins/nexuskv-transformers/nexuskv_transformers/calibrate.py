"""Calibration: measure this machine's prefill and tier costs with a reference model, fit a cost profile, plot it.

Prefill time is measured over prompt lengths and cut points (a restored prefix of M tokens, then the rest) and
fitted to base + a*(L-M) + b*(L^2-M^2) by non-negative least squares on half the lengths; the other half is held
out and the mean relative error on it is reported. Tier costs are measured through the kernel's own load path
(`materialize`), mount cost through the connector's restore; both are fitted as latency + bytes / bandwidth.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from attrs import define, evolve, field

from nexuskv import (
    Calibration,
    CodecCost,
    CostProfile,
    KernelConfig,
    LinkCost,
    Plan,
    PlanSpan,
    PrefillCost,
    default_profile,
    load_profile,
    to_dict,
)
from nexuskv_transformers.connector import TransformersConnector
from nexuskv_transformers.engine import Engine

__all__ = ["CalibrationReport", "PrefillSample", "calibrate", "fit_link", "fit_prefill", "measurable", "plot"]

FIT_LENGTHS = (64, 128, 256, 512, 768, 1024, 1536, 2048)
HELDOUT_LENGTHS = (96, 192, 384, 640, 896, 1280, 1792)
QUICK_FIT = (64, 256, 512, 1024, 1536)
QUICK_HELDOUT = (128, 384, 768, 1280)
CUT_FRACTIONS = (0.25, 0.5, 0.75)


@define(frozen=True)
class PrefillSample:
    """One measured prefill: `length` tokens of which the first `cached` were restored, in milliseconds."""

    length: int
    cached: int
    ms: float


@define
class CalibrationReport:
    """Everything a calibration measured and fitted."""

    profile: CostProfile
    fit: list[PrefillSample]
    heldout: list[PrefillSample]
    heldout_error_pct: float
    tiers: dict[str, list[tuple[int, float]]] = field(factory=dict)  # tier -> (raw bytes, ms)
    mount: list[tuple[int, float]] = field(factory=list)  # (blocks, ms)
    page_size: int = 16

    def predicted_ms(self, length: int, cached: int = 0) -> float:
        """The fitted prefill time."""
        p = self.profile.prefill
        if length <= cached:
            return 0.0
        return p.base_ms + p.per_token_ms * (length - cached) + p.per_token_sq_ms * (length**2 - cached**2)

    def summary(self) -> str:
        """A few lines for a terminal."""
        p = self.profile
        lines = [f"prefill: {p.prefill.base_ms:.2f} ms + {p.prefill.per_token_ms * 1e3:.2f} us/token + "
                 f"{p.prefill.per_token_sq_ms * 1e6:.3f} ns/token^2  ({len(self.fit)} samples fitted)",
                 f"held-out error: {self.heldout_error_pct:.1f}% mean over {len(self.heldout)} samples at lengths "
                 f"{sorted({s.length for s in self.heldout})}"]  # fmt: skip
        for t, c in p.tiers.items():
            lines.append(f"tier {t}: {c.latency_ms:.3f} ms + {c.bandwidth_bytes_per_s / 1e6:.1f} MB/s")
        lines.append(f"mount: {p.mount_ms_per_block * 1e3:.1f} us/block; lookup {p.lookup_ms:.3f} ms")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ fitting


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (exhaustive over active sets: a handful of columns)."""
    best, best_err = np.zeros(a.shape[1]), float("inf")
    for r in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(((a[:, cols] @ coef - y) ** 2).sum())
            if err < best_err:
                best_err, best = err, np.zeros(a.shape[1])
                best[list(cols)] = coef
    return best


def fit_prefill(samples: Sequence[PrefillSample]) -> PrefillCost:
    """Fit base + a*(L-M) + b*(L^2-M^2) to the samples, weighting each by 1/time (relative error)."""
    a = np.array([[1.0, s.length - s.cached, s.length**2 - s.cached**2] for s in samples])
    y = np.array([s.ms for s in samples])
    w = 1.0 / np.maximum(y, 1e-6)
    base, per_token, per_sq = _nnls(a * w[:, None], y * w)
    return PrefillCost(base_ms=float(base), per_token_ms=float(per_token), per_token_sq_ms=float(per_sq))


def fit_link(points: Sequence[tuple[int, float]]) -> LinkCost:
    """Fit latency + bytes / bandwidth to (bytes, ms) points."""
    a = np.array([[1.0, b] for b, _ in points])
    y = np.array([ms for _, ms in points])
    latency, ms_per_byte = _nnls(a, y)
    return LinkCost(bandwidth_bytes_per_s=1e3 / max(float(ms_per_byte), 1e-12), latency_ms=float(latency))


def heldout_error(cost: PrefillCost, samples: Sequence[PrefillSample]) -> float:
    """Mean relative error (%) of the fitted prefill time on the samples."""
    errs = []
    for s in samples:
        pred = cost.base_ms + cost.per_token_ms * (s.length - s.cached) + cost.per_token_sq_ms * (
            s.length**2 - s.cached**2)  # fmt: skip
        errs.append(abs(pred - s.ms) / s.ms * 100)
    return float(statistics.fmean(errs)) if errs else 0.0


# ------------------------------------------------------------------------------------------ measuring


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_prefill(engine: Engine, lengths: Sequence[int], *, repeats: int = 5,
                    progress: Callable[[], None] | None = None) -> list[PrefillSample]:  # fmt: skip
    """Median prefill times at each length, from scratch and after restored prefixes (CUT_FRACTIONS of it).

    Repeats are interleaved across lengths so a noisy moment of the machine spreads over all of them.
    """
    page = engine.ref.page_size
    jobs: list[tuple[int, int]] = []
    for n in lengths:
        jobs.append((n, 0))
        jobs.extend((n, int(n * f) // page * page) for f in CUT_FRACTIONS if int(n * f) // page * page > 0)
    prefixes = {}
    for n, m in jobs:
        if m:
            prefixes[(n, m)] = engine.prefill(_tokens(n, n)[:m]).cache
    engine.prefill(_tokens(64, 0))  # warm up
    times: dict[tuple[int, int], list[float]] = {j: [] for j in jobs}
    for _ in range(repeats):
        for n, m in jobs:
            ids = _tokens(n, n)
            cache = copy.deepcopy(prefixes[(n, m)]) if m else None
            times[(n, m)].append(_timed(lambda ids=ids, cache=cache, m=m: engine.prefill(ids, cache=cache, start=m)))
            if progress:
                progress()
    return [PrefillSample(n, m, statistics.median(ts)) for (n, m), ts in times.items()]


def measure_tiers(connector: TransformersConnector, *, blocks: Sequence[int] = (1, 4, 16, 32, 64), repeats: int = 5,
                  progress: Callable[[], None] | None = None) -> tuple[dict[str, list[tuple[int, float]]],
                                                                        list[tuple[int, float]]]:  # fmt: skip
    """Load times of spans of `blocks` blocks from every tier through `materialize`, and mount (restore) times."""
    kernel, ref = connector.kernel, connector.ref
    page = ref.page_size
    n = max(blocks) * page + 1
    ids = _tokens(n, 4242)
    out = connector.engine.prefill(ids)
    req = connector.request(ids, tenant="calibration", request_id="calibration")
    keys = kernel.keys(req)
    payloads = [connector.codec.page_payload(out.cache, b, 0) for b in range(max(blocks))]
    tiers: dict[str, list[tuple[int, float]]] = {}
    mount: list[tuple[int, float]] = []
    for tier in kernel.tiers:  # every configured tier, costed in the profile or not (yet)
        for b, (raw, specs) in enumerate(payloads):
            kernel.put(kernel.describe(req, b, raw, tier=tier, keys=keys, tensors=specs), raw)
        samples: dict[int, list[float]] = {k: [] for k in blocks}
        for _ in range(repeats):
            for k in blocks:
                plan = kernel.seal(Plan(decision_id="calibration", request_id="calibration", tenant="calibration",
                                        action="materialize", tokens_total=n, tokens_reused=k * page,
                                        spans=(PlanSpan(0, k * page, tier, kernel.node),)))  # fmt: skip
                t0 = time.perf_counter()
                got = kernel.materialize(plan, req, keys=keys, timeout_ms=60_000)
                samples[k].append((time.perf_counter() - t0) * 1e3)
                if not got.complete:
                    raise RuntimeError(f"calibration load from {tier} failed: {got.reason}")
                if tier == next(iter(kernel.tiers)):
                    states = {key: (v.payload, v.descriptor) for key, v in got.states.items()}
                    mount.append((k, _timed(lambda states=states, k=k: connector.codec.restore(states, k))))
                if progress:
                    progress()
        tiers[tier] = [(k * page * ref.kv_bytes_per_token(), statistics.median(v)) for k, v in samples.items()]
    return tiers, mount


@contextlib.contextmanager
def measurable(config: KernelConfig) -> Iterator[KernelConfig]:
    """`config`, with a provisional cost for every tier its profile does not price yet, for the calibrating kernel.

    A kernel refuses a tier its cost profile has no cost for (docs/tiers.md#tier-costs), and measuring such a
    tier is what calibration is for. It reads every tier through explicit plans, so the provisional figure (the
    one `nexuskv.planning.links` assumes for an unknown link) prices nothing it measures.
    """
    base = load_profile(config.profile) if config.profile else default_profile()
    missing = [t for t in config.tiers if t not in base.tiers]
    if not missing:
        yield config
        return
    provisional = LinkCost(bandwidth_bytes_per_s=1e9, latency_ms=0.1)
    profile = evolve(base, tiers={**base.tiers, **dict.fromkeys(missing, provisional)})
    with tempfile.TemporaryDirectory(prefix="nexuskv-calibrate-") as tmp:
        path = Path(tmp) / "provisional-profile.json"
        path.write_text(json.dumps(to_dict(profile)))
        yield evolve(config, profile=str(path))


def calibrate(
    connector: TransformersConnector,
    *,
    quick: bool = False,
    repeats: int | None = None,
    progress: Callable[[], None] | None = None,
    command: str = "nexuskv calibrate",
    lengths: tuple[Sequence[int], Sequence[int]] | None = None,
    blocks: Sequence[int] = (1, 4, 16, 32, 64),
) -> CalibrationReport:
    """Measure, fit and return the report (its `profile` is ready to save).

    `lengths` = (fitted, held out) overrides the prompt lengths; `blocks` are the span sizes read from each tier.
    """
    fit_l, held_l = lengths or ((QUICK_FIT, QUICK_HELDOUT) if quick else (FIT_LENGTHS, HELDOUT_LENGTHS))
    fit_l, held_l = tuple(fit_l), tuple(held_l)
    reps = repeats or (3 if quick else 5)
    samples = measure_prefill(connector.engine, sorted(fit_l + held_l), repeats=reps, progress=progress)
    fit = [s for s in samples if s.length in fit_l]
    held = [s for s in samples if s.length in held_l]
    cost = fit_prefill(fit)
    err = heldout_error(cost, held)
    tiers, mount = measure_tiers(connector, blocks=blocks, repeats=reps, progress=progress)
    kernel, ref = connector.kernel, connector.ref
    links = {t: fit_link(points) for t, points in tiers.items()}
    mount_fit = fit_link([(k, ms) for k, ms in mount])
    req = connector.request(_tokens(512, 7), tenant="calibration")
    lookup = statistics.median(_timed(lambda: kernel.plan(req)) for _ in range(20))
    profile = CostProfile(
        name=f"transformers-{ref.kind}-{ref.size}-{platform.machine()}",
        model=ref.identity.name,
        hardware=f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
                 f"torch {torch.__version__}",
        bytes_per_token=max(1, ref.kv_bytes_per_token()),
        prefill=cost,
        tiers=links,
        transports={"local": LinkCost(bandwidth_bytes_per_s=1e12, latency_ms=0.0)},
        codecs={"raw": CodecCost(decode_bytes_per_s=1e12, encode_bytes_per_s=1e12, ratio=1.0)},
        lookup_ms=lookup,
        mount_ms_per_block=1e3 / mount_fit.bandwidth_bytes_per_s,  # fitted as blocks per second
        calibration=Calibration(method=command, samples=len(fit) + sum(len(v) for v in tiers.values()),
                                heldout_error_pct=round(err, 2)),
    )  # fmt: skip
    return CalibrationReport(profile, fit, held, err, tiers, mount, ref.page_size)


def save(report: CalibrationReport, path: str | Path) -> None:
    """Write the profile as JSON (validated on load by `nexuskv.planning.cost.load_profile`)."""
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_dict(report.profile), indent=2) + "\n")


# ------------------------------------------------------------------------------------------ plot


def plot(report: CalibrationReport, path: str | Path) -> Path:
    """Plot the calibration to a PNG: two panels.

    Left, measured vs predicted prefill time over lengths (held-out points marked); right, T_recompute(M) vs
    T_transfer(M) + T_mount per tier, with the crossover where reuse stops paying marked.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = report.profile
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    full_fit = sorted((s for s in report.fit if s.cached == 0), key=lambda s: s.length)
    full_held = sorted((s for s in report.heldout if s.cached == 0), key=lambda s: s.length)
    cut = [s for s in report.fit + report.heldout if s.cached]
    top = max(s.length for s in report.fit + report.heldout)
    xs = np.linspace(1, top * 1.05, 200)
    ax1.plot(xs, [report.predicted_ms(int(x)) for x in xs], "-", color="C0", label="predicted (fit)")
    ax1.plot([s.length for s in full_fit], [s.ms for s in full_fit], "o", color="C0", label="measured, fitted")
    ax1.plot([s.length for s in full_held], [s.ms for s in full_held], "s", color="C3", label="measured, held out")
    ax1.plot([s.length for s in cut], [s.ms for s in cut], "x", color="C2", label="measured, after a restored prefix")
    ax1.plot([s.length for s in cut], [report.predicted_ms(s.length, s.cached) for s in cut], "+", color="k",
             label="predicted, after a restored prefix")  # fmt: skip
    ax1.set_xlabel("prompt length L (tokens)")
    ax1.set_ylabel("prefill time (ms)")
    ax1.set_title(f"T_prefill: held-out error {report.heldout_error_pct:.1f}%")
    ax1.legend(fontsize=8)

    horizon = 16384  # past the measured range the curves are predictions: far enough to show every crossover
    ms_ = np.arange(report.page_size, horizon + 1, report.page_size)
    a, b = p.prefill.per_token_ms, p.prefill.per_token_sq_ms
    ax2.plot(ms_, a * ms_ + b * ms_**2, "-", color="C0", label="T_recompute(M) predicted")
    base = {s.length: s.ms for s in report.fit + report.heldout if s.cached == 0}
    pts = [(s.cached, base[s.length] - s.ms) for s in cut if s.length in base]
    ax2.plot([m for m, _ in pts], [v for _, v in pts], "o", color="C0", ms=4, label="T_recompute(M) measured")
    for i, (tier, points) in enumerate(report.tiers.items(), start=1):
        link = p.tiers[tier]
        per_tok = p.bytes_per_token / link.bandwidth_bytes_per_s * 1e3
        pred = link.latency_ms + per_tok * ms_ + p.mount_ms_per_block * ms_ / report.page_size + p.lookup_ms
        ax2.plot(ms_, pred, "--", color=f"C{i}", label=f"T_transfer+mount(M) {tier} predicted")
        ax2.plot([bts / p.bytes_per_token for bts, _ in points], [v for _, v in points], "s", color=f"C{i}", ms=4,
                 label=f"T_transfer(M) {tier} measured")  # fmt: skip
        recompute = a * ms_ + b * ms_**2
        wins = recompute > pred
        if wins.any() and not wins.all():
            flips = np.nonzero(np.diff(wins.astype(int)))[0]
            for f in flips:
                ax2.axvline(ms_[f], color=f"C{i}", lw=0.8, ls=":")
                ax2.annotate(f"{tier}: reuse pays from M={ms_[f + 1]}" if wins[f + 1] else
                             f"{tier}: reuse stops paying at M={ms_[f]}", (ms_[f], pred[f]), fontsize=8,
                             xytext=(5, 10), textcoords="offset points")  # fmt: skip
    ax2.set_xlabel("reused prefix M (tokens)")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.set_xscale("log")
    ax2.set_title("reuse pays where T_recompute > T_transfer + T_mount")
    ax2.legend(fontsize=7)
    fig.suptitle(f"{p.name} ({p.hardware})", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
