"""Prefill/decode (P/D) disaggregation in the simulated cluster: a prefill pool, a decode pool, the KV handoff.

`PDWorld` is the ordinary `World` (same hosts, links, engines, tiers, delayed view and measurements) with nodes in
two pools. A disaggregated request runs in two phases:

1. **Prefill** on a node of the prefill pool, chosen by the strategy's `decide` exactly as in `World` (its fetches
   load what that node holds, the rest is prefilled by that node's engine). The prefill node's engine runs the
   prompt as a one-token request; when it is done the request's KV is written through to that node's tiers (as
   after any prefill) and is held, pinned, on the prefill node's GPU until it has been sent.
2. **Handoff** at that moment: the strategy's `handoff(req, prefill_node, view)` names the decode node and its
   fetches. A fetch from the prefill node is the KV **transfer**: block by block over the prefill host's NIC out
   and the decode host's NIC in (`links.hold`: shared, FIFO, so bytes of other transfers ahead of it delay it; a
   block the decode node already holds in its hbm is not sent); fetches from other nodes or the decode node's own
   tiers are ordinary loads (`World._fetch`). What no fetch covers is **recomputed**: prefilled again by the decode
   node's engine, in the same continuous batches as its running decodes (they slow each other down). At least one
   token is always computed on the decode node: the iteration that computes it emits the first token.

TTFT = end of the decode node's iteration that emits the first token - arrival, on the simulator's clock: prefill
queueing and compute, the handoff decision's wait for nothing (decisions take no simulated time), the transfer
with its queueing or the recompute, and the decode node's own queue. The request then decodes its
`output_tokens - 1` remaining tokens on the decode node (the engine's decode step model).

A strategy with `disaggregated = False` (aggregated serving) runs every request whole on the node `decide` picks,
as `World` does. The ground truth lives here, in `World`, `Engine` and `links`: strategies see only the delayed
view and what the simulator reports to them (`observe_transfer`, `observe_done`).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import simpy
from attrs import define, field

from nexuskv_sim.api import ClusterView, Decision, SimRequest, Strategy
from nexuskv_sim.engine import Job
from nexuskv_sim.links import hold
from nexuskv_sim.metrics import SimResult
from nexuskv_sim.profile import Profile, default_profile
from nexuskv_sim.trace import TraceRecord
from nexuskv_sim.world import TierFactory, World

__all__ = ["PDResult", "PDStrategy", "PDWorld", "Pools", "pd_cluster", "pd_summary", "simulate_pd"]


@define(frozen=True)
class Pools:
    """The node names of the prefill pool and of the decode pool (disjoint)."""

    prefill: tuple[str, ...] = field(converter=tuple)
    decode: tuple[str, ...] = field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if not self.prefill or not self.decode or set(self.prefill) & set(self.decode):
            raise ValueError(f"need a non-empty prefill and decode pool, disjoint: {self.prefill}, {self.decode}")

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node, prefill pool first."""
        return (*self.prefill, *self.decode)


@define
class PDResult(SimResult):
    """`SimResult` plus the handoffs: transfers and recomputes counted apart, and the bytes the transfers moved."""

    transfers: int = 0  # handoffs that sent KV from the prefill node (all or part of it)
    recomputes: int = 0  # handoffs that sent nothing and prefilled more than a block's tokens on the decode node
    held: int = 0  # handoffs that sent nothing because the decode node held (nearly) the whole prompt already
    transfer_bytes: int = 0  # bytes sent prefill node -> decode node (also counted in `bytes_by_link`)
    transfer_ms: float = 0.0  # summed duration of those transfers, queueing included
    decode_prefill_tokens: int = 0  # tokens the decode nodes prefilled (1 per transferred request at least)

    @property
    def mean_transfer_ms(self) -> float:
        """Mean duration of a transfer (queueing included)."""
        return self.transfer_ms / self.transfers if self.transfers else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary, handoff counters included."""
        return {**super().to_dict(), "transfers": self.transfers, "recomputes": self.recomputes, "held": self.held,
                "transfer_bytes": self.transfer_bytes, "mean_transfer_ms": self.mean_transfer_ms,
                "decode_prefill_tokens": self.decode_prefill_tokens}  # fmt: skip


@runtime_checkable
class PDStrategy(Strategy, Protocol):
    """A P/D strategy: `decide` places the prefill (or, not disaggregated, the whole request); `handoff` the decode.

    `handoff` is called when the prefill node has finished the prompt: it returns the decode node and its fetches;
    a fetch whose `source_node` is `prefill_node` (tier "hbm") is the KV transfer, anything not fetched is
    recomputed on the decode node.
    """

    disaggregated: bool

    def handoff(self, req: SimRequest, prefill_node: str, view: ClusterView) -> Decision:
        """The decode node for `req` and what it loads (see the class docstring)."""
        ...


class PDWorld(World):
    """One simulation run of one P/D strategy over a list of requests (see the module docstring)."""

    def __init__(self, requests: Sequence[SimRequest], strategy: Strategy, *, pools: Pools,
                 node_model: Mapping[str, str], node_host: Mapping[str, str], profile: Profile,
                 report_delay_ms: float = 50.0, slo_ms: float = 2000.0,
                 tier_factory: TierFactory | None = None) -> None:  # fmt: skip
        if set(pools.nodes) != set(node_model):
            raise ValueError(f"the pools {pools.nodes} must name exactly the nodes {tuple(node_model)}")
        self.pools = pools
        self.disaggregated = bool(getattr(strategy, "disaggregated", False))
        self._prefill = frozenset(pools.prefill)
        self._decode = frozenset(pools.decode)
        self._original = {r.rid: r for r in requests}
        # a prefill node's engine runs the prompt as a one-token request: it leaves that engine at its first token
        phase1 = [attrs.evolve(r, output_tokens=1) for r in requests] if self.disaggregated else list(requests)
        super().__init__(phase1, strategy, node_model=node_model, node_host=node_host, profile=profile,
                         report_delay_ms=report_delay_ms, slo_ms=slo_ms, tier_factory=tier_factory)  # fmt: skip
        self.result: PDResult = PDResult(strategy=self.result.strategy, slo_ms=slo_ms)

    # ------------------------------------------------------------------------------------------ phases

    def _check(self, req: SimRequest, d: Decision) -> None:
        super()._check(req, d)
        if self.disaggregated and d.node not in self._prefill:
            raise ValueError(f"strategy {self.result.strategy!r} sent the prefill of request {req.rid} to "
                             f"{d.node!r}, not a prefill node {self.pools.prefill}")  # fmt: skip

    def _prefilling(self, job: Job) -> bool:
        return self.disaggregated and job.node in self._prefill

    def _first_token(self, job: Job) -> None:
        if not self._prefilling(job):  # the decode side (or an aggregated node) emits the first token
            super()._first_token(job)
            return
        req, node = job.req, job.node
        host = self.hosts[self.node_host[node]]
        reps = (self._hbm_rep[node], self._dram_rep[host.name], self._disk_rep[host.name])
        for j, key in enumerate(job.keys):  # written through as after any prefill
            for tier, rep in zip((self.hbm[node], host.dram, host.disk), reps, strict=True):
                self._put(tier, rep, key, req, j)
        full = self._original[req.rid]
        self.view.advance()
        t = time.perf_counter()
        d = self.strategy.handoff(full, node, self.view)  # type: ignore[attr-defined]
        self._decide_s += time.perf_counter() - t
        if d.node == "":  # refused: it never decodes
            self.result.rejected += 1
            self.view.forget(req)
            return
        self._check_handoff(full, d, node)
        djob = Job(full, job.keys, d.node)
        djob.decision = d
        planned = d.fetches[-1].end if d.fetches else 0
        self.engines[d.node].admit(djob, max(1, full.input_tokens - full.tokens_of(planned)))
        self.env.process(self._handoff(djob, d, node))

    def _check_handoff(self, req: SimRequest, d: Decision, prefill_node: str) -> None:
        World._check(self, req, d)
        if d.node not in self._decode:
            raise ValueError(f"strategy {self.result.strategy!r} handed request {req.rid} to {d.node!r}, not a "
                             f"decode node {self.pools.decode}")  # fmt: skip
        if any(f.source_node == prefill_node and f.tier != "hbm" for f in d.fetches):
            raise ValueError(f"request {req.rid}: the KV on the prefill node {prefill_node} is in its hbm")

    def _finish(self, job: Job) -> None:
        if not self._prefilling(job):  # the prefill side's one-token run is not the request finishing
            super()._finish(job)

    # ------------------------------------------------------------------------------------------ handoff

    def _handoff(self, job: Job, d: Decision, prefill_node: str) -> Generator[simpy.Event, Any, None]:
        """The decode side's loads (the transfer from the prefill node, other fetches), then its prefill queue."""
        res, req = self.result, job.req
        loaded, sent = 0, 0
        for f in d.fetches:
            if f.source_node == prefill_node:
                got, moved = yield from self._transfer(job, prefill_node, f.start, f.end)
                sent += moved
            else:
                got = yield from self._fetch(job, f.source_node, f.tier, f.start, f.end)
            loaded += got
            if got < f.end - f.start:
                res.load_misses += 1
                res.load_miss_blocks += d.fetches[-1].end - loaded
                break
        job.cached_blocks = loaded
        prefill = max(1, req.input_tokens - req.tokens_of(loaded))
        if sent:
            res.transfers += 1
        elif prefill > req.block_tokens:
            res.recomputes += 1
        else:
            res.held += 1
        res.decode_prefill_tokens += prefill
        self.engines[job.node].enqueue(job, prefill)

    def _transfer(self, job: Job, src: str, start: int, end: int) -> Generator[simpy.Event, Any, tuple[int, int]]:
        """Send blocks [start, end) of the request's pinned KV from `src`'s GPU into the job's node.

        Over the NICs (src host's out, ours in) or, on one host, PCIe; blocks already in our hbm are not sent.
        Returns (blocks arrived: all of them, bytes sent).
        """
        env, res, req, node = self.env, self.result, job.req, job.node
        here, there = self.hosts[self.node_host[node]], self.hosts[self.node_host[src]]
        links = [here.pcie] if here is there else [there.nic_out, here.nic_in]
        kind = links[0].kind
        hbm, rep = self.hbm[node], self._hbm_rep[node]
        nbytes = self.profile.block_bytes(req.model)
        t0, moved = env.now, 0
        for j in range(start, end):
            key = job.keys[j]
            if hbm.contains(key):
                hbm.touch(key)
                continue
            if not moved:  # latency once per transfer, as for a fetch
                yield env.timeout(sum(link.latency_ms for link in links))
            yield from hold(env, links, nbytes)
            res.bytes_by_link[kind] = res.bytes_by_link.get(kind, 0) + nbytes
            moved += nbytes
            self._put(hbm, rep, key, req, j)
        if moved:
            res.transfer_bytes += moved
            res.transfer_ms += env.now - t0
            res.fetches_by_source["transfer:hbm"] = res.fetches_by_source.get("transfer:hbm", 0) + 1
            self.strategy.observe_transfer(kind, moved, env.now - t0, source=src, tier="hbm", node=node)
        return end - start, moved


# ---------------------------------------------------------------------------------------------- running


def pd_cluster(models: Sequence[str], prefill: int, decode: int) -> tuple[Pools, dict[str, str], dict[str, str]]:
    """Prefill nodes `p0..`, decode nodes `d0..`, each on its own host; models round-robin within each pool."""
    if prefill < 1 or decode < 1 or not models:
        raise ValueError("need at least one prefill node, one decode node and one model")
    pools = Pools([f"p{i}" for i in range(prefill)], [f"d{i}" for i in range(decode)])
    node_model = {n: models[i % len(models)] for names in (pools.prefill, pools.decode) for i, n in enumerate(names)}
    return pools, node_model, {n: f"h-{n}" for n in pools.nodes}


def simulate_pd(records: Iterable[TraceRecord], strategies: Sequence[Strategy | str], *, prefill: int = 2,
                decode: int = 2, profile: Profile | None = None, congested: bool = False,
                report_delay_ms: float = 50.0, slo_ms: float = 2000.0,
                limit: int | None = None) -> dict[str, PDResult]:  # fmt: skip
    """Run every P/D strategy over the same requests on identical, fresh P/D clusters; results by strategy name.

    A name (`pd_routers.PD_STRATEGIES`) gets a fresh instance for the cluster's pools (closed here); a strategy
    object must have been made for the pools of `pd_cluster(models, prefill, decode)`. `congested` scales links by
    the profile's `[congested]` factors (NIC and disk at 5% by default), as `simulate` does.
    """
    from nexuskv_sim.pd_routers import make_pd_strategy
    from nexuskv_sim.simulate import to_requests

    base = profile or default_profile()
    prof = base.congested() if congested else base
    reqs = to_requests(records, prof, limit)
    models = list(dict.fromkeys(r.model for r in reqs)) or [prof.default_model]
    pools, node_model, node_host = pd_cluster(models, prefill, decode)
    out: dict[str, PDResult] = {}
    for s in strategies:
        strategy = make_pd_strategy(s, pools, base) if isinstance(s, str) else s
        world = PDWorld(reqs, strategy, pools=pools, node_model=node_model, node_host=node_host, profile=prof,
                        report_delay_ms=report_delay_ms, slo_ms=slo_ms)  # fmt: skip
        try:
            res = world.run()
        finally:
            close = getattr(strategy, "close", None)
            if isinstance(s, str) and callable(close):
                close()
        out[res.strategy] = res  # type: ignore[assignment]
    return out


def pd_summary(results: Mapping[str, PDResult]) -> str:
    """A table of the strategies side by side: TTFT, handoffs (transfers and recomputes apart), bytes moved."""
    head = (f"{'strategy':<16} {'done':>5} {'mean TTFT':>10} {'p90 TTFT':>9} {'p99 TTFT':>9} {'SLO':>6} "
            f"{'transfers':>9} {'recomputes':>10} {'held':>5} {'xfer GB':>8} {'xfer ms':>8} {'D prefill Mtok':>14} "
            f"{'GB moved':>8} {'wall s':>6}")  # fmt: skip
    lines = [head]
    for name, r in results.items():
        lines.append(f"{name:<16} {r.completed:>5} {r.mean_ttft_ms:>10.0f} {r.p90_ttft_ms:>9.0f} "
                     f"{r.p99_ttft_ms:>9.0f} {r.slo_attainment:>6.3f} {r.transfers:>9} {r.recomputes:>10} {r.held:>5} "
                     f"{r.transfer_bytes / 1e9:>8.1f} {r.mean_transfer_ms:>8.0f} "
                     f"{r.decode_prefill_tokens / 1e6:>14.2f} {r.gb_moved:>8.1f} {r.wall_s:>6.1f}")  # fmt: skip
    return "\n".join(lines)
