"""Reuse that survives load: plans, fresh kernels and the reference engine while a CPU hog keeps every core busy.

Run: `.venv/bin/python bench/load.py` (about four minutes on 2 cores). The hog is another process (one spinning
worker per core, started and stopped here); every figure under load is printed beside the same pass on the quiet
machine, and a fixed 1 ms budget (`deadline_ms = deadline_cap_ms = 1`: the default before issue 30, though stretched
by the machine's load like any budget now) runs beside the budget sized by the stakes, on the same requests under
the same load.

1. Plans: a kernel holds every block of four requests (1k, 4k, 9k and 32k tokens, the documented default profile,
   DRAM) and plans their follow-ups round after round. A plan that fails open is judged in hindsight by the kernel
   (`LostGain`: planned again off the hot path, without the tight budget); the lost-gain fraction is the gain those
   fallbacks gave up over the gain of every plan that could reuse (the gain the reusing plans predicted plus the
   gain lost). Both terms are the kernel's own predictions (`plan.predicted.gain_ms` and its hindsight plans'),
   not measured times, so the fraction is printed as a fact beside the fallback count, not as a RESULT: a kernel
   whose predictions were wrong would judge itself by them just the same. Fallbacks are counted apart, never timed
   as plans.
2. First plans: fresh kernels, each opening a disk tier an earlier kernel filled (re-indexed at start), each
   planning a 4k-token follow-up first thing: `load.first_plan_fallbacks` counts the ones that failed open.
3. The reference engine (tiny random-weight model on the CPU, `nexuskv-transformers`): the demo's shared phases
   (chat, rag, agent) served by NexusKV and by always-reuse, each request by both in turn, under the hog;
   `load.e2e_nexuskv_over_always` is NexusKV's mean TTFT over always-reuse's on the same requests. The profile is
   calibrated on the quiet machine first, as a deployment would.
"""

from __future__ import annotations

import io
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK, machine_speed, quick, result
from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    ModelIdentity,
    PlanAction,
    Request,
    StateGroup,
    TokenizerIdentity,
    configure_logging,
)

RESULTS = ("load.e2e_nexuskv_over_always", "load.first_plan_fallbacks")
SIZES = quick((1024, 4096, 9000, 32768), (256, 1024))
ROUNDS = quick(150, 4)
FRESH = quick(8, 2)
E2E_ROUNDS = quick(4, 1)  # 4 x 27 shared-phase requests: a 54-request mean moved by 5% run to run
SECRET = bytes(range(32))
ROOT = Path(__file__).resolve().parents[1]
LAYOUT = Layout(groups=[StateGroup(kind="dense", layers=4, kv_heads=2, head_dim=64)], page_size=16)
HOG = r"""
import multiprocessing, sys
def spin():
    while True:
        pass
if __name__ == "__main__":
    workers = [multiprocessing.Process(target=spin, daemon=True) for _ in range(int(sys.argv[1]))]
    for w in workers:
        w.start()
    sys.stdin.read()  # until the bench closes it
"""
FIXED_1MS = {"deadline_ms": 1.0, "deadline_cap_ms": 1.0}  # 1 ms whatever the stakes (stretched by load, as all are)


class Hog:
    """Another process keeping every core busy while the block runs."""

    def __enter__(self) -> Hog:
        self.proc = subprocess.Popen([sys.executable, "-c", HOG, str(os.cpu_count() or 2)], stdin=subprocess.PIPE)
        time.sleep(0.5)  # its workers are spinning before the first measured call
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.communicate(b"", timeout=30)


def request(n: int, rid: str, tenant: str = "chat", extra: int = 0) -> Request:
    rng = random.Random(n)
    tokens = [rng.randrange(3, 32000) for _ in range(n)] + list(range(extra))
    return Request(request_id=rid, tenant=tenant, model=ModelIdentity(name="tiny-llama", revision="1"),
                   tokenizer=TokenizerIdentity(name="tiny-bpe"), layout=LAYOUT, token_ids=tokens)  # fmt: skip


def plans(budget: dict[str, float], load: bool) -> dict[str, float]:
    """Section 1 for one budget rule: plan every size's follow-ups ROUNDS times; gains, fallbacks, plan times."""
    cfg = KernelConfig(node="n1", policies=str(ROOT / "policies"),
                       tiers={"dram": {"store": "dram", "capacity_bytes": "2GiB"}}, **budget)  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        for n in SIZES:
            req = request(n, f"seed-{n}")
            k.commit(req, [bytes(256)] * len(k.keys(req)))
        assert k.flush(120)
        reused_gain, fell, times, budgets = 0.0, 0, [], {}
        ctx = Hog() if load else None
        if ctx:
            ctx.__enter__()
        try:
            for r in range(ROUNDS):
                for n, follow in ((n, request(n, f"f{r}-{n}", extra=1 + r % 7)) for n in SIZES):
                    t0 = time.perf_counter()
                    plan = k.plan(follow)
                    took = (time.perf_counter() - t0) * 1e3
                    if plan.reasons and plan.reasons[0].startswith("fail-open"):
                        fell += 1
                        continue
                    budgets[n] = plan.reasons[0]
                    times.append(took)
                    if plan.action is PlanAction.MATERIALIZE:
                        reused_gain += plan.predicted.gain_ms
        finally:
            if ctx:
                ctx.__exit__()
        assert k.reads.lost.drain(120)
        lost = sum(row["lost_gain_ms"] for row in k.reads.lost.snapshot().values())
        unjudged = sum(row["unjudged"] for row in k.reads.lost.snapshot().values())
    times.sort()
    total = reused_gain + lost
    return {"fraction": lost / total if total else 0.0, "lost_ms": lost, "gain_ms": reused_gain, "fell": fell,
            "unjudged": unjudged, "p50": times[len(times) // 2] if times else 0.0,
            "p99": times[int(0.99 * (len(times) - 1))] if times else 0.0, "budgets": budgets}  # fmt: skip


def first_plans(load: bool) -> tuple[int, list[float]]:
    """Section 2: fresh kernels over a disk tier an earlier kernel filled; (fallbacks, first plans' ms)."""
    fell, took = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        tiers = {"disk": {"store": "disk", "path": tmp, "capacity_bytes": "1GiB"}}
        req = request(4096, "seed")
        with Kernel(KernelConfig(node="n1", tiers=tiers), secret=SECRET) as k:
            keys = k.keys(req)
            for start in range(0, len(keys), 32):  # in steps the disk tier's write queue takes whole
                k.commit(req, {(b, 0): bytes(256) for b in range(start, min(start + 32, len(keys)))}, keys=keys)
                assert k.flush(60)
        ctx = Hog() if load else None
        if ctx:
            ctx.__enter__()
        try:
            for i in range(FRESH):
                follow = request(4096, f"first-{i}", extra=3)
                with Kernel(KernelConfig(node="n1", tiers=tiers), secret=SECRET) as k:
                    t0 = time.perf_counter()
                    plan = k.plan(follow)
                    took.append((time.perf_counter() - t0) * 1e3)
                    if plan.reasons[0].startswith("fail-open"):
                        fell += 1
                        print(f"    first plan of kernel {i} fell back: {plan.reasons[0]}")
                    elif plan.tokens_reused == 0:
                        print(f"    first plan of kernel {i} reused nothing: {plan.reasons}")
        finally:
            if ctx:
                ctx.__exit__()
    return fell, took


def e2e() -> float:
    """Section 3: NexusKV over always-reuse, mean TTFT on the shared phases, under the hog."""
    import torch

    from nexuskv_transformers.calibrate import calibrate, measurable, save
    from nexuskv_transformers.connector import TransformersConnector
    from nexuskv_transformers.demo import RunResult, demo_config, run_workload
    from nexuskv_transformers.models import build_model
    from nexuskv_transformers.workload import SHARED_PHASES, demo_workload

    torch.set_grad_enabled(False)
    model = build_model("dense", size=quick("demo", "test"))
    small = {"lengths": ((32, 64, 128, 192), (48, 96)), "repeats": 1, "blocks": (1, 4)}
    with measurable(demo_config(None)) as cfg, Kernel(cfg, secret=SECRET) as k:  # calibrated on the quiet machine
        report = calibrate(TransformersConnector(k, model), quick=not QUICK, command="bench/load.py",
                           **(small if QUICK else {}))  # fmt: skip
    print(f"  calibrated on the quiet machine: held-out error {report.heldout_error_pct:.1f}%")
    with tempfile.TemporaryDirectory() as tmp:
        profile = str(Path(tmp) / "profile.json")
        save(report, profile)
        shapes = {"sessions": 1, "turns": 2, "docs": 1, "queries": 2, "agent_steps": 2, "unique": 1}
        merged: RunResult | None = None
        with Hog():
            for r in range(E2E_ROUNDS):
                workload = [it for it in demo_workload(seed=r, **(shapes if QUICK else {}))
                            if it.phase in SHARED_PHASES]  # fmt: skip
                got = run_workload(model, profile, workload)
                merged = got if merged is None else merged.absorb(got)
    assert merged is not None
    ratio = merged.ratio("nexuskv", SHARED_PHASES, base="always")
    fell = sum(1 for o in merged.outcomes["nexuskv"] if o.plan and o.plan.reasons[0].startswith("fail-open"))
    same = sum(1 for a, b in zip(merged.outcomes["nexuskv"], merged.outcomes["always"], strict=True)
               if a.tokens_recomputed == b.tokens_recomputed)  # fmt: skip
    for mode in ("nexuskv", "always"):  # where each strategy's time goes (means over the same requests, ms)
        outs = merged.outcomes[mode]
        parts = {p: statistics.fmean(o.timings.get(f"{p}_s", 0.0) for o in outs) * 1e3 for p in ("plan", "restore",
                                                                                                  "prefill")}
        print(f"  {mode:8s} by part: plan {parts['plan']:.2f} ms, restore {parts['restore']:.2f} ms, prefill of the "
              f"rest {parts['prefill']:.2f} ms, the rest of TTFT "
              f"{statistics.fmean(o.ttft_s for o in outs) * 1e3 - sum(parts.values()):.2f} ms")  # fmt: skip
    print(f"  {len(merged.items)} requests: NexusKV mean TTFT {merged.mean_ttft('nexuskv', SHARED_PHASES):.1f} ms, "
          f"always-reuse {merged.mean_ttft('always', SHARED_PHASES):.1f} ms, never-reuse "
          f"{merged.mean_ttft('never', SHARED_PHASES):.1f} ms; NexusKV fell back {fell} times; both prefilled "
          f"the same tokens on {same} of {len(merged.items)} requests")  # fmt: skip
    return ratio


def main() -> None:
    configure_logging(json=True, stream=io.StringIO(), force=True)  # rendered, then dropped
    print(machine_speed())
    cores = os.cpu_count() or 2
    print(f"\n1. plans of {', '.join(f'{n // 1024}k' if n >= 1024 else str(n) for n in SIZES)}-token follow-ups, "
          f"{ROUNDS} rounds; hog: {cores} spinning processes")  # fmt: skip
    got = {}
    for name, budget in (("sized by the stakes", {}), ("fixed 1 ms", FIXED_1MS)):
        for load in (False, True):
            g = got[(name, load)] = plans(budget, load)
            print(f"  {name:20s} {'under the hog' if load else 'quiet':14s}: fallbacks {g['fell']:4d}, lost "
                  f"{g['lost_ms']:9.1f} of {g['lost_ms'] + g['gain_ms']:10.1f} ms of gain "
                  f"({100 * g['fraction']:.3f}%, {g['unjudged']} unjudged); plan p50 {g['p50']:.2f} p99 "
                  f"{g['p99']:.2f} ms")  # fmt: skip
    for n, reason in sorted(got[("sized by the stakes", False)]["budgets"].items()):
        print(f"    {n:6d} tokens: {reason}")
    print(f"\n2. first plans of {FRESH} fresh kernels over a filled disk tier (4k-token follow-up)")
    fell_q, took_q = first_plans(False)
    fell_h, took_h = first_plans(True)
    print(f"  quiet: {fell_q} fell back, first plan {statistics.median(took_q):.2f} ms median, max {max(took_q):.2f}")
    print(f"  under the hog: {fell_h} fell back, first plan {statistics.median(took_h):.2f} ms median, max "
          f"{max(took_h):.2f}")  # fmt: skip
    print("\n3. the reference engine, shared phases, NexusKV vs always-reuse under the hog")
    ratio = e2e()
    hog = got[("sized by the stakes", True)]
    print(f"lost gain under the hog, budget sized by the stakes: {hog['fraction']:.4f} of the gain at stake "
          f"({hog['fell']} fallbacks; computed from the kernel's own predicted gains, not from measured times)")
    result("load.e2e_nexuskv_over_always", ratio, "<=", 1.0)
    result("load.first_plan_fallbacks", fell_h, "<=", 0)


if __name__ == "__main__":
    main()
