"""The end-to-end run behind `make demo` and `bench/e2e_reference.py`: one workload, three strategies, real engine.

Each strategy has its own kernel with the same tiers; every request is served by all three in turn (rotating the
order) so the machine's noisy moments fall on all of them alike. NexusKV's answer is checked against the
never-reuse answer for every request: reuse must not change the logits.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import define, field

from nexuskv import Kernel, KernelConfig, PlanAction
from nexuskv_transformers.calibrate import CalibrationReport, calibrate, measurable, save
from nexuskv_transformers.connector import MODES, Outcome, TransformersConnector
from nexuskv_transformers.models import ReferenceModel, build_model
from nexuskv_transformers.workload import PHASES, SHARED_PHASES, Item, demo_workload

__all__ = ["DEMO_POLICIES", "DEMO_TIERS", "RunResult", "demo_config", "run_workload", "safety_checks"]

DEMO_POLICIES = str(Path(__file__).parent / "demo_policies")
DEMO_TIERS: dict[str, dict[str, Any]] = {
    "dram": {"store": "dram", "capacity_bytes": "512MiB"},
    # A remote tier behind an emulated 10 MB/s link: reading 1,024 tokens of state back (2 MiB) takes about
    # 200 ms, twice what recomputing them takes on this CPU.
    "remote": {"store": "shaped-link", "capacity_bytes": "1GiB", "bandwidth_bytes_per_s": 10e6, "latency_ms": 2.0},
}
SECRET = bytes(range(32))
TOLERANCE = 1e-4  # restored vs recomputed logits; chunked prefill on the demo model stays well inside it


def demo_config(profile: str | None) -> KernelConfig:
    """The demo kernel: DRAM plus the slow remote tier, the demo policies, the calibrated profile."""
    return KernelConfig(node="demo", tiers=DEMO_TIERS, policies=DEMO_POLICIES, profile=profile,
                        load_timeout_ms=10_000, deadline_ms=2.0)  # fmt: skip


@define
class RunResult:
    """Outcomes per strategy, in workload order, and the answer checks."""

    items: list[Item]
    outcomes: dict[str, list[Outcome]]
    max_logit_diff: dict[str, float] = field(factory=dict)
    argmax_equal: dict[str, bool] = field(factory=dict)
    failures: list[str] = field(factory=list)  # real safety failures the demo found (wrong state, wrong answers)

    def absorb(self, other: RunResult) -> RunResult:
        """This result with another run's requests added (the same strategies): outcomes, worst diffs, failures."""
        self.items += other.items
        for m, outs in other.outcomes.items():
            self.outcomes[m] += outs
        for m, diff in other.max_logit_diff.items():
            self.max_logit_diff[m] = max(self.max_logit_diff[m], diff)
            self.argmax_equal[m] &= other.argmax_equal[m]
        self.failures += other.failures
        return self

    def ttfts(self, mode: str, phases: Sequence[str]) -> list[float]:
        """TTFTs (ms) of one strategy over the requests of some phases."""
        return [o.ttft_s * 1e3 for it, o in zip(self.items, self.outcomes[mode], strict=True) if it.phase in phases]

    def mean_ttft(self, mode: str, phases: Sequence[str]) -> float:
        """Mean TTFT (ms)."""
        return statistics.fmean(self.ttfts(mode, phases))

    def ratio(self, mode: str, phases: Sequence[str], base: str = "never") -> float:
        """Mean TTFT of `mode` over mean TTFT of `base`, on the same requests."""
        return self.mean_ttft(mode, phases) / self.mean_ttft(base, phases)

    def recomputed(self, mode: str, phases: Sequence[str]) -> int:
        """Tokens prefilled."""
        return sum(o.tokens_recomputed for it, o in zip(self.items, self.outcomes[mode], strict=True)
                   if it.phase in phases)  # fmt: skip

    def table(self) -> str:
        """TTFT (mean, p90) and tokens recomputed per phase and strategy, with ratios to never-reuse."""
        rows = [f"{'phase':<10} {'strategy':<8} {'requests':>8} {'mean TTFT ms':>12} {'p90 TTFT ms':>11} "
                f"{'vs never':>8} {'recomputed':>10}"]  # fmt: skip
        groups = [(p, (p,)) for p in PHASES] + [("shared", SHARED_PHASES), ("all", PHASES)]
        for label, phases in groups:
            for mode in MODES:
                ts = sorted(self.ttfts(mode, phases))
                if not ts:
                    continue
                p90 = ts[min(len(ts) - 1, round(0.9 * (len(ts) - 1)))]
                rows.append(f"{label:<10} {mode:<8} {len(ts):>8} {statistics.fmean(ts):>12.1f} {p90:>11.1f} "
                            f"{self.ratio(mode, phases):>8.3f} {self.recomputed(mode, phases):>10}")  # fmt: skip
        return "\n".join(rows)

    def decisions(self, phases: Sequence[str] = PHASES) -> str:
        """Where NexusKV and always-reuse decided alike (the same tokens reused) and where they differed, and why.

        NexusKV's fallbacks (a plan that failed open, or a load that did) are named as such.
        """
        same, differ, fell = 0, [], []
        for it, nx, al in zip(self.items, self.outcomes["nexuskv"], self.outcomes["always"], strict=True):
            if it.phase not in phases:
                continue
            reasons = nx.plan.reasons if nx.plan is not None else ()
            decisive = next((r for r in reasons if r.startswith(("recompute:", "reuse "))),
                            reasons[-1] if reasons else "")  # fmt: skip
            reason = nx.fallback or decisive
            if nx.plan is not None and nx.plan.reasons and nx.plan.reasons[0].startswith("fail-open"):
                reason = nx.plan.reasons[0]
            if nx.fallback or reason.startswith("fail-open"):
                fell.append(f"    {it.request_id}: {reason}")
            if nx.tokens_reused == al.tokens_reused:
                same += 1
            else:
                differ.append(f"    {it.request_id:<13} NexusKV reused {nx.tokens_reused:>4}, always-reuse "
                              f"{al.tokens_reused:>4}: {reason}")  # fmt: skip
        lines = [f"NexusKV and always-reuse reused the same tokens on {same} of {same + len(differ)} requests"]
        if differ:
            lines += ["  where they differed:", *differ]
        lines.append(f"NexusKV fell back (under load, or a failed load) on {len(fell)} requests"
                     + (":" if fell else ""))  # fmt: skip
        return "\n".join(lines + fell)


def run_workload(model: ReferenceModel, profile: str | None, items: Sequence[Item], *,
                 on_outcome: Callable[[Item, dict[str, Outcome]], None] | None = None) -> RunResult:  # fmt: skip
    """Serve every item under every strategy (each with its own kernel) and compare the answers."""
    kernels = {m: Kernel(demo_config(profile), secret=SECRET) for m in MODES}
    gc.freeze()  # the models and kernels live on: the collections between requests only look at what is new
    try:
        conns = {m: TransformersConnector(kernels[m], model, mode=m) for m in MODES}
        outcomes: dict[str, list[Outcome]] = {m: [] for m in MODES}
        diffs: dict[str, float] = {m: 0.0 for m in MODES}
        argmax: dict[str, bool] = {m: True for m in MODES}
        for i, item in enumerate(items):
            order = MODES[i % 3:] + MODES[: i % 3]
            got: dict[str, Outcome] = {}
            for mode in order:
                c = conns[mode]
                req = c.request(item.tokens, tenant=item.tenant, scope=item.scope, request_id=item.request_id)
                gc.collect()  # garbage one strategy made is not collected inside another's timed window
                got[mode] = c.run(req, session=item.session)
                kernels[mode].flush(30)  # stored before the next request, outside every timed window
            for mode in MODES:
                d = (got[mode].logits - got["never"].logits).abs().max().item()
                diffs[mode] = max(diffs[mode], d)
                argmax[mode] &= bool(torch.equal(got[mode].logits.argmax(-1), got["never"].logits.argmax(-1)))
                outcomes[mode].append(got[mode])
            if on_outcome:
                on_outcome(item, got)
        return RunResult(list(items), outcomes, diffs, argmax)
    finally:
        gc.unfreeze()
        for k in kernels.values():
            k.close()


# ------------------------------------------------------------------------------------------ safety checks


PASS, FAIL, FALLBACK = "PASS", "FAIL", "FALLBACK"
"""A check's verdicts: FAIL is wrong state (an answer that differs, or state of another model or tenant reused);
FALLBACK is right answers with less reused than the check expected (a load that fell back), never a safety failure."""


def _safety_kernel() -> Kernel:
    """The safety checks' kernel: a planning budget and load timeout no busy machine reaches.

    A check's verdict is then about correctness, not about how loaded the machine is.
    """
    return Kernel(KernelConfig(node="safety", deadline_ms=2000.0, load_timeout_ms=10_000), secret=SECRET)


def safety_checks(kinds: Sequence[str] = ("dense", "latent", "windowed", "recurrent", "hybrid"),
                  connector: Callable[..., TransformersConnector] = TransformersConnector,
                  ) -> list[tuple[str, str, str, str]]:  # fmt: skip
    """The demo's short version of the safety suite: (kind, check, verdict, detail) rows.

    Verdicts are PASS, FAIL or FALLBACK; the detail says which condition decided (tokens reused, argmax, tolerance).
    `connector` builds the connector under test (a test passes one that restores wrong state).
    """
    rows = []
    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, 2000, (100,), generator=g).tolist()
    tail = torch.randint(3, 2000, (20,), generator=g).tolist()
    for kind in kinds:
        ref = build_model(kind)
        with _safety_kernel() as k:
            c = connector(k, ref, checkpoint_every=1)
            c.run(c.request(base, tenant="t"))
            stored = k.flush(10)  # nothing stored: every check below would pass for want of anything to refuse
            worst, wrong, short, reused = 0.0, [], [], 0
            for cut in (1, 3, 6):
                ids = base[: cut * 16] + tail
                out = c.run(c.request(ids, tenant="t"), all_logits=True)
                full = c.engine.prefill(ids, all_logits=True).logits[out.tokens_reused :]
                diff = (out.logits - full).abs().max().item()
                worst = diff if not diff <= worst else worst  # a NaN is the worst there is
                reused += out.tokens_reused
                if out.tokens_reused > cut * 16:  # more than the shared prefix: state of other tokens
                    wrong.append(f"cut {cut * 16}: reused {out.tokens_reused}, more than the shared prefix")
                if not torch.equal(out.logits.argmax(-1), full.argmax(-1)):
                    wrong.append(f"cut {cut * 16}: argmax differs")
                elif not diff <= TOLERANCE:  # NaN too
                    wrong.append(f"cut {cut * 16}: |diff| {diff:.1e} over {TOLERANCE:g}")
                if out.tokens_reused < cut * 16:
                    short.append(f"cut {cut * 16}: reused {out.tokens_reused} ({out.fallback or 'recomputed'})")
            verdict = FAIL if wrong else FALLBACK if short or not stored else PASS
            detail = "; ".join(wrong + short) or f"reused 16/48/96, argmax equal, max |diff| {worst:.1e}"
            rows.append((kind, "restore + suffix == full prefill (cuts 16/48/96)", verdict,
                         detail if stored else f"{detail}; the first request's state was not stored in time"))
            # a refusal means something only when the owner's state was there to be refused (it was reused above)
            there = stored and reused > 0
            for check, conn, tenant in (("other weights refused", connector(k, build_model(kind, seed=1), commit=False),
                                         "t"), ("other tenant refused", connector(k, ref, commit=False), "globex")):
                out = conn.run(conn.request(base, tenant=tenant))
                verdict = FAIL if out.tokens_reused else PASS if there else FALLBACK
                rows.append((kind, check, verdict, f"reused {out.tokens_reused}"
                             + ("" if there else " (inconclusive: nothing of the owner's was reused above)")))
    return rows


# ------------------------------------------------------------------------------------------ the demo


SMOKE = {"calibration": {"lengths": ((32, 64, 128, 192), (48, 96)), "repeats": 1, "blocks": (1, 4)},
         "workload": {"sessions": 1, "turns": 2, "docs": 1, "queries": 2, "agent_steps": 2, "unique": 1},
         "kinds": ("dense",)}
"""The smallest whole demo (`engine-demo --smoke`): every step, in seconds, for tests."""


def run_demo(*, quick: bool = True, out: Any = None, show_requests: bool = True, smoke: bool = False) -> RunResult:
    """The whole demo: calibrate, safety checks, the workload under three strategies, the tables.

    The result's `failures` lists every real safety failure (a FAIL line); `engine-demo` exits 1 when there is any.
    """
    from tqdm import tqdm

    echo = (lambda s: print(s, file=out)) if out is not None else tqdm.write
    torch.set_grad_enabled(False)
    echo("== 1. Reference model: tiny Llama-style GQA (4 layers, hidden 256, 2 KiB of KV per token), random "
         "weights, CPU")  # fmt: skip
    model = build_model("dense", size="demo")
    with tempfile.TemporaryDirectory() as tmp:
        echo("== 2. Calibration on this machine (prefill over lengths and cut points, tier reads)")
        with measurable(demo_config(None)) as cfg, Kernel(cfg, secret=SECRET) as k, \
                tqdm(total=None, desc="calibrating", unit="step", file=sys.stderr, leave=False) as bar:  # fmt: skip
            report: CalibrationReport = calibrate(TransformersConnector(k, model), quick=quick,
                                                  progress=lambda: bar.update(1),
                                                  command="nexuskv engine-demo (quick calibration)",
                                                  **(SMOKE["calibration"] if smoke else {}))  # fmt: skip
        profile = str(Path(tmp) / "profile.json")
        save(report, profile)
        echo(report.summary())
        echo("== 3. Safety checks (every state kind; FALLBACK: right answers, less reused than expected)")
        failures = []
        for kind, check, verdict, detail in safety_checks(**({"kinds": SMOKE["kinds"]} if smoke else {})):
            echo(f"  {verdict:<8}  {kind:<9} {check:<50} {detail}")
            if verdict == FAIL:
                failures.append(f"{kind}: {check}: {detail}")
        items = demo_workload(**(SMOKE["workload"] if smoke else {}))
        echo(f"== 4. Mixed workload: {len(items)} requests x {len(MODES)} strategies (one line per request: "
             "NexusKV's plan, and the TTFT of each strategy)")  # fmt: skip
        with tqdm(total=len(items), desc="serving", unit="req", file=sys.stderr, leave=False) as bar:
            def show(item: Item, got: dict[str, Outcome]) -> None:
                if show_requests:
                    o = got["nexuskv"]
                    act = o.plan.action.value if o.plan is not None else "prefill"
                    src = f" from {o.tier}" if o.tier and o.plan.action == PlanAction.MATERIALIZE else ""
                    echo(f"  {item.request_id:<13} {act:<11} reuse {o.tokens_reused:>4}/{o.tokens_total:<5}{src:<12}"
                         f" nexuskv {o.ttft_s * 1e3:6.1f}  never {got['never'].ttft_s * 1e3:6.1f}  "
                         f"always {got['always'].ttft_s * 1e3:6.1f} ms  | {o.plan.reasons[-1] if o.plan else ''}")
                bar.update(1)

            result = run_workload(model, profile, items, on_outcome=show)
    echo("== 5. Results (measured TTFT on this CPU; ratio = mean TTFT / never-reuse mean TTFT)")
    echo(result.table())
    echo(result.decisions())
    echo("== 6. Answers: NexusKV and always-reuse logits vs never-reuse, every request")
    result.failures = failures
    for mode in ("nexuskv", "always"):
        ok = result.argmax_equal[mode] and result.max_logit_diff[mode] <= TOLERANCE
        echo(f"  {'PASS' if ok else 'FAIL'}  {mode:<8} argmax equal on every request: {result.argmax_equal[mode]}, "
             f"max |logit diff| {result.max_logit_diff[mode]:.1e} (tolerance {TOLERANCE:g})")
        if not ok:
            result.failures.append(f"{mode}: answers differ from never-reuse (argmax equal "
                                   f"{result.argmax_equal[mode]}, max |logit diff| {result.max_logit_diff[mode]:.1e})")
    return result
