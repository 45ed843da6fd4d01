"""The simulated cluster: hosts with dram, disk and links; nodes (one engine and its hbm each) on them.

Requests arrive at their trace timestamps. The strategy decides at arrival; the request counts as waiting on the
chosen node at once; its fetches then run in order, block by block over the links (`links.py`), concurrently
with every engine's compute. Loaded blocks enter the node's hbm; the request joins the prefill queue with only
what was not loaded left to prefill. After its prefill, all its blocks are in the node's hbm and written through
to the host's dram and disk (writes take no link time). Transfer paths, per block, by where the block is when
its turn comes:

- the chosen node's hbm: free (already on the GPU);
- same host, another engine's hbm, or the host's dram: PCIe;
- the host's disk: disk, then PCIe;
- another host's hbm or dram: its NIC out and this host's NIC in, together (RDMA into GPU memory);
- another host's disk: its disk, then the NICs.

A block gone from the fetch's source (its tier or any faster one) when its turn comes ends the load there: a
load miss; the rest is prefilled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from typing import Any

import simpy

from nexuskv_sim.api import TIERS, Decision, SimRequest, Strategy
from nexuskv_sim.engine import Engine, Job
from nexuskv_sim.links import Link, hold
from nexuskv_sim.metrics import SimResult
from nexuskv_sim.profile import Profile
from nexuskv_sim.tiers import BlockMeta, BlockTier, LRUTier, block_keys
from nexuskv_sim.view import DelayedView

__all__ = ["TierFactory", "World"]

TierFactory = Callable[[str, str, int], BlockTier]  # (host, tier name, capacity bytes) -> tier


def _lru(host: str, tier: str, capacity_bytes: int) -> BlockTier:
    return LRUTier(f"{host}/{tier}", capacity_bytes)


class _Host:
    def __init__(self, env: simpy.Environment, name: str, profile: Profile, tier_factory: TierFactory) -> None:
        self.name = name
        self.dram = tier_factory(name, "dram", profile.dram_bytes)
        self.disk = tier_factory(name, "disk", profile.disk_bytes)
        lk = profile.links
        self.pcie = Link(env, f"{name}/pcie", "pcie", lk["pcie"])
        self.disk_link = Link(env, f"{name}/disk", "disk", lk["disk"])
        self.nic_out = Link(env, f"{name}/nic-out", "nic", lk["nic"])
        self.nic_in = Link(env, f"{name}/nic-in", "nic", lk["nic"])


class World:
    """One simulation run of one strategy over a list of requests."""

    def __init__(self, requests: Sequence[SimRequest], strategy: Strategy, *, node_model: Mapping[str, str],
                 node_host: Mapping[str, str], profile: Profile, report_delay_ms: float = 50.0,
                 slo_ms: float = 2000.0, tier_factory: TierFactory | None = None) -> None:  # fmt: skip
        self.env = env = simpy.Environment()
        self.requests = sorted(requests, key=lambda r: (r.arrival_ms, r.rid))
        self.strategy = strategy
        self.profile = profile
        self.node_model = dict(node_model)
        self.node_host = dict(node_host)
        factory = tier_factory or _lru
        self.hosts = {h: _Host(env, h, profile, factory) for h in dict.fromkeys(self.node_host.values())}
        self.hbm: dict[str, LRUTier] = {n: LRUTier(f"{n}/hbm", profile.hbm_bytes) for n in self.node_model}
        hbm_blocks = {n: profile.hbm_bytes // profile.block_bytes(m) for n, m in self.node_model.items()}
        self.view = DelayedView(env, node_model=self.node_model, node_host=self.node_host, profile=profile,
                                report_delay_ms=report_delay_ms, hbm_capacity=hbm_blocks)  # fmt: skip
        self._hbm_rep = {n: self.view.replica_index("hbm", n) for n in self.node_model}
        self._dram_rep = {h: self.view.replica_index("dram", h) for h in self.hosts}
        self._disk_rep = {h: self.view.replica_index("disk", h) for h in self.hosts}
        self.engines = {
            n: Engine(env, n, profile.model(m), chunk_tokens=profile.chunk_tokens, max_batch=profile.max_batch,
                      hbm_capacity_blocks=hbm_blocks[n], on_first_token=self._first_token, on_finish=self._finish,
                      on_report=self.view.report)
            for n, m in self.node_model.items()
        }  # fmt: skip
        self.result = SimResult(strategy=getattr(strategy, "name", type(strategy).__name__), slo_ms=slo_ms)
        self._decide_s = 0.0

    # ------------------------------------------------------------------------------------------ running

    def run(self) -> SimResult:
        """Simulate every request to its last token; return the measurements."""
        t0 = time.perf_counter()
        self.env.process(self._arrivals())
        self.env.run()
        r = self.result
        r.sim_ms = self.env.now
        r.wall_s = time.perf_counter() - t0
        r.decide_s = self._decide_s
        return r

    def _arrivals(self) -> Generator[simpy.Event, Any, None]:
        env, res = self.env, self.result
        for req in self.requests:
            if req.arrival_ms > env.now:
                yield env.timeout(req.arrival_ms - env.now)
            res.requests += 1
            res.input_tokens += req.input_tokens
            if not self.view.nodes_for(req.model):
                res.failed += 1
                continue
            keys = block_keys(req)
            self.view.remember(req, keys)
            self.view.advance()
            t = time.perf_counter()
            decision = self.strategy.decide(req, self.view)
            dt = time.perf_counter() - t
            self._decide_s += dt
            res.decide_ms.append(dt * 1e3)
            if decision.node == "":  # refused (the tenant's route rules allow no node): it never runs
                res.rejected += 1
                self.view.forget(req)
                continue
            self._check(req, decision)
            job = Job(req, keys, decision.node)
            job.decision = decision
            planned = decision.fetches[-1].end if decision.fetches else 0
            self.engines[decision.node].admit(job, max(1, req.input_tokens - req.tokens_of(planned)))
            env.process(self._load(job, decision))
            for p in decision.prefetches:
                env.process(self._prefetch(job, p.tier, p.start, p.end))

    def _check(self, req: SimRequest, d: Decision) -> None:
        if self.node_model.get(d.node) != req.model:
            raise ValueError(f"strategy {self.result.strategy!r} sent request {req.rid} ({req.model}) to {d.node!r}")
        at = 0
        for f in d.fetches:
            if f.start != at or f.end <= f.start or f.end > req.blocks or f.tier not in TIERS:
                msg = f"contiguous non-empty ranges from block 0 within {req.blocks} blocks: {d.fetches}"
                raise ValueError(f"strategy {self.result.strategy!r}: fetches of request {req.rid} must be {msg}")
            if self.node_model.get(f.source_node) != req.model:
                raise ValueError(f"fetch from {f.source_node!r}, which does not serve {req.model}")
            at = f.end
        for p in d.prefetches:
            if not 0 <= p.start < p.end <= req.blocks or p.tier not in TIERS:
                raise ValueError(f"strategy {self.result.strategy!r}: prefetch {p} of request {req.rid} must be a "
                                 f"non-empty range within its {req.blocks} blocks from a known tier")

    # ------------------------------------------------------------------------------------------ loading

    def _load(self, job: Job, d: Decision) -> Generator[simpy.Event, Any, None]:
        loaded = 0
        for f in d.fetches:
            got = yield from self._fetch(job, f.source_node, f.tier, f.start, f.end)
            loaded += got
            if got < f.end - f.start:
                self.result.load_misses += 1
                self.result.load_miss_blocks += d.fetches[-1].end - loaded
                break
        job.cached_blocks = loaded
        cached = job.req.tokens_of(loaded)
        self.result.reused_tokens += min(cached, job.req.input_tokens - 1)
        self.engines[job.node].enqueue(job, max(1, job.req.input_tokens - cached))

    def _fetch(self, job: Job, src: str, tier: str, start: int, end: int) -> Generator[simpy.Event, Any, int]:
        """Load blocks [start, end) from `tier` of `src` into the job's node; return how many arrived."""
        env, res, req = self.env, self.result, job.req
        node = job.node
        here, there = self.hosts[self.node_host[node]], self.hosts[self.node_host[src]]
        local = here is there
        kind = f"{'local' if src == node else 'peer'}:{tier}"
        res.fetches_by_source[kind] = res.fetches_by_source.get(kind, 0) + 1
        depth = TIERS.index(tier)
        hbm, src_hbm = self.hbm[node], self.hbm[src]
        nbytes = self.profile.block_bytes(req.model)
        t0, moved, paid_latency = env.now, 0, False
        link_kind = "pcie" if local else "nic"
        for j in range(start, end):
            key = job.keys[j]
            if hbm.contains(key):
                hbm.touch(key)
                continue
            if src != node and src_hbm.contains(key):
                stages, hit = [[here.pcie] if local else [there.nic_out, here.nic_in]], src_hbm
            elif depth >= 1 and there.dram.contains(key):
                stages, hit = [[here.pcie] if local else [there.nic_out, here.nic_in]], there.dram
            elif depth >= 2 and there.disk.contains(key):
                stages, hit = [[there.disk_link], [here.pcie] if local else [there.nic_out, here.nic_in]], there.disk
                if local:
                    link_kind = "disk"
            else:
                return j - start  # gone: a load miss
            hit.touch(key)
            if not paid_latency:
                paid_latency = True
                yield env.timeout(sum(link.latency_ms for links in stages for link in links))
            for links in stages:
                yield from hold(env, links, nbytes)
                res.bytes_by_link[links[0].kind] = res.bytes_by_link.get(links[0].kind, 0) + nbytes
            moved += nbytes
            self._put(self.hbm[node], self._hbm_rep[node], key, req, j)
        if moved:
            self.strategy.observe_transfer(link_kind, moved, env.now - t0, source=src, tier=tier, node=node)
        return end - start

    def _prefetch(self, job: Job, tier: str, start: int, end: int) -> Generator[simpy.Event, Any, None]:
        """Background: blocks [start, end) from the node's host `tier` (or faster) into its hbm, over the links."""
        env, res, req, node = self.env, self.result, job.req, job.node
        host = self.hosts[self.node_host[node]]
        hbm = self.hbm[node]
        nbytes = self.profile.block_bytes(req.model)
        paid_latency = False
        for j in range(start, end):
            key = job.keys[j]
            if hbm.contains(key):
                continue
            if host.dram.contains(key):
                stages = [[host.pcie]]
            elif tier == "disk" and host.disk.contains(key):
                stages = [[host.disk_link], [host.pcie]]
            else:
                return  # gone: a prefix cannot skip a block
            if not paid_latency:  # once per prefetch, as for a fetch
                paid_latency = True
                yield env.timeout(sum(link.latency_ms for links in stages for link in links))
            for links in stages:
                yield from hold(env, links, nbytes)
                res.bytes_by_link[links[0].kind] = res.bytes_by_link.get(links[0].kind, 0) + nbytes
            self._put(hbm, self._hbm_rep[node], key, req, j)
            res.prefetched_blocks += 1

    # ------------------------------------------------------------------------------------------ tiers

    def _put(self, tier: BlockTier, replica: int, key: Hashable, req: SimRequest, j: int) -> None:
        """Write a block into a tier: a write, not a read.

        A held block is put again, as engines and the kernel's writer do (an LRU tier makes it the most recent).
        """
        held = tier.contains(key)
        meta = BlockMeta(req.model, req.tenant, req.hash_ids[j], j, min(req.block_tokens, req.input_tokens
                         - j * req.block_tokens), self.profile.block_bytes(req.model),
                         req.hash_ids[j - 1] if j else None)  # fmt: skip
        view = self.view
        for old in tier.insert(key, meta):
            view.log(replica, old, False)
        if not held and tier.contains(key):
            view.log(replica, key, True)

    def _first_token(self, job: Job) -> None:
        req, node = job.req, job.node
        now = self.env.now
        job.ttft_ms = now - req.arrival_ms
        self.result.ttft_ms.append(job.ttft_ms)
        host = self.hosts[self.node_host[node]]
        hbm, hrep = self.hbm[node], self._hbm_rep[node]
        drep, krep = self._dram_rep[host.name], self._disk_rep[host.name]
        for j, key in enumerate(job.keys):
            self._put(hbm, hrep, key, req, j)
            self._put(host.dram, drep, key, req, j)
            self._put(host.disk, krep, key, req, j)
        self.strategy.observe_done(req, node, job.ttft_ms)

    def _finish(self, job: Job) -> None:
        self.result.completed += 1
        self.view.forget(job.req)
