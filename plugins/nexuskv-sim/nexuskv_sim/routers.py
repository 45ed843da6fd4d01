"""Baseline routers, re-implemented here from published algorithms: round robin, never reuse, SGLang, Dynamo KV.

This is the project's own code for the simulator, not the routers' (README, "Baselines").

Every baseline but `never` loads with always-reuse: the longest prefix held at the chosen node, each part from
its fastest tier. Their estimates use their own documented formulas and the signals they really have (their own
routing history, the delayed load reports, KV events), never the simulator's profile.
"""

from __future__ import annotations

import random

from nexuskv_sim.api import BaseStrategy, ClusterView, Decision, SimRequest
from nexuskv_sim.reuse import ApproxPrefixIndex, RecentRoutes, always_reuse, tier_prefixes

__all__ = ["DynamoKV", "NeverReuse", "RoundRobin", "SGLangCacheAware"]


class RoundRobin(BaseStrategy):
    """Round robin over the nodes serving the request's model, with always-reuse loading."""

    name = "round-robin"
    reuse = True

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """The model's next node in turn."""
        nodes = view.nodes_for(req.model)
        i = self._next.get(req.model, 0)
        self._next[req.model] = i + 1
        node = nodes[i % len(nodes)]
        return Decision(node, always_reuse(view, node, req) if self.reuse else (), "round robin")


class NeverReuse(RoundRobin):
    """Round robin, no loads, no prefix cache hits: every request prefills all its tokens."""

    name = "never"
    reuse = False


class SGLangCacheAware(BaseStrategy):
    """SGLang router, `cache_aware` policy (sgl-project/sglang, sgl-router/src/policies/cache_aware.rs).

    Per model, an approximate radix tree per worker of the prompts the router sent there (no eviction events;
    LRU-trimmed to `max_tree_size` characters, here blocks at 4 characters a token). Load is the router's count
    of a worker's in-flight requests. If max - min load > `balance_abs_threshold` and max >
    `balance_rel_threshold` * min, route to the least loaded worker; otherwise take the worker with the longest
    prefix match if match / prompt > `cache_threshold`, else the worker with the smallest tree. Either way the
    prompt is inserted into the chosen worker's tree. Defaults: the Python launcher's `RouterArgs`
    (sgl-router/py_src/sglang_router/router_args.py: cache_threshold 0.3, balance_abs_threshold 64,
    balance_rel_threshold 1.5, max_tree_size 2**26); the Rust `CacheAwareConfig::default` has 0.5 / 32 / 1.1.
    In-flight counts come from the delayed load reports plus the requests routed since (the router's own count
    is exact; ours lags in noticing completions by the report delay).
    """

    name = "sglang"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 2**26,
                 block_tokens: int = 512) -> None:  # fmt: skip
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._tree = ApproxPrefixIndex(max(1, max_tree_size // (4 * block_tokens)))
        self._recent = RecentRoutes()

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """Shortest queue when imbalanced, else best match above the threshold, else the smallest tree."""
        workers = list(view.nodes_for(req.model))
        loads = view.loads()
        extra = self._recent.since(loads)
        load = {w: loads[w].waiting_requests + loads[w].running_decodes + extra.get(w, (0, 0, 0))[0] for w in workers}
        hi, lo = max(load.values()), min(load.values())
        keys = self._tree.keys(req)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            node = min(workers, key=lambda w: load[w])
            reason = f"imbalanced ({hi} vs {lo} in flight): shortest queue"
        else:
            matches = {w: self._tree.match(w, keys) for w in workers}
            best = max(workers, key=lambda w: matches[w])  # first of equals, as the tree's node order would
            rate = req.tokens_of(matches[best]) / req.input_tokens
            if rate > self.cache_threshold:
                node, reason = best, f"match rate {rate:.2f} > {self.cache_threshold}"
            else:
                node = min(workers, key=lambda w: self._tree.size(w))
                reason = f"match rate {rate:.2f} <= {self.cache_threshold}: smallest tree"
        self._tree.insert(node, keys)
        self._recent.add(view.now, node, req.input_tokens, req.blocks)
        return Decision(node, always_reuse(view, node, req), reason)


class DynamoKV(BaseStrategy):
    """NVIDIA Dynamo KV router (ai-dynamo/dynamo, lib/kv-router/src/scheduling/selector.rs, DefaultWorkerSelector).

    logit = prefill_load_scale * max(0, raw_prefill_blocks - overlap_credit) + decode_blocks, lowest wins
    (router_temperature 0: argmin, ties broken at random). raw_prefill_blocks = (the worker's active prefill
    tokens + this request's tokens) / block size; overlap_credit = overlap_score_credit * device blocks +
    host_cache_hit_weight * host blocks + disk_cache_hit_weight * disk blocks (each counted past the faster
    tier's prefix, from KV events); decode_blocks = the worker's active blocks + this request's. Defaults:
    overlap_score_credit (the old overlap_score_weight) 1.0, host 0.75, disk 0.25, prefill_load_scale 1.0.
    Active prefill tokens and blocks come from the delayed load reports plus what it routed since (Dynamo tracks
    its own active sequences exactly).
    """

    name = "dynamo"

    def __init__(self, overlap_score_credit: float = 1.0, host_cache_hit_weight: float = 0.75,
                 disk_cache_hit_weight: float = 0.25, prefill_load_scale: float = 1.0,
                 seed: int = 0) -> None:  # fmt: skip
        self.overlap_score_credit = overlap_score_credit
        self.host_cache_hit_weight = host_cache_hit_weight
        self.disk_cache_hit_weight = disk_cache_hit_weight
        self.prefill_load_scale = prefill_load_scale
        self._rng = random.Random(seed)
        self._recent = RecentRoutes()

    def logits(self, req: SimRequest, view: ClusterView) -> dict[str, float]:
        """The cost logit of every worker serving the request's model."""
        loads = view.loads()
        extra = self._recent.since(loads)
        bs = req.block_tokens
        out = {}
        for w in view.nodes_for(req.model):
            h, d, k = tier_prefixes(view, w, req)
            _, ptok, pblk = extra.get(w, (0, 0, 0))
            raw = (loads[w].queued_prefill_tokens + ptok + req.input_tokens) / bs
            credit = (self.overlap_score_credit * h + self.host_cache_hit_weight * (d - h)
                      + self.disk_cache_hit_weight * (k - d))  # fmt: skip
            decode = loads[w].hbm_used_blocks + pblk + req.blocks
            out[w] = self.prefill_load_scale * max(0.0, raw - credit) + decode
        return out

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """The worker with the lowest logit."""
        logits = self.logits(req, view)
        low = min(logits.values())
        node = self._rng.choice([w for w, v in logits.items() if v == low])
        fetches = always_reuse(view, node, req)
        cached = req.tokens_of(fetches[-1].end) if fetches else 0
        self._recent.add(view.now, node, max(1, req.input_tokens - cached), req.blocks)
        return Decision(node, fetches, f"lowest logit {low:.1f}")
