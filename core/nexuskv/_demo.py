"""Private: the `nexuskv demo` walk-through of what the kernel does today, printed as it happens."""

from __future__ import annotations

import random
from collections.abc import Callable

from nexuskv.contracts import Layout, ModelIdentity, Request, StateGroup, StateKind, TokenizerIdentity
from nexuskv.kernel import Kernel, KernelConfig

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

    `prefix_first` gives deeper blocks lower eviction priority, so a full tier drops tails, not heads.
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


def run_demo(turns: int = 4, echo: Callable[[str], None] = print, seed: int = 7) -> dict[str, int]:
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
            "cache salt 'x'": Request(**{**_fields(last), "cache_salt": "x"}),
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

    echo("\n== 5. A small DRAM tier under pressure: evictions call back, the index follows exactly ==")
    page_bytes = PAGE * BYTES_PER_TOKEN // 64
    small = KernelConfig(node="node-b", tiers={"dram": {"store": "dram", "capacity_bytes": 24 * page_bytes}})
    with Kernel(small, secret=random.randbytes(32)) as kernel:
        req = _request("big", "acme", [random.randrange(32000) for _ in range(40 * PAGE)], dense)
        store = kernel.tiers["dram"]
        for label, prefix_first in (("plain LRU", False), ("deeper blocks first", True)):
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
    return out


def _fields(req: Request) -> dict[str, object]:
    import attrs

    return {f.name: getattr(req, f.name) for f in attrs.fields(Request)}
