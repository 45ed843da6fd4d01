"""The connector's counters in vLLM's own logging and `/metrics`.

Every step each worker rank returns the counters it moved since the last step (`NexusKVStats`: loads, blocks and
bytes loaded, blocks that failed, asynchronous loads and those given up, blocks and bytes saved, saves the writer
refused) and the scheduler side adds its own (plans, plans that reuse, tokens planned, plan fallbacks). vLLM sums
them over ranks and over its logging interval (`aggregate`), logs them (`reduce`), and hands them to
`NexusKVPromMetrics.observe`, which adds them to `vllm:nexuskv_<counter>_total` counters with vLLM's per-engine
labels: they appear in `vllm serve`'s `/metrics` beside vLLM's own series. Counters summed over ranks count a block
once per rank that moved its shard (bytes likewise), which is what each rank's work was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["COUNTERS", "NexusKVPromMetrics", "NexusKVStats"]

COUNTERS = {
    "loads": "Synchronous loads started (one per request and step).",
    "loads_async": "Asynchronous loads started.",
    "loads_timed_out": "Asynchronous loads given up past the load timeout (their blocks recomputed).",
    "blocks_loaded": "Blocks mounted into vLLM's KV cache from NexusKV's tiers (per rank).",
    "blocks_failed": "Planned blocks that failed to load and were recomputed (per rank).",
    "bytes_loaded": "Payload bytes loaded (per rank).",
    "blocks_saved": "Blocks handed to NexusKV's writer (per rank).",
    "saves_refused": "Blocks the writer's bounds refused (per rank).",
    "bytes_saved": "Payload bytes handed to the writer (per rank).",
    "plans": "Plans made for requests with a tenant.",
    "pd_grants_issued": "P/D: grants a prefill engine (kv_producer) returned for finished requests.",
    "pd_grants_accepted": "P/D: grants a decode engine (kv_consumer) accepted (checked against the request's keys).",
    "pd_grants_refused": "P/D: grants a decode engine refused (changed, forged, expired, another request's).",
    "pd_transfers": "P/D: granted requests whose plan fetches the producer's blocks.",
    "pd_recomputes": "P/D: granted requests whose plan recomputes instead.",
    "plans_reuse": "Plans that load state.",
    "tokens_planned": "Tokens plans chose to load.",
    "plan_fallbacks": "Plans that failed open to recompute (deadline, plugin error, breaker).",
}


@dataclass
class NexusKVStats(KVConnectorStats):
    """Counter deltas: `data` maps a name of `COUNTERS` to how much it moved."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> NexusKVStats:
        merged = dict(self.data)
        for k, v in (other.data or {}).items():
            if k in COUNTERS and isinstance(v, int | float):
                merged[k] = merged.get(k, 0) + v
        return NexusKVStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if k in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class NexusKVPromMetrics(KVConnectorPromMetrics):
    """One `vllm:nexuskv_<name>_total` counter per `COUNTERS` entry, labelled like vLLM's own series."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"vllm:nexuskv_{name}", documentation=doc,
                                                  labelnames=labelnames)
                          for name, doc in COUNTERS.items()}  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is not None and isinstance(value, int | float) and value > 0:
                counter.labels(*labels).inc(value)
