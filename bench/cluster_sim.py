"""Routers side by side on the cluster simulator, cost-aware eviction against LRU, and the eviction hit ratio.

Run: `.venv/bin/python bench/cluster_sim.py ../shared/traces/mooncake_synthetic_trace.jsonl` (about 10 minutes
here). Three parts:

1. Every router (never-reuse, round robin, SGLang cache-aware, Dynamo KV, llm-d, Mooncake Conductor, NexusKV) on
   the trace at 4 and 8 nodes, normal and congested links (NIC and disk at 5%): mean / p90 / p99 TTFT, SLO
   attainment, hit ratio, bytes moved; a TTFT plot per run in docs/img/. The simulator (`nexuskv_sim`) is the
   ground truth; NexusKV sees only delayed reports and what it measured (see plugins/nexuskv-sim/README.md). The
   routers other than NexusKV are the simulator's re-implementations of the published policies (the plugin's
   README, "Baselines"), not the routers themselves.
   Also printed: the lower bound of each figure (every reusable token free, no queueing, no transfer).
2. The mixed-model trace (`nexuskv gen-trace --mixed`, 3,000 requests, seed 1): NexusKV routing with the
   kernel's own store evicting by its default (cost-aware) priority against the same store evicting LRU; six
   nodes on two hosts, each host running one engine of each model and sharing its dram (32 GiB) and disk
   (128 GiB).
3. The eviction hit ratio: always-reuse through a real kernel with one DRAM tier of 4,000 blocks over the trace
   (every hit read through the store, every block committed), default eviction against LRU.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attrs

from _common import QUICK, quick, result
from nexuskv import configure_logging
from nexuskv_sim.calibrate import measured_profile
from nexuskv_sim.kvtier import KernelTier
from nexuskv_sim.metrics import summary
from nexuskv_sim.nexus import NexusKVStrategy
from nexuskv_sim.profile import default_profile
from nexuskv_sim.simulate import plot_ttft, simulate
from nexuskv_sim.trace import generate, generate_mixed, read_trace, token_ids, write_trace

RESULTS = ("sim.nexuskv_mean_ttft_over_best_router", "sim.nexuskv_p99_ttft_over_best_router",
           "sim.cost_eviction_over_lru_ttft_mixed", "eviction.default_over_lru_hit_ratio_4k")
ROOT = Path(__file__).resolve().parents[1]
IMG = Path(tempfile.mkdtemp(prefix="nexuskv-sim-plots-")) if QUICK else ROOT / "docs" / "img"  # quick: not the docs'
BASELINES = ("never", "round-robin", "sglang", "dynamo", "llm-d", "mooncake")


def lower_bound(records: list, profile: object) -> tuple[float, float]:
    """Mean and p99 TTFT if every token seen before were free and nothing queued (no router can beat it)."""
    seen: set = set()
    out = []
    for r in records:
        m = profile.model(profile.default_model if r.model == "default" else r.model)  # type: ignore[attr-defined]
        n = 0
        for h in r.hash_ids:
            if (r.model, r.tenant, h) not in seen:
                break
            n += 1
        seen.update((r.model, r.tenant, h) for h in r.hash_ids)
        cached = min(n * 512, r.input_length - 1)
        out.append(m.prefill_alone_ms(r.input_length - cached, cached, profile.chunk_tokens))  # type: ignore[attr-defined]
    out.sort()
    return sum(out) / len(out), out[min(len(out) - 1, int(0.99 * len(out)))]


def routers(records: list, limit_note: str) -> dict:
    ratios = {}
    base = default_profile()
    lb_mean, lb_p99 = lower_bound(records, base)
    print(f"lower bound (all reuse free, no queueing): mean {lb_mean:.0f} ms, p99 {lb_p99:.0f} ms")
    for nodes, congested in itertools.product((4, 8), (False, True)):
        label = f"{nodes} nodes, {'congested' if congested else 'normal'} links"
        t0 = time.perf_counter()
        nexus = NexusKVStrategy(base)
        try:
            res = simulate(records, [*BASELINES, nexus], nodes=nodes, congested=congested)
        finally:
            nexus.close()
        print(f"\n== {label}{limit_note} ({time.perf_counter() - t0:.0f} s)\n{summary(res)}")
        best = min((r for n, r in res.items() if n != "nexuskv"), key=lambda r: r.mean_ttft_ms)
        best_p99 = min((r for n, r in res.items() if n != "nexuskv"), key=lambda r: r.p99_ttft_ms)
        nx = res["nexuskv"]
        ratios[(nodes, congested)] = (nx.mean_ttft_ms / best.mean_ttft_ms, nx.p99_ttft_ms / best_p99.p99_ttft_ms)
        print(f"NexusKV / best router: mean {ratios[(nodes, congested)][0]:.3f} (best {best.strategy}), "
              f"p99 {ratios[(nodes, congested)][1]:.3f} (best {best_p99.strategy})")  # fmt: skip
        IMG.mkdir(parents=True, exist_ok=True)
        name = f"sim_{nodes}n_{'congested' if congested else 'normal'}.png"
        plot_ttft(res, IMG / name, title=f"TTFT, shared synthetic trace, {label}")
        print(f"plot: {_shown(IMG / name)}")
    return ratios


def mixed_eviction(n: int) -> float:
    base = default_profile()
    records = generate_mixed(n, seed=1)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
        write_trace(records, fh.name)
    records = list(read_trace(fh.name))
    prof = attrs.evolve(base, dram_bytes=32 << 30, disk_bytes=128 << 30)
    profiles = {m: measured_profile(base, m) for m in sorted({r.model for r in records})}
    out = {}
    for ev in ("lru", "cost"):
        def tiers(host: str, tier: str, cap: int, ev: str = ev) -> KernelTier:
            # as in the kernel: the DRAM store counts reads, the disk store orders by priority alone
            return KernelTier(f"{host}/{tier}", cap, profiles, eviction=ev, count_reads=tier == "dram")

        nexus = NexusKVStrategy(base, name=f"nexuskv, {ev} eviction")
        try:
            out.update(simulate(records, [nexus], nodes=6, engines_per_host=3, profile=prof, tier_factory=tiers))
        finally:
            nexus.close()
    print(f"\n== mixed-model trace ({n} requests; 6 nodes on 2 hosts; dram 32 GiB, disk 128 GiB per host)")
    print(summary(out))
    plot_ttft(out, IMG / "sim_mixed_eviction.png", title="TTFT, mixed-model trace: cost-aware vs LRU eviction")
    print(f"plot: {_shown(IMG / 'sim_mixed_eviction.png')}")
    return out["nexuskv, cost eviction"].mean_ttft_ms / out["nexuskv, lru eviction"].mean_ttft_ms


def _shown(path: Path) -> str:
    """A plot's path as printed: relative to the repository when it is in it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def hit_ratio(trace: str, blocks: int, eviction: str, limit: int | None, hybrid: bool = False) -> float:
    """Always-reuse through a real kernel, one DRAM tier of `blocks` 512-token blocks: token hit ratio.

    `hybrid`: an attention + SSM model (a dense group and a recurrent group with a 16-byte checkpoint at every
    block, next to each 64-byte page): a cut needs every page before it and the checkpoint at it.
    """
    from nexuskv import Kernel, KernelConfig, Layout, ModelIdentity, Request, StateGroup, TokenizerIdentity

    payload = 64
    cfg = KernelConfig(node="n", page_size=512, tiers={"dram": {"store": "dram", "capacity_bytes": blocks * payload}},
                       deadline_ms=1000.0, writer_max_items=1 << 16, writer_max_bytes=1 << 30, prefetch_max_tasks=0,
                       eviction=eviction)  # fmt: skip
    groups = [StateGroup(kind="dense", layers=32, kv_heads=8, head_dim=128)]
    if hybrid:
        groups.append(StateGroup(kind="recurrent", layers=16, latent_dim=4096))
    layout = Layout(groups=groups, page_size=512)
    model, tok = ModelIdentity(name="m", revision="1"), TokenizerIdentity(name="t")
    total = hit = 0
    with Kernel(cfg, secret=bytes(range(32))) as k:
        for i, rec in enumerate(itertools.islice(read_trace(trace), limit)):
            tokens = token_ids(rec.hash_ids, rec.input_length)
            req = Request(request_id=f"r{i}", tenant="t", model=model, tokenizer=tok, layout=layout, token_ids=tokens)
            keys = k.keys(req)
            n = k.match(req, keys).longest(tier="dram")
            got = 0
            for key in keys[:n]:  # always-reuse: read every held block (the store sees the hit)
                if k.load(key, tier="dram") is None:
                    break
                got += 1
            if hybrid and got and k.load(keys[got - 1], group=1, tier="dram") is None:
                got = 0  # the checkpoint at the cut went missing: nothing restores
            hit += min(got * 512, len(tokens))
            total += len(tokens)
            if hybrid:
                k.commit(req, {(b, g): b"\0" * (payload if g == 0 else 16) for b in range(len(keys)) for g in (0, 1)},
                         keys=keys)  # fmt: skip
            else:
                k.commit(req, [b"\0" * payload] * len(keys), keys=keys)
            k.flush()
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    # quick mode: the trace may be left out (a small synthetic one is made), and every part runs on a few requests
    ap.add_argument("trace", nargs=quick(None, "?"))
    ap.add_argument("--limit", type=int, default=quick(None, 40), help="Only the first N requests (a quick look).")
    ap.add_argument("--mixed-requests", type=int, default=quick(3000, 40))
    args = ap.parse_args()
    if args.trace is None:
        args.trace = str(IMG / "trace.jsonl")
        write_trace(generate(args.limit, seed=1), args.trace)
    configure_logging(level="warning", force=True)
    records = list(itertools.islice(read_trace(args.trace), args.limit))
    note = f" (first {args.limit} requests)" if args.limit else ""
    print(f"{len(records)} requests from {args.trace}")
    ratios = routers(records, note)
    mixed = mixed_eviction(args.mixed_requests)
    hr = {ev: hit_ratio(args.trace, 4000, ev, args.limit) for ev in ("cost", "lru")}
    print(f"\n== eviction, always-reuse, one DRAM tier of 4,000 blocks: token hit ratio default {hr['cost']:.4f}, "
          f"LRU {hr['lru']:.4f}")  # fmt: skip
    hy = {ev: hit_ratio(args.trace, 4000, ev, args.limit, hybrid=True) for ev in ("cost", "lru")}
    print(f"   hybrid attention + SSM (checkpoints all-or-nothing): default {hy['cost']:.4f}, LRU {hy['lru']:.4f} "
          f"({hy['cost'] / hy['lru']:.3f}x)")  # fmt: skip
    for (nodes, congested), (m, p) in sorted(ratios.items()):
        links = "congested" if congested else "normal"
        print(f"NexusKV / best router, {nodes} nodes {links}: mean {m:.3f}, p99 {p:.3f}")
    result("sim.nexuskv_mean_ttft_over_best_router", ratios[(8, False)][0], "<=", 0.9)
    result("sim.nexuskv_p99_ttft_over_best_router", ratios[(8, False)][1], "<=", 0.9)
    result("sim.cost_eviction_over_lru_ttft_mixed", mixed, "<=", 0.95)
    result("eviction.default_over_lru_hit_ratio_4k", hr["cost"] / hr["lru"], ">=", 1.06)
    if QUICK:
        shutil.rmtree(IMG, ignore_errors=True)


if __name__ == "__main__":
    main()
