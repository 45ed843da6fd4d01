"""NexusKV as a simulated scheduler: `Kernel.route` chooses the node, the plan for that node chooses the loads.

One scheduler kernel per model (each with the cost profile measured for that model, `calibrate.py`) sees what a
real deployment's scheduler sees: the nodes' load reports and holdings as the cluster view delays them (its
cluster-wide index, here refreshed for each request's blocks from the delayed view), and its own link
estimates, learned from every transfer the simulator reports (`observe_transfer`: local tier reads per tier,
peer reads per peer). Nothing here reads the simulator's hardware profile or its timing. The kernels' clock is
simulated time: link estimates age (`max_age_s`) and breakers cool down on it, so a trace gives the same
decisions on any host at any load; the routing budget's 1 s floor is far above any route's host time.

Per request: the kernel keys the request (synthetic token ids derived from the trace's hash ids, so equal ids
give equal keys), its index is set to where each node holds the request's blocks (hbm, dram, disk; peers
included), `route` prices every node serving the model and picks one, and the chosen option's spans become the
fetches: from the node's own tiers or from a peer. Blocks not fetched are prefilled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    Location,
    ModelIdentity,
    NodeState,
    Request,
    StateGroup,
    TokenizerIdentity,
)
from nexuskv_sim.api import TIERS, BaseStrategy, ClusterView, Decision, Fetch, Prefetch, SimRequest
from nexuskv_sim.calibrate import measured_profile
from nexuskv_sim.decode_fit import DecodeFit
from nexuskv_sim.profile import Profile
from nexuskv_sim.reuse import RecentRoutes
from nexuskv_sim.trace import token_ids

__all__ = ["NexusKVStrategy"]

_SECRET = bytes(range(32))


class NexusKVStrategy(BaseStrategy):
    """Route with `Kernel.route`; load what the chosen node's plan says (see the module docstring)."""

    name = "nexuskv"

    def __init__(self, profile: Profile, *, policies: str | None = None, name: str = "nexuskv",
                 links: Mapping[str, Any] | None = None) -> None:  # fmt: skip
        """`links` overrides the scheduler kernels' `[links]` table (default: one sample makes an estimate)."""
        self.name = name
        self._profile = profile
        self._policies = policies
        self._links = {"min_samples": 1, **(links or {})}
        self._kernels: dict[str, Kernel] = {}
        self._layouts: dict[str, Layout] = {}
        self._recent = RecentRoutes()
        self._fits: dict[str, DecodeFit] = {}  # per model: what running decodes add to TTFT, from measured TTFTs
        self._routed: dict[int, tuple[float, float]] = {}  # request -> (prediction without decodes, its fit's x)
        self._view: Any = None  # the cluster view of the latest decision: its `now` is the kernels' clock

    # ------------------------------------------------------------------------------------------ kernels

    def _clock(self) -> float:
        """Simulated seconds: what the kernels' link estimates and breakers age on (the judge is deterministic)."""
        return self._view.now / 1e3 if self._view is not None else 0.0

    def _kernel(self, model: str) -> Kernel:
        k = self._kernels.get(model)
        if k is None:
            import json
            import tempfile

            from nexuskv import to_dict

            prof = measured_profile(self._profile, model)
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
                json.dump(to_dict(prof), fh)
            tiers = {t: {"store": "dram", "capacity_bytes": 1 << 20} for t in TIERS}  # pricing only: no payloads
            cfg = KernelConfig(node="scheduler", page_size=self._profile.block_tokens, profile=fh.name, tiers=tiers,
                               transports=("local", "tcp"), policies=self._policies, prefetch_max_tasks=0,
                               deadline_ms=1000.0, links=self._links)  # fmt: skip
            try:
                k = self._kernels[model] = Kernel(cfg, secret=_SECRET, clock=self._clock)
            finally:
                os.unlink(fh.name)  # the kernel has read it
            self._layouts[model] = Layout(groups=[StateGroup(kind="dense", layers=1, kv_heads=1, head_dim=1)],
                                          page_size=self._profile.block_tokens)  # fmt: skip
        return k

    def close(self) -> None:
        """Close the scheduler kernels."""
        for k in self._kernels.values():
            k.close()
        self._kernels.clear()

    def _request(self, req: SimRequest) -> Request:
        tokens = token_ids(req.hash_ids, req.input_tokens, req.block_tokens)
        model = ModelIdentity(name=req.model, revision="sim")
        return Request(request_id=f"r{req.rid}", tenant=req.tenant, model=model,
                       tokenizer=TokenizerIdentity(name="sim"), layout=self._layouts[req.model],
                       token_ids=tokens)  # fmt: skip

    # ------------------------------------------------------------------------------------------ deciding

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """Route and plan with the model's scheduler kernel."""
        self._view = view
        kernel = self._kernel(req.model)
        request = self._request(req)
        keys = kernel.keys(request)
        nodes = list(view.nodes_for(req.model))
        self._sync_index(kernel, req, keys, view)
        loads = view.loads()
        sent = self._recent.since(loads)  # what this scheduler routed since each report: it knows, reports lag
        states = []
        fit = self._fits.setdefault(req.model, DecodeFit())
        per_ktok = fit.decode_ms  # ms one running decode adds per 1,000 tokens of prefill ahead of the first token
        work: dict[str, float] = {}
        for n in nodes:
            reqs, tokens, _ = sent.get(n, (0, 0, 0))
            queued = loads[n].queued_prefill_tokens + tokens
            work[n] = (queued + req.input_tokens) / 1e3
            states.append(NodeState(n, queued_prefill_tokens=queued,
                                    waiting_requests=loads[n].waiting_requests + reqs,
                                    running_decodes=loads[n].running_decodes, decode_ms=per_ktok * work[n],
                                    overlap_loads=True))  # fmt: skip
        d = kernel.route(request, states, keys=keys)
        if d.node is None:  # the tenant's route rules allow none of these nodes: refused, as a scheduler would
            return Decision("", reason="; ".join(d.reasons))
        node = d.node
        option = d.option(node)
        fetches = tuple(Fetch(n, t, f, e) for f, e, t, n in option.spans) if option is not None else ()
        prefetches = tuple(Prefetch(t, f, e) for f, e, t, n in option.prefetch
                           if n == node and option.prefetch_to == "hbm") if option is not None else ()  # fmt: skip
        reused = option.reuse_tokens if option is not None else 0
        if option is not None:  # what was predicted without the decodes, to learn what they add (`DecodeFit`)
            decodes = loads[node].running_decodes
            self._routed[req.rid] = (option.predicted_ttft_ms - decodes * per_ktok * work[node],
                                     decodes * work[node])  # fmt: skip
        self._recent.add(view.now, node, max(1, req.input_tokens - reused), req.blocks)
        return Decision(node, fetches, reason="; ".join(d.reasons), prefetches=prefetches)

    def _sync_index(self, kernel: Kernel, req: SimRequest, keys: Sequence[bytes], view: ClusterView) -> None:
        """Make the kernel's index say where each node holds this request's blocks (as the view reports it)."""
        index = kernel.index
        for k in keys:
            index.remove(k)
        full = len(keys)
        for n in view.holders(req):  # the others hold no prefix of it
            start = 0
            for tier, held in zip(TIERS, view.holdings(n, req), strict=True):  # each tier "or faster": a tier
                end = min(held, full)  # holds the blocks past the faster ones'
                if end > start:
                    index.insert_many(keys[start:end], Location(tier, n, 1))
                    start = end

    # ------------------------------------------------------------------------------------------ measuring

    def observe_transfer(self, link: str, nbytes: int, ms: float, *, source: str = "", tier: str = "",
                         node: str = "") -> None:
        """Learn link estimates as the kernel's load path does: per tier for local reads, per peer for remote."""
        for k in self._kernels.values():
            if k.links is None:
                continue
            name = f"peer:{source}" if source and source != node else tier  # another node's state: its link
            if name:
                k.links.observe(name, float(nbytes), ms / 1e3)

    def observe_done(self, req: SimRequest, node: str, ttft_ms: float) -> None:
        """Learn what running decodes add to TTFT from the request's measured TTFT (as a scheduler measures it)."""
        routed = self._routed.pop(req.rid, None)
        if routed is not None:
            predicted, x = routed
            self._fits.setdefault(req.model, DecodeFit()).observe(x, ttft_ms - predicted)

    def stats(self) -> Mapping[str, Any]:
        """Route fail-opens per model."""
        return {m: k.router.fallbacks for m, k in self._kernels.items()}
