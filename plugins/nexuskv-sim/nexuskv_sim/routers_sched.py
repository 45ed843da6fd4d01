"""Baseline schedulers, re-implemented here from their published algorithms: llm-d's scheduler, Mooncake's Conductor.

This is the project's own code for the simulator, not the schedulers' (README, "Baselines").

Also the registry of built-in strategies (`STRATEGIES`, `make_strategy`).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable

from nexuskv_sim.api import BaseStrategy, ClusterView, Decision, Fetch, SimRequest, Strategy
from nexuskv_sim.profile import ModelProfile, Profile, default_profile
from nexuskv_sim.reuse import ApproxPrefixIndex, RecentRoutes, always_reuse, tier_prefixes
from nexuskv_sim.routers import DynamoKV, NeverReuse, RoundRobin, SGLangCacheAware

__all__ = ["STRATEGIES", "LlmdScheduler", "MooncakeConductor", "PrefillTable", "make_strategy"]


class LlmdScheduler(BaseStrategy):
    """llm-d inference scheduler, its default scheduling profile: weighted scorers, then max-score-picker.

    Scorers (kubernetes-sigs/gateway-api-inference-extension, pkg/epp/scheduling/framework/plugins/):
    - `prefix-cache-scorer` (multi/prefix/plugin.go), weight 3: matched / considered prefix blocks on the
      worker, from an LRU index of what the scheduler routed there (`lruCapacityPerServer` 31250 blocks of 16
      tokens = 500k tokens), hashing at most `maxPrefixBlocksToMatch` 256 x 16 = 4096 prompt tokens;
    - `kv-cache-utilization-scorer` (scorer/kvcache_utilization.go), weight 2: 1 - KV cache usage;
    - `queue-scorer` (scorer/queue.go), weight 2: (max - queue) / (max - min) of waiting requests, 1 when equal.
    Weights as in llm-d's deployed default profile (llm-d/llm-d-inference-scheduler, deploy/config: prefix 3,
    kv-cache 2, queue 2). The picker takes the highest total, ties at random. KV usage and queue come from the
    delayed load reports (llm-d scrapes them from vLLM metrics).
    """

    name = "llm-d"

    def __init__(self, prefix_weight: float = 3.0, kv_cache_weight: float = 2.0, queue_weight: float = 2.0,
                 max_prefix_tokens: int = 4096, lru_capacity_tokens: int = 31250 * 16, block_tokens: int = 512,
                 seed: int = 0) -> None:  # fmt: skip
        self.weights = (prefix_weight, kv_cache_weight, queue_weight)
        self.max_prefix_blocks = max(1, max_prefix_tokens // block_tokens)
        self._index = ApproxPrefixIndex(max(1, lru_capacity_tokens // block_tokens))
        self._rng = random.Random(seed)

    def scores(self, req: SimRequest, view: ClusterView) -> dict[str, float]:
        """The weighted score of every worker serving the request's model."""
        workers = view.nodes_for(req.model)
        loads = view.loads()
        keys = self._index.keys(req)[: self.max_prefix_blocks]
        queues = [loads[w].waiting_requests for w in workers]
        qmax, qmin = max(queues), min(queues)
        wp, wk, wq = self.weights
        out = {}
        for w in workers:
            ld = loads[w]
            prefix = self._index.match(w, keys) / len(keys)
            kv = max(0.0, 1.0 - ld.hbm_used_blocks / ld.hbm_capacity_blocks) if ld.hbm_capacity_blocks else 0.0
            queue = 1.0 if qmax == qmin else (qmax - ld.waiting_requests) / (qmax - qmin)
            out[w] = wp * prefix + wk * kv + wq * queue
        return out

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """The worker with the highest weighted score."""
        scores = self.scores(req, view)
        top = max(scores.values())
        node = self._rng.choice([w for w, v in scores.items() if v == top])
        self._index.insert(node, self._index.keys(req)[: self.max_prefix_blocks])
        return Decision(node, always_reuse(view, node, req), f"score {top:.2f}")


class PrefillTable:
    """Prefill time by (new tokens, cached tokens), profiled on a grid and interpolated (Mooncake's estimator)."""

    NEW = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
    CACHED = (0, 4096, 16384, 65536, 131072)

    def __init__(self, measure: Callable[[int, int], float]) -> None:
        self._rows = [[measure(n, c) for n in self.NEW] for c in self.CACHED]

    @classmethod
    def from_profile(cls, model: ModelProfile, chunk_tokens: int) -> PrefillTable:
        """Sample a model's prefill times as an offline profiling run on an idle engine would."""
        return cls(lambda n, c: model.prefill_alone_ms(n, c, chunk_tokens))

    @staticmethod
    def _interp(xs: tuple[int, ...], ys: list[float], x: float) -> float:
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        x0, x1 = xs[i], xs[i + 1]
        return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)

    def ms(self, new_tokens: int, cached_tokens: int) -> float:
        """Estimated prefill time (linear inside the grid, extrapolated outside it)."""
        col = [self._interp(self.NEW, row, max(new_tokens, 1)) for row in self._rows]
        return max(0.0, self._interp(self.CACHED, col, cached_tokens))


class MooncakeConductor(BaseStrategy):
    """Mooncake's Conductor, KVCache-centric prefill scheduling (Qin et al., FAST'25, Section 6.1, Algorithm 1).

    For every prefill instance: prefix_len = its longest prefix in the Mooncake store (GPU, DRAM or SSD);
    best_len = the longest over all instances. If best_len / prefix_len >= `kvcache_balancing_threshold`, the
    instance would first fetch the best instance's extra blocks: TTFT = T_queue + T_transfer + T_prefill(best_len);
    otherwise TTFT = T_queue + T_prefill(prefix_len). Take the instance with the smallest estimated TTFT and, when
    its estimate included the transfer, fetch from the best instance (its local prefix from its own tiers first).
    T_prefill comes from a table profiled offline (`PrefillTable`); T_queue = queued prefill tokens at the
    profiled full-chunk throughput; T_transfer = bytes / NIC bandwidth, an average of measured transfers
    (starting from the nominal figure). The paper publishes no value for the threshold; 1.5 is ours.
    The paper's early rejection and hot-block replication are not modelled.
    """

    name = "mooncake"

    def __init__(self, profile: Profile | None = None, kvcache_balancing_threshold: float = 1.5) -> None:
        self.profile = profile or default_profile()
        self.threshold = kvcache_balancing_threshold
        self._tables: dict[str, PrefillTable] = {}
        self._nic_bytes_per_ms = self.profile.links["nic"].bandwidth / 1e3  # nominal until measured
        self._recent = RecentRoutes()

    def _table(self, model: str) -> PrefillTable:
        t = self._tables.get(model)
        if t is None:
            t = self._tables[model] = PrefillTable.from_profile(self.profile.model(model), self.profile.chunk_tokens)
        return t

    def observe_transfer(self, link: str, nbytes: int, ms: float, *, source: str = "", tier: str = "",
                         node: str = "") -> None:
        """Average the measured NIC bandwidth (exponentially weighted)."""
        if link == "nic" and ms > 0:
            self._nic_bytes_per_ms = 0.8 * self._nic_bytes_per_ms + 0.2 * nbytes / ms

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """The instance with the smallest estimated TTFT, fetching the best prefix when that is the plan."""
        table = self._table(req.model)
        chunk = self.profile.chunk_tokens
        per_token = table.ms(chunk, 0) / chunk
        nodes = view.nodes_for(req.model)
        loads = view.loads()
        extra = self._recent.since(loads)
        held = {n: tier_prefixes(view, n, req) for n in nodes}
        best_node = max(nodes, key=lambda n: held[n][2])
        best = held[best_node][2]
        bb = view.block_bytes(req)
        plan: tuple[float, str, bool] | None = None
        for n in nodes:
            local = held[n][2]
            q = (loads[n].queued_prefill_tokens + extra.get(n, (0, 0, 0))[1]) * per_token
            transfer = best > local and (local == 0 or best / local >= self.threshold)
            if transfer:
                ttft = q + (best - local) * bb / self._nic_bytes_per_ms + table.ms(
                    req.input_tokens - req.tokens_of(best), req.tokens_of(best))
            else:
                ttft = q + table.ms(req.input_tokens - req.tokens_of(local), req.tokens_of(local))
            if plan is None or ttft < plan[0]:
                plan = (ttft, n, transfer)
        assert plan is not None
        ttft, node, transfer = plan
        fetches = list(always_reuse(view, node, req))
        if transfer:
            local = fetches[-1].end if fetches else 0
            h, d, _ = held[best_node]
            tier = "hbm" if h >= best else "dram" if d >= best else "disk"
            fetches.append(Fetch(best_node, tier, local, best))
        end = fetches[-1].end if fetches else 0
        self._recent.add(view.now, node, max(1, req.input_tokens - req.tokens_of(end)), req.blocks)
        why = f"estimated TTFT {ttft:.0f} ms"
        if transfer:
            why += f", fetching a {best}-block prefix from {best_node}"
        return Decision(node, tuple(fetches), why)


STRATEGIES: dict[str, Callable[[Profile], Strategy]] = {
    "never": lambda p: NeverReuse(),
    "round-robin": lambda p: RoundRobin(),
    "sglang": lambda p: SGLangCacheAware(block_tokens=p.block_tokens),
    "dynamo": lambda p: DynamoKV(),
    "llm-d": lambda p: LlmdScheduler(block_tokens=p.block_tokens),
    "mooncake": lambda p: MooncakeConductor(p),
    "nexuskv": lambda p: _nexuskv(p),
}


def _nexuskv(profile: Profile) -> Strategy:
    from nexuskv_sim.nexus import NexusKVStrategy  # imports the kernel's plugins: only when asked for

    return NexusKVStrategy(profile)


def make_strategy(name: str, profile: Profile | None = None) -> Strategy:
    """A fresh instance of the built-in strategy `name` (Mooncake profiles its prefill table on `profile`)."""
    try:
        factory = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r} (built in: {', '.join(STRATEGIES)})") from None
    return factory(profile or default_profile())
