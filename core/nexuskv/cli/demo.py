"""The `nexuskv demo` walk-through of what the kernel does today, printed as it happens."""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs

from nexuskv.contracts import Layout, ModelIdentity, Request, StateGroup, StateKind, TokenizerIdentity
from nexuskv.kernel import Kernel, KernelConfig
from nexuskv.resources import shipped

PAGE = 16
BYTES_PER_TOKEN = 2048  # tiny Llama-style GQA model, fp16 (DESIGN.md)


def _request(rid: str, tenant: str, tokens: list[int], layout: Layout, revision: str = "r1") -> Request:
    return Request(
        request_id=rid,
        tenant=tenant,
        model=ModelIdentity(name="tiny-llama", revision=revision, dtype="float16"),
        tokenizer=TokenizerIdentity(name="tiny-bpe", revision="1"),
        layout=layout,
        token_ids=tokens,
    )


def _commit(kernel: Kernel, request: Request, group: int = 0, every: int = 1, prefix_first: bool = False) -> int:
    """Store state for the request's full blocks (every `every`-th block for checkpointed kinds).

    `prefix_first` gives deeper blocks lower eviction priority; the store keeps the prefix either way.
    """
    keys = kernel.keys(request)
    stored = 0
    for b in range(len(keys)):
        if (b + 1) % every:
            continue
        payload = random.randbytes(PAGE * BYTES_PER_TOKEN // 64)
        desc = kernel.describe(request, b, payload, tier="dram", group=group, keys=keys)
        stored += kernel.put(desc, payload, priority=-b if prefix_first else 0.0)
    return stored


def run_demo(turns: int = 4, echo: Callable[[str], None] = print, seed: int = 7, requests: int = 300) -> dict[str, int]:
    """Run the walk-through; return the headline numbers (for tests)."""
    random.seed(seed)
    out: dict[str, int] = {}
    cfg = KernelConfig(node="node-a", tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})
    with Kernel(cfg, secret=random.randbytes(32)) as kernel:
        dense = Layout(groups=[StateGroup(kind=StateKind.DENSE, layers=4, kv_heads=2, head_dim=64)], page_size=PAGE)
        echo("== 1. A multi-turn chat session (tenant acme): each turn reuses the blocks of the last ==")
        echo(f"{'turn':>4} {'prompt':>7} {'blocks':>6} {'matched':>7} {'reusable tokens':>15} "
             f"{'new blocks stored':>17}")
        history: list[int] = [random.randrange(32000) for _ in range(200)]  # system prompt + first question
        for turn in range(1, turns + 1):
            req = _request(f"acme-{turn}", "acme", history, dense)
            match = kernel.match(req)
            reused = match.tokens()
            stored = _commit(kernel, req)
            echo(f"{turn:>4} {len(history):>7} {len(req.token_ids) // PAGE:>6} {match.longest():>7} "
                 f"{reused:>15} {stored - match.longest():>17}")  # fmt: skip
            out[f"turn{turn}_reused"] = reused
            history += [random.randrange(32000) for _ in range(random.randrange(60, 140))]  # answer + next question

        echo("\n== 2. Isolation by construction: the same tokens under another identity match nothing ==")
        last = _request("probe", "acme", history, dense)
        cases = {
            "same tenant, same model": last,
            "tenant globex": _request("g", "globex", history, dense),
            "model revision r2": _request("r2", "acme", history, dense, revision="r2"),
            "cache salt 'x'": attrs.evolve(last, cache_salt="x"),
        }
        for label, req in cases.items():
            n = kernel.match(req).tokens()
            out[label] = n
            echo(f"  {label:<26} reusable tokens: {n}")

        echo("\n== 3. Valid restore points per state kind (same 40-block prompt, state saved as noted) ==")
        tokens = [random.randrange(32000) for _ in range(40 * PAGE + 5)]
        kinds = {
            "dense (every page)": (Layout(groups=[StateGroup(kind="dense", layers=2)]), [(0, 1, 30)]),
            "latent MLA (every page)": (Layout(groups=[StateGroup(kind="latent", layers=2, latent_dim=64)]),
                                        [(0, 1, 40)]),
            "windowed (ckpt every 8)": (Layout(groups=[StateGroup(kind="windowed", layers=2, window=64)]),
                                        [(0, 8, 40)]),
            "recurrent (ckpt every 16)": (Layout(groups=[StateGroup(kind="recurrent", layers=2)]), [(0, 16, 40)]),
            "hybrid dense+recurrent": (
                Layout(groups=[StateGroup(kind="dense", layers=2), StateGroup(kind="recurrent", layers=2)]),
                [(0, 1, 36), (1, 12, 40)],
            ),
        }  # fmt: skip
        for label, (layout, saves) in kinds.items():
            req = _request(f"k-{label}", "acme", tokens, layout)
            for group, every, upto in saves:
                _commit(kernel, _request("w", "acme", tokens[: upto * PAGE], layout), group=group, every=every)
            n = kernel.match(req).longest()
            out[label] = n
            echo(f"  {label:<26} longest valid restore point: block {n:>2} = token {n * PAGE}")

        echo("\n== 4. Holdings per tier and node (index kept exact across evictions) ==")
        for loc, blocks in kernel.index.holdings().items():
            echo(f"  {loc.tier}@{loc.node} epoch {loc.epoch}: {blocks} blocks")
        store = kernel.tiers["dram"]
        echo(f"  dram: {store.used_bytes() / 2**20:.1f} MiB used of {store.capacity_bytes / 2**20:.0f} MiB, "
             f"{len(kernel.index)} blocks indexed")  # fmt: skip

    echo("\n== 5. A small DRAM tier under pressure: the prefix stays whatever the priorities, the index exact ==")
    page_bytes = PAGE * BYTES_PER_TOKEN // 64
    small = KernelConfig(node="node-b", tiers={"dram": {"store": "dram", "capacity_bytes": 24 * page_bytes}})
    with Kernel(small, secret=random.randbytes(32)) as kernel:
        req = _request("big", "acme", [random.randrange(32000) for _ in range(40 * PAGE)], dense)
        store = kernel.tiers["dram"]
        for label, prefix_first in (("equal priorities", False), ("deeper blocks first", True)):
            for slot in list(store.slots()):
                store.delete(slot)
                kernel.index.remove(slot[:-1])
            store.evictions = 0
            stored = _commit(kernel, req, prefix_first=prefix_first)
            longest = kernel.match(req).longest()
            out[f"evictions {label}"] = store.evictions
            out[f"refused {label}"] = 40 - stored
            out[f"indexed {label}"] = len(kernel.index)
            out[f"longest {label}"] = longest
            echo(f"  {label:<20} 40 blocks into room for 24: {store.evictions} evicted, {40 - stored} refused, "
                 f"{len(store)} held, "
                 f"{len(kernel.index)} indexed, longest reusable prefix {longest} blocks")

    _decisions(echo, out)
    _simulate(echo, out, requests)
    return out




def _decisions(echo: Callable[[str], None], out: dict[str, int]) -> None:
    """Section 6: the planner and the tenant policies deciding, with their reasons."""
    echo("\n== 6. Plans: reuse only when it pays, as each tenant's policy allows ==")
    cfg = KernelConfig(node="node-a", policies=str(shipped("policies")),
                       tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"},
                              "disk": {"store": "dram", "capacity_bytes": "256MiB"}})  # fmt: skip
    dense = Layout(groups=[StateGroup(kind=StateKind.DENSE, layers=4, kv_heads=2, head_dim=64)], page_size=PAGE)
    with Kernel(cfg, secret=random.randbytes(32)) as k:
        for tenant, scope in (("chat", ""), ("strict", ""), ("rag", "docs")):
            toks = [random.randrange(32000) for _ in range(64 * PAGE)]
            req = Request(request_id=f"{tenant}-1", tenant=tenant, scope=scope,
                          model=ModelIdentity(name="tiny-llama", revision="r1"),
                          tokenizer=TokenizerIdentity(name="tiny-bpe"), layout=dense, token_ids=toks)  # fmt: skip
            keys = k.keys(req)
            k.commit(req, [random.randbytes(PAGE * BYTES_PER_TOKEN) for _ in keys], keys=keys)
            k.flush(10)
            plan = k.plan(req, keys=keys)
            out[f"plan {tenant}"] = plan.tokens_reused
            echo(f"  {tenant:<7} {plan.action.value:<11} reuse {plan.tokens_reused:>5} of {plan.tokens_total} tokens"
                 f"  predicted TTFT {plan.predicted.ttft_ms:8.1f} ms  rules {list(plan.rules)}")  # fmt: skip
            for reason in plan.reasons:
                echo(f"           why: {reason}")
        question = attrs.evolve(req, request_id="chat-q", tenant="chat", scope="",
                                token_ids=[*req.token_ids, *(random.randrange(32000) for _ in range(40))])
        for reader in ("chat", "globex"):
            plan = k.plan(attrs.evolve(question, tenant=reader))
            out[f"shared to {reader}"] = plan.tokens_reused
            echo(f"  {reader} asks about rag's document: {plan.action.value}, reuse {plan.tokens_reused} tokens"
                 f"  ({plan.reasons[0]})")  # fmt: skip
        req = attrs.evolve(req, request_id="rag-2", token_ids=[random.randrange(32000) for _ in range(64 * PAGE)])
        keys = k.keys(req)
        k.commit(req, [random.randbytes(PAGE * BYTES_PER_TOKEN) for _ in keys], keys=keys)
        k.flush(10)
        k.bandwidth_scale = {"disk": 1e-4}  # a badly congested disk: loading loses to recomputing
        plan = k.plan(req, keys=keys)
        out["plan congested"] = plan.tokens_reused
        echo(f"  rag with its disk congested: {plan.action.value}, reuse {plan.tokens_reused} tokens")
        for reason in plan.reasons[1:]:
            echo(f"           why: {reason}")


def _simulate(echo: Callable[[str], None], out: dict[str, int], requests: int) -> None:
    """Section 7: a generated workload on a simulated 4-node cluster, NexusKV against re-implemented routers.

    The other routers are nexuskv-sim's re-implementations of published routers' policies, not the routers themselves.
    """
    try:
        from nexuskv_sim.metrics import summary
        from nexuskv_sim.nexus import NexusKVStrategy
        from nexuskv_sim.profile import default_profile
        from nexuskv_sim.simulate import simulate
        from nexuskv_sim.trace import generate
    except ImportError:  # pragma: no cover - make setup installs every plugin
        echo("\n== 7. Cluster simulation skipped: the nexuskv-sim plugin is not installed ==")
        return
    echo(f"\n== 7. A simulated 4-node cluster ({requests} requests: chat, RAG, agents, unique prompts) ==")
    echo("   ground truth: nexuskv_sim (simpy; its own hardware profile); NexusKV sees delayed reports and what it "
         "measures")  # fmt: skip
    echo("   sglang, llm-d, mooncake: the simulator's re-implementations of those routers' published policies, not "
         "the routers themselves")  # fmt: skip
    records = generate(requests, seed=11, rate_per_s=8.0)
    for label, congested in (("normal links", False), ("congested NIC and disk (5% bandwidth)", True)):
        nexus = NexusKVStrategy(default_profile())
        try:
            res = simulate(records, ["never", "sglang", "llm-d", "mooncake", nexus], nodes=4, congested=congested)
        finally:
            nexus.close()
        best = min(r.mean_ttft_ms for name, r in res.items() if name != "nexuskv")
        out[f"sim {label}"] = int(1000 * res["nexuskv"].mean_ttft_ms / best)
        echo(f"  -- {label}")
        for line in summary(res).splitlines():
            echo(f"  {line}")
        echo(f"  NexusKV mean TTFT / best other router: {res['nexuskv'].mean_ttft_ms / best:.3f}")
