"""The routers at fleet size on the cluster simulator: 8, 64, 256 and 1,024 nodes, NexusKV with its real routing code.

Run: `.venv/bin/python bench/fleet_sim.py ../shared/traces/mooncake_synthetic_trace.jsonl` (about 50 minutes here).

The shared trace is sized for 8 nodes. For N nodes it is scaled by N / 8 (`nexuskv_sim.trace.scale`): every record
copied N / 8 times, each copy with its own tenant and its own hash ids, so the request mix, each session's reuse
and the load per node stay those of the 8-node run while tenants, sessions and the arrival rate grow with the
fleet. The whole trace runs at 8, 64 and 256 nodes; at 1,024 only its first `WINDOW_S` seconds (printed), so a
run stays within the hour: the first minute of the trace reuses less than the whole (its sessions come back
later), so that size is not compared with the whole-trace ones.

`--only N` runs one size (`--only 256`: about 20 minutes); `--whole` runs the whole trace at every size run.

Quick mode (`NEXUSKV_BENCH_QUICK=1`) runs fleets of 8 and 16 nodes on a small generated trace. The RESULT names keep
the full run's sizes (`..._64`, `..._256`: tests/test_benches.py checks the names), so the line before each says
which fleet its figure comes from (there, the 16-node one for both), and every table is headed by its real size.

The routers other than NexusKV are the simulator's re-implementations of the published policies
(plugins/nexuskv-sim/README.md, "Baselines"), not the routers themselves.

Per size and router: mean, p50 and p99 TTFT, reused tokens, and the median host time of one routing decision
(the strategy's whole `decide`, NexusKV's including the simulator glue that builds its node reports and feeds
its index; the median, so a strategy's one-time set-up, NexusKV's calibration in its first decision, does not
count). NexusKV routes with `Kernel.route` (one pass over the fleet, `nexuskv.planning.fleet`) on simulated
time: the same trace gives the same figures on any host (plugins/nexuskv-sim/tests/test_sim_nexus.py).
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK, quick, result
from nexuskv import configure_logging
from nexuskv_sim.simulate import simulate
from nexuskv_sim.trace import generate, read_trace, scale

RESULTS = ("sim.fleet_nexuskv_mean_ttft_over_best_64", "sim.fleet_nexuskv_mean_ttft_over_best_256",
           "sim.fleet_route_host_time_over_slowest_baseline")  # fmt: skip
BASELINES = ("never", "round-robin", "sglang", "dynamo", "llm-d", "mooncake")
SIZES = quick((8, 64, 256, 1024), (8, 16))
WINDOW_S = quick({8: 1100.0, 64: 1100.0, 256: 1100.0, 1024: 60.0}, {8: 60.0, 16: 60.0})  # 1,100 s: the whole trace


def run(records: list, nodes: int) -> dict[str, dict[str, float]]:
    scaled = scale([r for r in records if r.timestamp < WINDOW_S[nodes] * 1e3], max(1, nodes // 8))
    t = time.perf_counter()
    results = simulate(scaled, [*BASELINES, "nexuskv"], nodes=nodes)
    out = {}
    for name, r in results.items():
        out[name] = {"mean": r.mean_ttft_ms, "p50": r.p50_ttft_ms, "p99": r.p99_ttft_ms,
                     "reuse": r.reused_tokens / max(1, r.input_tokens),
                     "decide_ms": r.decide_p50_ms, "completed": r.completed}  # fmt: skip
    window = "the whole trace" if WINDOW_S[nodes] >= 1e9 else f"the first {WINDOW_S[nodes]:g} s"
    print(f"\n{nodes} nodes: {len(scaled)} requests ({window} x {max(1, nodes // 8)} copies), "
          f"{time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip
    print(f"{'router':>12} {'mean ms':>9} {'p50 ms':>8} {'p99 ms':>9} {'reuse':>6} {'host ms/decision p50':>21}")
    for name, f in out.items():
        print(f"{name:>12} {f['mean']:9.1f} {f['p50']:8.1f} {f['p99']:9.1f} {f['reuse']:6.3f} {f['decide_ms']:21.3f}",
              flush=True)  # fmt: skip
    best = min(BASELINES, key=lambda b: out[b]["mean"])
    slowest = max(BASELINES, key=lambda b: out[b]["decide_ms"])
    print(f"nexuskv / best other ({best}) mean TTFT: {out['nexuskv']['mean'] / out[best]['mean']:.3f}; "
          f"host time / slowest baseline ({slowest}): {out['nexuskv']['decide_ms'] / out[slowest]['decide_ms']:.2f}")
    out["_"] = {"over_best": out["nexuskv"]["mean"] / out[best]["mean"],
                "host_over_slowest": out["nexuskv"]["decide_ms"] / out[slowest]["decide_ms"]}
    return out


def main() -> None:
    """`fleet_sim.py [TRACE] [--only N] [--whole]`: `--only` runs one size, `--whole` the whole trace at every size."""
    configure_logging(json=True, stream=io.StringIO(), force=True)
    args = sys.argv[1:]
    sizes = SIZES
    if "--only" in args:
        at = args.index("--only")
        sizes = (int(args[at + 1]),)
        del args[at : at + 2]
    if "--whole" in args:
        args.remove("--whole")
        for n in sizes:
            WINDOW_S[n] = 1e9
    path = args[0] if args else None
    records = list(read_trace(path)) if path else list(generate(quick(4000, 300), seed=3, rate_per_s=4.0))
    print(f"fleets of {', '.join(map(str, sizes))} nodes"
          f"{' (quick mode: the full run has 8, 64, 256 and 1,024)' if QUICK else ''}", flush=True)  # fmt: skip
    got = {n: run(records, n) for n in sizes}
    big = [n for n in sizes if n >= 64] or list(sizes)
    print()
    for n in (64, 256):
        if n in got or sizes == SIZES:
            ran = n if n in got else sizes[-1]
            where = f"{ran} nodes"
            if ran != n:
                where += f" (quick mode: no {n}-node fleet ran; the name is the full run's)"
            print(f"sim.fleet_nexuskv_mean_ttft_over_best_{n}, the next RESULT: NexusKV / best other at {where}")
            result(f"sim.fleet_nexuskv_mean_ttft_over_best_{n}", got[ran]["_"]["over_best"], "<=", 0.95)
    print("sim.fleet_route_host_time_over_slowest_baseline, the next RESULT: the largest at "
          f"{', '.join(map(str, big))} nodes")  # fmt: skip
    result("sim.fleet_route_host_time_over_slowest_baseline", max(got[n]["_"]["host_over_slowest"] for n in big),
           "<=", 2.0)  # fmt: skip
    if sizes != SIZES:
        print(f"(one size: --only {sizes[0]}{' --whole' if WINDOW_S[sizes[0]] >= 1e9 else ''})")


if __name__ == "__main__":
    main()
