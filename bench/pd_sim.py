"""Prefill/decode disaggregation on the cluster simulator: aggregated, always-transfer and NexusKV's handoff.

Run: `.venv/bin/python bench/pd_sim.py ../shared/traces/mooncake_synthetic_trace.jsonl` (a few minutes here).

The strategies (`nexuskv_sim.pd_routers`, the model in plugins/nexuskv-sim/README.md, "P/D disaggregation"):

- `aggregated`: no disaggregation, every request whole on the least-loaded node of all of them (the baseline);
- `always-transfer`: the published disaggregated routers' rule (vLLM's disaggregated proxy, Dynamo, llm-d P/D),
  re-implemented in the simulator: least-loaded prefill node, then always send the KV to the least-loaded decode
  node;
- `nexuskv`: `Kernel.route` for the prefill node, then at the handoff the decode node and transfer versus recompute
  by `Kernel.route` over the decode pool, on the delayed view and the link estimates it measured from past
  transfers (it never reads the simulator's profile);
- `nexuskv-handoff` (a diagnostic, no goal): always-transfer's prefill side with NexusKV's handoff, to tell what
  the handoff decision gains apart from what the prefill routing gains.

Each split (prefill + decode nodes; aggregated uses the same nodes) runs on normal links and congested ones (NIC
and disk at 5% of their bandwidth: the profile's `[congested]` factors, as `bench/cluster_sim.py` and `nexuskv
simulate --congested` define it). The RESULT lines come from the first split (default 6 prefill + 2 decode: the
trace is prefill-heavy, 15k prompt tokens for 150 output tokens on average, and a 4-node cluster cannot keep up
with it even aggregated); the second (2 + 2, the smallest split) is printed for comparison.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import QUICK, quick, result
from nexuskv import configure_logging
from nexuskv_sim.pd import pd_summary, simulate_pd
from nexuskv_sim.trace import generate, read_trace, write_trace

RESULTS = ("sim.pd_nexuskv_mean_ttft_over_always_transfer_congested", "sim.pd_nexuskv_mean_ttft_over_always_transfer")
TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl")
STRATEGIES = ("aggregated", "always-transfer", "nexuskv", "nexuskv-handoff")


def split(text: str) -> tuple[int, int]:
    """"6+2" -> (6, 2)."""
    p, d = text.split("+")
    return int(p), int(d)


def run(records: list, prefill: int, decode: int, congested: bool) -> dict:
    links = "congested links (NIC and disk at 5%)" if congested else "normal links"
    t0 = time.perf_counter()
    res = simulate_pd(records, STRATEGIES, prefill=prefill, decode=decode, congested=congested)
    print(f"\n== {prefill} prefill + {decode} decode nodes (aggregated: the same {prefill + decode}), {links}, "
          f"{len(records)} requests ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print(pd_summary(res))
    base = res["always-transfer"].mean_ttft_ms
    for name in ("nexuskv", "nexuskv-handoff", "aggregated"):
        print(f"{name} / always-transfer, mean TTFT: {res[name].mean_ttft_ms / base:.3f}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=TRACE)
    ap.add_argument("--limit", type=int, default=quick(None, 300), help="Only the first N requests.")
    ap.add_argument("--splits", default=quick("6+2,2+2", "6+2"),
                    help="Prefill+decode node counts, comma separated; the first gives the RESULT lines.")
    args = ap.parse_args()
    tmp = None
    if QUICK and not Path(args.trace).exists():  # quick mode anywhere: a small synthetic trace stands in
        tmp = Path(tempfile.mkdtemp(prefix="nexuskv-pd-sim-"))
        args.trace = str(tmp / "trace.jsonl")
        write_trace(generate(args.limit, seed=1), args.trace)
    configure_logging(level="warning", force=True)
    records = list(itertools.islice(read_trace(args.trace), args.limit))
    print(f"{len(records)} requests from {args.trace}")
    ratios = {}
    for i, text in enumerate(args.splits.split(",")):
        prefill, decode = split(text)
        for congested in (False, True):
            res = run(records, prefill, decode, congested)
            if i == 0:
                ratios[congested] = res["nexuskv"].mean_ttft_ms / res["always-transfer"].mean_ttft_ms
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    first = args.splits.split(",")[0]
    print(f"\nRESULTs from the {first} split: NexusKV / always-transfer, mean TTFT: normal {ratios[False]:.3f}, "
          f"congested {ratios[True]:.3f}")  # fmt: skip
    result("sim.pd_nexuskv_mean_ttft_over_always_transfer_congested", ratios[True], "<=", 0.9)
    result("sim.pd_nexuskv_mean_ttft_over_always_transfer", ratios[False], "<=", 1.0)


if __name__ == "__main__":
    main()
