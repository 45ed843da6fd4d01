"""The P/D strategies: aggregated serving, always-transfer (the published P/D routers' rule, re-implemented), NexusKV.

All three decide on the delayed `ClusterView` only (loads and holdings as of `now - report_delay_ms`) plus what
they routed themselves since each report (`reuse.RecentRoutes`) and what the simulator reports back to them.
None reads the simulator's profile, its links or its engines.

- `Aggregated` (`aggregated`): no disaggregation. Every request runs prefill and decode on one node of the
  combined pool (prefill and decode nodes alike), the least-loaded one, loading what that node holds
  (always-reuse, as the baselines of `routers.py`).
- `AlwaysTransfer` (`always-transfer`): the rule of the published disaggregated routers (vLLM's disaggregated
  proxy, NVIDIA Dynamo's disaggregated serving, llm-d's P/D scheduling): prefill on the least-loaded prefill
  node (always-reuse of what it holds), then always send the KV to the least-loaded decode node.
- `NexusPD` (`nexuskv`): NexusKV as the P/D scheduler (`nexus.NexusKVStrategy`, one scheduler kernel per model):
  the prefill node by `Kernel.route` over the prefill pool (as `nexuskv` routes in the aggregated simulator);
  at the handoff, the decode node *and* transfer versus recompute by `Kernel.route` over the decode pool, with the
  kernel's index saying that the prefill node holds the whole prompt's KV in its GPU memory (the prefill node's
  completion says so) and how much of the prompt's prefix each decode node holds in its GPU cache (the delayed
  view; only the GPU cache: the kernel's planner takes a node's own copy of a block before a peer's whatever the
  tier, so a decode node's disk copy would hide the prefill node's GPU copy from the pricing). The kernel prices
  each decode node: its reported queue, plus the plan that node would make, which loads from the prefill node
  over the link to it (`peer:<prefill node>`, priced from the datasheet prior until measured, then from the
  durations of past transfers the simulator reported, queueing included) only where that beats recomputing
  with the measured prefill profile. The lowest predicted TTFT wins; its plan's spans are the fetches. Loads do
  not overlap the decode node's queue in that prediction (`overlap_loads` off): the handed-off request joins the
  decode node's queue when its KV is in.
- `NexusHandoff` (`nexuskv-handoff`): a diagnostic, always-transfer's prefill side with NexusKV's handoff.

"Least-loaded" is the node with the fewest queued prefill tokens, then the fewest requests in flight (waiting
and decoding), then the name; reports plus what the router sent since.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nexuskv import Location, NodeState
from nexuskv_sim.api import BaseStrategy, ClusterView, Decision, Fetch, SimRequest, Strategy
from nexuskv_sim.nexus import NexusKVStrategy
from nexuskv_sim.pd import Pools
from nexuskv_sim.profile import Profile
from nexuskv_sim.reuse import RecentRoutes, always_reuse

__all__ = ["PD_STRATEGIES", "Aggregated", "AlwaysTransfer", "NexusHandoff", "NexusPD", "PoolView", "make_pd_strategy"]

PD_STRATEGIES = ("aggregated", "always-transfer", "nexuskv", "nexuskv-handoff")


class PoolView:
    """A `ClusterView` whose `nodes_for` lists only the nodes of one pool (everything else is the view's own)."""

    def __init__(self, view: ClusterView, pool: Sequence[str]) -> None:
        self._view = view
        self._pool = frozenset(pool)

    def nodes_for(self, model: str) -> tuple[str, ...]:
        """The pool's nodes serving `model`."""
        return tuple(n for n in self._view.nodes_for(model) if n in self._pool)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


class _LeastLoaded:
    """The least-loaded node from the delayed reports plus the router's own routes since them."""

    def __init__(self) -> None:
        self._recent = RecentRoutes()

    def pick(self, view: ClusterView, nodes: Sequence[str]) -> str:
        loads = view.loads()
        sent = self._recent.since(loads)

        def key(n: str) -> tuple[int, int, str]:
            reqs, tokens, _ = sent.get(n, (0, 0, 0))
            ld = loads[n]
            return ld.queued_prefill_tokens + tokens, ld.waiting_requests + ld.running_decodes + reqs, n

        return min(nodes, key=key)

    def add(self, now: float, node: str, tokens: int, blocks: int) -> None:
        self._recent.add(now, node, tokens, blocks)


def _reuse_here(view: ClusterView, node: str, req: SimRequest) -> tuple[tuple[Fetch, ...], int]:
    """Always-reuse fetches at `node`, and the tokens left to prefill."""
    fetches = always_reuse(view, node, req)
    return fetches, max(1, req.input_tokens - req.tokens_of(fetches[-1].end if fetches else 0))


def _least_loaded_prefill(least: _LeastLoaded, pools: Pools, req: SimRequest, view: ClusterView) -> Decision:
    """The least-loaded node of the prefill pool, loading what it holds (the published routers' prefill step)."""
    node = least.pick(view, PoolView(view, pools.prefill).nodes_for(req.model))
    fetches, prefill = _reuse_here(view, node, req)
    least.add(view.now, node, prefill, req.blocks)
    return Decision(node, fetches, "least-loaded prefill node")


class Aggregated(BaseStrategy):
    """Aggregated serving: each request whole (prefill and decode) on the least-loaded node of all of them."""

    name = "aggregated"
    disaggregated = False

    def __init__(self) -> None:
        self._loads = _LeastLoaded()

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """The least-loaded node serving the model, loading what it holds."""
        node = self._loads.pick(view, view.nodes_for(req.model))
        fetches, prefill = _reuse_here(view, node, req)
        self._loads.add(view.now, node, prefill, req.blocks)
        return Decision(node, fetches, "least-loaded")

    def handoff(self, req: SimRequest, prefill_node: str, view: ClusterView) -> Decision:
        """Never called: nothing is handed off."""
        raise RuntimeError("aggregated serving hands nothing off")


class AlwaysTransfer(BaseStrategy):
    """The published disaggregated routers' rule: least-loaded prefill node, always transfer, least-loaded decode."""

    name = "always-transfer"
    disaggregated = True

    def __init__(self, pools: Pools) -> None:
        self.pools = pools
        self._prefill = _LeastLoaded()
        self._decode = _LeastLoaded()

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """The least-loaded prefill node, loading what it holds."""
        return _least_loaded_prefill(self._prefill, self.pools, req, view)

    def handoff(self, req: SimRequest, prefill_node: str, view: ClusterView) -> Decision:
        """The least-loaded decode node, sent the whole prompt's KV from the prefill node."""
        node = self._decode.pick(view, PoolView(view, self.pools.decode).nodes_for(req.model))
        self._decode.add(view.now, node, 1, req.blocks)
        return Decision(node, (Fetch(prefill_node, "hbm", 0, req.blocks),), "least-loaded decode node, transfer")


class NexusPD(NexusKVStrategy):
    """NexusKV as the P/D scheduler: `Kernel.route` for the prefill node, and for the decode node and its plan."""

    name = "nexuskv"
    disaggregated = True

    def __init__(self, profile: Profile, pools: Pools, *, policies: str | None = None, name: str = "nexuskv",
                 links: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(profile, policies=policies, name=name, links=links)
        self.pools = pools
        self._handed = RecentRoutes()  # decode-side routes since each report (the prefill side's are `_recent`)
        self.handoffs: dict[str, int] = {"transfer": 0, "recompute": 0}  # what it chose (the world counts the outcome)

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """`NexusKVStrategy.decide` over the prefill pool."""
        return super().decide(req, PoolView(view, self.pools.prefill))  # type: ignore[arg-type]

    def handoff(self, req: SimRequest, prefill_node: str, view: ClusterView) -> Decision:
        """The decode node with the lowest predicted TTFT, and its plan: transfer from the prefill node, or not."""
        self._view = view
        kernel = self._kernel(req.model)
        request = self._request(req)
        keys = kernel.keys(request)
        nodes = list(PoolView(view, self.pools.decode).nodes_for(req.model))
        for k in keys:
            kernel.index.remove(k)
        for n in nodes:  # where each decode node holds the prompt's prefix in its GPU cache (the delayed view)
            held = min(view.prefix_blocks(n, "hbm", req), len(keys))
            if held:
                kernel.index.insert_many(keys[:held], Location("hbm", n, 1))
        kernel.index.insert_many(keys, Location("hbm", prefill_node, 1))  # the prefill node's completion says so
        try:
            loads = view.loads()
            sent = self._handed.since(loads)
            states = []
            for n in nodes:
                reqs, tokens, _ = sent.get(n, (0, 0, 0))
                states.append(NodeState(n, queued_prefill_tokens=loads[n].queued_prefill_tokens + tokens,
                                        waiting_requests=loads[n].waiting_requests + reqs,
                                        running_decodes=loads[n].running_decodes))  # fmt: skip
            d = kernel.route(request, states, keys=keys)  # no overlap: a handed-off request queues once its KV is in
        finally:
            for k in keys:  # the prefill node's copy is pinned for this request only, not a cache entry
                kernel.index.remove(k, Location("hbm", prefill_node, 1))
        if d.node is None:
            return Decision("", reason="; ".join(d.reasons))
        option = d.option(d.node)
        fetches = tuple(Fetch(n, t, f, e) for f, e, t, n in option.spans) if option is not None else ()
        transfer = any(f.source_node == prefill_node for f in fetches)
        self.handoffs["transfer" if transfer else "recompute"] += 1
        loaded = req.tokens_of(fetches[-1].end) if fetches else 0
        self._handed.add(view.now, d.node, max(1, req.input_tokens - loaded), req.blocks)
        return Decision(d.node, fetches, reason="; ".join(d.reasons))

    def stats(self) -> Mapping[str, Any]:
        """Route fail-opens per model, and the handoff choices."""
        return {**super().stats(), "handoffs": dict(self.handoffs)}


class NexusHandoff(NexusPD):
    """A diagnostic: always-transfer's prefill side (least-loaded prefill node), NexusKV's handoff (`NexusPD`).

    It separates what NexusKV's handoff decision gains from what its prefill routing gains.
    """

    name = "nexuskv-handoff"

    def __init__(self, profile: Profile, pools: Pools, *, policies: str | None = None,
                 name: str = "nexuskv-handoff") -> None:  # fmt: skip
        super().__init__(profile, pools, policies=policies, name=name)
        self._least = _LeastLoaded()

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """The least-loaded prefill node, loading what it holds (as `AlwaysTransfer`)."""
        return _least_loaded_prefill(self._least, self.pools, req, view)


def make_pd_strategy(name: str, pools: Pools, profile: Profile) -> Strategy:
    """A fresh P/D strategy by name (`PD_STRATEGIES`); `profile` is only for NexusKV's calibration run."""
    if name == "aggregated":
        return Aggregated()
    if name == "always-transfer":
        return AlwaysTransfer(pools)
    if name == "nexuskv":
        return NexusPD(profile, pools)
    if name == "nexuskv-handoff":
        return NexusHandoff(profile, pools)
    raise ValueError(f"unknown P/D strategy {name!r} (known: {', '.join(PD_STRATEGIES)})")
