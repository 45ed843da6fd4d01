"""Replay a Mooncake-format trace: NexusKV's cost-based plans against never-reuse and always-reuse.

Then the same with congested disk and Redis links, then cost-aware eviction against LRU; all simulated TTFT
from one profile.

Run: `.venv/bin/python bench/replay.py ../shared/traces/mooncake_synthetic_trace.jsonl [--limit N]`
(a few minutes for the whole trace). Tiers hold 2,000 / 20,000 / 100,000 blocks of 512 tokens (DRAM, disk,
Redis); congestion scales disk and Redis bandwidth to 5%. The profile is `profiles/replay-llama-8b-gpu.json`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result
from nexuskv.logs import configure_logging
from nexuskv.replay import read_trace, replay, summary

ROOT = Path(__file__).resolve().parents[1]
PROFILE = str(ROOT / "profiles" / "replay-llama-8b-gpu.json")
TIERS = {"dram": 2000, "disk": 20000, "redis": 100000}
CONGESTED = {"disk": 0.05, "redis": 0.05}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    configure_logging(level="warning", force=True)
    records = list(itertools.islice(read_trace(args.trace), args.limit))
    print(f"{len(records)} requests from {args.trace}; tiers (blocks) {TIERS}; profile {Path(PROFILE).name}")
    ratios = {}
    for label, scale in (("normal links", {}), ("congested disk and redis (5% bandwidth)", CONGESTED)):
        t0 = time.perf_counter()
        res = replay(records, profile_path=PROFILE, tier_blocks=TIERS, bandwidth_scale=scale)
        best = min(res["never"].mean_ttft_ms, res["always"].mean_ttft_ms)
        ratios[label] = res["nexuskv"].mean_ttft_ms / best
        print(f"\n== {label} ({time.perf_counter() - t0:.0f} s)\n{summary(res)}")
        print(f"NexusKV mean TTFT / best baseline: {ratios[label]:.4f}")
    small = {"dram": 500, "disk": 3000, "redis": 10000}
    ev = {}
    for eviction in ("cost", "lru"):
        r = replay(records, profile_path=PROFILE, tier_blocks=small, strategies=("nexuskv",), eviction=eviction)
        ev[eviction] = r["nexuskv"]
    print(f"\n== eviction under pressure (tiers {small}): NexusKV plans, cost-aware vs LRU eviction")
    for k, r in ev.items():
        print(f"{k:<5} hit ratio {r.hit_ratio:.3f}  mean TTFT {r.mean_ttft_ms:.1f} ms  p90 {r.p90_ttft_ms:.1f} ms")
    result("replay.nexuskv_over_best_baseline", ratios["normal links"], "<=", 1.0)
    result("replay.nexuskv_over_best_baseline_congested", ratios["congested disk and redis (5% bandwidth)"], "<", 1.0)
    result("replay.cost_eviction_over_lru_ttft", ev["cost"].mean_ttft_ms / ev["lru"].mean_ttft_ms, "<=", 1.0)


if __name__ == "__main__":
    main()
