"""What the decision log and the metrics cost: one decision record per setting, and one scrape.

Run: `.venv/bin/python bench/decision_log.py` (about 20 seconds). Lines are rendered as JSON into a memory stream,
as in production (JSON on a pipe). Figures are medians of 5 runs of 20,000 records (microseconds per record) for
`decision_log_sample` 1.0, 0.01 and `decision_log_level = "off"` (the per-plan counts and the ring are kept in
every case), then the median wall time of a `/metrics` exposition (`generate_latest`) and of a `/status`
document of a kernel with two tiers after a small workload. docs/operations.md quotes them.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from _common import quick
from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    ModelIdentity,
    Plan,
    PlanAction,
    PluginManager,
    Predicted,
    Request,
    StateGroup,
    TokenizerIdentity,
    configure_logging,
)

RESULTS = ()  # figures for docs/operations.md, no goal
ROOT = Path(__file__).resolve().parents[1]
RUNS, RECORDS, REQUESTS, SCRAPES = quick((5, 20_000, 50, 200), (2, 200, 6, 3))


def per_record(log: Any, plan: Plan, n: int = RECORDS) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        log.record(plan, t0)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    configure_logging(json=True, stream=io.StringIO(), force=True)
    pm = PluginManager(entry_points=False)
    plan = Plan(decision_id="d", request_id="r", tenant="chat", action=PlanAction.MATERIALIZE, tokens_total=4096,
                tokens_reused=4000, predicted=Predicted(ttft_ms=1.0), rules=("hot-in-dram",),
                reasons=("match: 250 of 256 blocks reusable (dram 250)", "reuse 4000 tokens: saves 1 ms"))  # fmt: skip
    settings = {"sample 1.0": {}, "sample 0.01": {"decision_log_sample": 0.01},
                "level off": {"decision_log_level": "off"}}  # fmt: skip
    runs: dict[str, list[float]] = {k: [] for k in settings}
    # one kernel per setting, with no tiers' work to do: its decision log is what each record goes through
    kernels = {name: Kernel(KernelConfig(node="bench", **kw), plugins=pm, secret=bytes(32))
               for name, kw in settings.items()}  # fmt: skip
    for _ in range(RUNS):
        for name, k in kernels.items():
            runs[name].append(per_record(k.decision_log, plan))
    for k in kernels.values():
        k.close()
    for name, got in runs.items():
        print(f"record, {name:12s}: {statistics.median(got):7.2f} us (runs {', '.join(f'{x:.2f}' for x in got)})")

    layout = Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16)
    cfg = KernelConfig(node="bench", policies=str(ROOT / "policies"), deadline_ms=1000.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"},
                              "disk": {"store": "dram", "capacity_bytes": "16MiB"}})  # fmt: skip
    with Kernel(cfg, secret=bytes(32)) as k:
        for i in range(REQUESTS):
            req = Request(request_id=f"r{i}", tenant=("chat", "rag", "strict")[i % 3], layout=layout,
                          model=ModelIdentity(name="m", revision="1"), tokenizer=TokenizerIdentity(name="t"),
                          token_ids=list(range(i % 5 * 1000, i % 5 * 1000 + 512)))  # fmt: skip
            keys = k.keys(req)
            plan = k.plan(req, keys=keys)
            if plan.tokens_reused:
                k.materialize(plan, req, keys=keys)
            k.commit(req, [bytes(2048)] * len(keys), keys=keys)
            k.flush(10)
        scrape, status = [], []
        for _ in range(SCRAPES):
            t0 = time.perf_counter()
            generate_latest(k.metrics.registry)
            t1 = time.perf_counter()
            k.metrics.status(20)
            status.append(time.perf_counter() - t1)
            scrape.append(t1 - t0)
    print(f"/metrics exposition: {statistics.median(scrape) * 1e3:.3f} ms; /status document: "
          f"{statistics.median(status) * 1e3:.3f} ms (medians of {SCRAPES})")


if __name__ == "__main__":
    sys.exit(main())
