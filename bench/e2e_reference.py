"""End to end on the real CPU engine: NexusKV vs never-reuse vs always-reuse, measured TTFT, the demo's workload.

Calibrates the demo model on this machine first (the profile NexusKV plans with; held-out error is a RESULT),
then serves the demo workload `--rounds` times (a new seed each round) under the three strategies side by side,
every request by all three in rotating order, each strategy with its own kernel and the same tiers: DRAM and a
remote tier behind an emulated 10 MB/s link. Ratios are mean measured TTFT over never-reuse's on the same requests.

Run: `.venv/bin/python bench/e2e_reference.py [--rounds 4] [--plot docs/img/calibration-dense.png]`
(about 2 minutes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch

from _common import QUICK, machine_speed, quick, result
from nexuskv import Kernel, configure_logging
from nexuskv_transformers.calibrate import calibrate, measurable, plot, save
from nexuskv_transformers.connector import TransformersConnector
from nexuskv_transformers.demo import SECRET, RunResult, demo_config, run_workload
from nexuskv_transformers.models import build_model
from nexuskv_transformers.workload import SHARED_PHASES, demo_workload

RESULTS = ("e2e.shared_nexuskv_over_never", "e2e.shared_nexuskv_over_always", "e2e.unique_nexuskv_over_never",
           "e2e.slowlink_nexuskv_over_never", "calibrate.heldout_error_pct")
# quick mode: a calibration of a few short prompts, measured once; every phase of the workload at its smallest
SMALL_CALIBRATION = {"lengths": ((32, 64, 128, 192), (48, 96)), "repeats": 1, "blocks": (1, 4)}
SMALL_WORKLOAD = {"sessions": 1, "turns": 2, "docs": 1, "queries": 2, "agent_steps": 2, "unique": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=quick(4, 1))
    ap.add_argument("--quick-calibration", action="store_true")
    ap.add_argument("--plot", default="", help="also write the calibration plot (PNG) here")
    ap.add_argument("--profile-out", default="", help="also write the fitted profile (JSON) here")
    args = ap.parse_args()
    configure_logging(level="warning", force=True)
    torch.set_grad_enabled(False)
    print(machine_speed())
    model = build_model("dense", size=quick("demo", "test"))  # quick mode: the unit tests' smaller model
    print(f"model {model.identity.name}: {model.kv_bytes_per_token()} bytes of KV per token, "
          f"{torch.get_num_threads()} torch threads")  # fmt: skip
    with measurable(demo_config(None)) as cfg, Kernel(cfg, secret=SECRET) as k:  # the remote tier is what it measures
        report = calibrate(TransformersConnector(k, model), quick=args.quick_calibration,
                           command="bench/e2e_reference.py", **(SMALL_CALIBRATION if QUICK else {}))  # fmt: skip
    print(report.summary())
    if args.plot:
        print(f"plot: {plot(report, args.plot)}")
    with tempfile.TemporaryDirectory() as tmp:
        profile = args.profile_out or str(Path(tmp) / "profile.json")
        save(report, profile)
        merged: RunResult | None = None
        for r in range(args.rounds):
            got = run_workload(model, profile, demo_workload(seed=r, **(SMALL_WORKLOAD if QUICK else {})))
            merged = got if merged is None else merged.absorb(got)
    assert merged is not None
    print(merged.table())
    for m in ("nexuskv", "always"):
        print(f"answers {m}: argmax equal to never-reuse on every request: {merged.argmax_equal[m]}, "
              f"max |logit diff| {merged.max_logit_diff[m]:.1e}")  # fmt: skip
    shared = [(it, o) for it, o in zip(merged.items, merged.outcomes["nexuskv"], strict=True)
              if it.phase in SHARED_PHASES]  # fmt: skip
    never = merged.mean_ttft("never", SHARED_PHASES)
    parts = {part: sum(o.timings.get(f"{part}_s", 0.0) for _, o in shared) / len(shared) * 1e3
             for part in ("plan", "restore", "prefill")}  # fmt: skip
    print(f"shared phases, NexusKV's mean TTFT by part: plan {parts['plan']:.2f} ms, restore {parts['restore']:.2f} "
          f"ms, prefill of the rest {parts['prefill']:.2f} ms; the rest's prefill alone is "
          f"{parts['prefill'] / never:.3f} of never-reuse's TTFT (the floor of the ratio on this workload)")
    print(f"slow link: always-reuse over never-reuse {merged.ratio('always', ('slowlink',)):.3f} (two baselines; the "
          "link is built slower than recomputing, so this only shows the link is slow, not a result)")
    result("e2e.shared_nexuskv_over_never", merged.ratio("nexuskv", SHARED_PHASES), "<=", 0.36)
    result("e2e.shared_nexuskv_over_always", merged.ratio("nexuskv", SHARED_PHASES, base="always"), "<=", 1.0)
    result("e2e.unique_nexuskv_over_never", merged.ratio("nexuskv", ("unique",)), "<=", 1.05)
    result("e2e.slowlink_nexuskv_over_never", merged.ratio("nexuskv", ("slowlink",)), "<=", 1.05)
    result("calibrate.heldout_error_pct", report.heldout_error_pct, "<=", 15)


if __name__ == "__main__":
    main()
