"""Trace replay: a Mooncake-format trace through one embedded kernel and a simulated engine, against baselines.

Trace lines are `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}` with prefix block
ids of `block_tokens` (512) tokens. The simulated engine takes its times from the cost profile: TTFT = lookup +
transfers (each tier a FIFO link, so loads queue behind each other) + mount + prefill of what was not restored.
Strategies run on separate kernels with identical tiers: NexusKV (`kernel.plan`), never reuse, and always reuse
every hit (what LMCache and vLLM do). `generate` writes synthetic workloads in the same format.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from attrs import define, field

from nexuskv.contracts import Layout, ModelIdentity, PlanAction, Request, StateGroup, TokenizerIdentity
from nexuskv.cost import CostModel
from nexuskv.errors import ContractError

__all__ = ["ReplayResult", "TraceRecord", "generate", "read_trace", "replay", "write_trace"]

BLOCK_TOKENS = 512
STRATEGIES = ("nexuskv", "never", "always")


@define(frozen=True)
class TraceRecord:
    """One request of a trace."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = field(converter=tuple)


def read_trace(path: str | Path) -> Iterator[TraceRecord]:
    """Records of a JSONL trace; a malformed line is a `ContractError` naming file and line."""
    with Path(path).open() as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
                rec = TraceRecord(float(d["timestamp"]), int(d["input_length"]), int(d.get("output_length", 0)),
                                  [int(h) for h in d["hash_ids"]])  # fmt: skip
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ContractError("trace", [(where, f"{type(exc).__name__}: {exc}")]) from None
            if rec.input_length <= 0 or len(rec.hash_ids) != -(-rec.input_length // BLOCK_TOKENS):
                msg = f"{len(rec.hash_ids)} hash_ids do not cover input_length {rec.input_length}"
                raise ContractError("trace", [(where, f"{msg} in {BLOCK_TOKENS}-token blocks")])
            yield rec


def write_trace(records: Iterable[TraceRecord], path: str | Path) -> int:
    """Write records as JSONL; return how many."""
    n = 0
    with Path(path).open("w") as fh:
        for r in records:
            fh.write(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                 "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")  # fmt: skip
            n += 1
    return n


def generate(n: int = 400, *, seed: int = 0, mix: Mapping[str, float] | None = None,
             rate_per_s: float = 4.0) -> list[TraceRecord]:  # fmt: skip
    """A synthetic workload: multi-turn chat, RAG over shared documents, agent loops and unique prompts.

    - chat: sessions of 2-8 turns; each turn's prompt is the whole history plus a new message;
    - rag: one of 20 shared documents (4-16 blocks) followed by a unique question;
    - agent: a long shared tool prompt, then a loop whose context grows by 1-2 blocks per step;
    - unique: prompts sharing nothing.
    Arrivals are Poisson at `rate_per_s`; the turns of one conversation keep their order.
    """
    rng = random.Random(seed)
    mix = dict(mix or {"chat": 0.35, "rag": 0.3, "agent": 0.15, "unique": 0.2})
    next_id = iter(range(10**12))
    docs = [[next(next_id) for _ in range(rng.randint(4, 16))] for _ in range(20)]
    tools = [next(next_id) for _ in range(12)]
    live: list[tuple[str, list[int], int]] = []  # (kind, context blocks, turns left)
    out: list[TraceRecord] = []
    t = 0.0
    kinds, weights = list(mix), list(mix.values())
    while len(out) < n:
        t += rng.expovariate(rate_per_s) * 1000
        if live and rng.random() < 0.6:
            i = rng.randrange(len(live))
            kind, ctx, left = live[i]
            ctx = ctx + [next(next_id) for _ in range(rng.randint(1, 2))]
            if left > 1:
                live[i] = (kind, ctx, left - 1)
            else:
                live.pop(i)
        else:
            kind = rng.choices(kinds, weights)[0]
            if kind == "chat":
                ctx = [next(next_id) for _ in range(rng.randint(2, 6))]
                live.append((kind, ctx, rng.randint(1, 7)))
            elif kind == "agent":
                ctx = tools + [next(next_id) for _ in range(rng.randint(1, 3))]
                live.append((kind, ctx, rng.randint(3, 10)))
            elif kind == "rag":
                ctx = [*rng.choice(docs), next(next_id)]
            else:
                ctx = [next(next_id) for _ in range(rng.randint(2, 40))]
        tail = rng.randint(1, BLOCK_TOKENS)
        out.append(TraceRecord(round(t), (len(ctx) - 1) * BLOCK_TOKENS + tail, rng.randint(1, 400), ctx))
    return out


# ------------------------------------------------------------------------------------------------ simulation


@define
class _Link:
    bandwidth: float  # bytes per second
    latency_ms: float
    busy_until: float = 0.0  # ms

    def inflight(self, now: float) -> float:
        return max(0.0, self.busy_until - now) * self.bandwidth / 1e3

    def transfer(self, now: float, nbytes: float) -> float:
        """Finish time (ms) of a transfer queued at `now`."""
        start = max(now, self.busy_until)
        self.busy_until = start + self.latency_ms + nbytes / self.bandwidth * 1e3
        return self.busy_until


@define
class ReplayResult:
    """Per-strategy outcome of a replay."""

    strategy: str
    ttft_ms: list[float] = field(factory=list)
    tokens_total: int = 0
    tokens_reused: int = 0
    bytes_moved: float = 0.0
    actions: dict[str, int] = field(factory=dict)

    @property
    def mean_ttft_ms(self) -> float:
        """Mean simulated TTFT."""
        return statistics.fmean(self.ttft_ms) if self.ttft_ms else 0.0

    @property
    def p90_ttft_ms(self) -> float:
        """90th percentile of simulated TTFT."""
        return statistics.quantiles(self.ttft_ms, n=10)[-1] if len(self.ttft_ms) >= 10 else self.mean_ttft_ms

    @property
    def hit_ratio(self) -> float:
        """Reused tokens / prompt tokens."""
        return self.tokens_reused / self.tokens_total if self.tokens_total else 0.0


def _tokens(rec: TraceRecord) -> list[int]:
    """Synthetic token ids: block j of hash id h is (h * 512 + t) for t < 512, so equal ids give equal tokens."""
    out: list[int] = []
    for j, h in enumerate(rec.hash_ids):
        n = min(BLOCK_TOKENS, rec.input_length - j * BLOCK_TOKENS)
        base = (h * BLOCK_TOKENS) % (2**32 - BLOCK_TOKENS)
        out.extend(range(base, base + n))
    return out


def _kernel(profile_path: str, tiers: Mapping[str, int], scale: Mapping[str, float],
            policies: str | None, secret: bytes, eviction: str = "cost") -> Any:  # fmt: skip
    from nexuskv.kernel import Kernel, KernelConfig

    cfg = KernelConfig(node="replay", page_size=BLOCK_TOKENS, profile=profile_path, policies=policies,
                       tiers={t: {"store": "dram", "capacity_bytes": c} for t, c in tiers.items()},
                       bandwidth_scale=dict(scale), deadline_ms=1000.0, writer_max_items=1 << 16,
                       writer_max_bytes=1 << 30, prefetch_max_tasks=0, eviction=eviction)  # fmt: skip
    return Kernel(cfg, secret=secret)


def replay(
    records: Sequence[TraceRecord],
    *,
    profile_path: str,
    tier_blocks: Mapping[str, int],
    bandwidth_scale: Mapping[str, float] | None = None,
    policies: str | None = None,
    strategies: Sequence[str] = STRATEGIES,
    payload_bytes: int = 64,
    eviction: str = "cost",
) -> dict[str, ReplayResult]:
    """Replay `records` under each strategy; tiers hold `tier_blocks[tier]` blocks.

    Payloads are scaled down to `payload_bytes` per block: the simulation accounts capacity in blocks, and its
    times come from the profile.
    """
    scale = dict(bandwidth_scale or {})
    secret = bytes(range(32))
    results: dict[str, ReplayResult] = {}
    for strategy in strategies:
        kernel = _kernel(profile_path, {t: n * payload_bytes for t, n in tier_blocks.items()}, scale,
                         policies, secret, eviction)  # fmt: skip
        try:
            results[strategy] = _run(kernel, strategy, records, scale, payload_bytes)
        finally:
            kernel.close()
    return results


def _run(kernel: Any, strategy: str, records: Sequence[TraceRecord], scale: Mapping[str, float],
         payload_bytes: int) -> ReplayResult:  # fmt: skip
    cost: CostModel = kernel.cost
    links = {t: _Link(cost.profile.tiers[t].bandwidth_bytes_per_s * scale.get(t, 1.0),
                      cost.profile.tiers[t].latency_ms) for t in kernel.tier_order}  # fmt: skip
    layout = Layout(groups=[StateGroup(kind="dense", layers=32, kv_heads=8, head_dim=128)], page_size=BLOCK_TOKENS)
    model = ModelIdentity(name=cost.profile.model, revision="replay")
    tok = TokenizerIdentity(name="replay")
    block_bytes = cost.bytes_per_token * BLOCK_TOKENS
    res = ReplayResult(strategy)
    for i, rec in enumerate(records):
        now = rec.timestamp
        req = Request(request_id=f"r{i}", tenant="trace", model=model, tokenizer=tok, layout=layout,
                      token_ids=_tokens(rec))  # fmt: skip
        keys = kernel.keys(req)
        runs: list[tuple[int, int, str]] = []
        if strategy == "nexuskv":
            kernel.link_load = {t: link.inflight(now) for t, link in links.items()}
            plan = kernel.plan(req, keys=keys)
            if plan.action == PlanAction.MATERIALIZE:
                runs = [(s.start // BLOCK_TOKENS, s.end // BLOCK_TOKENS, s.tier) for s in plan.spans]
            res.actions[plan.action.value] = res.actions.get(plan.action.value, 0) + 1
        elif strategy == "always":
            cands = kernel.planner.candidates(req, kernel.index.match(keys, layout), node=kernel.node)
            longest = max(cands, key=lambda c: c.blocks)
            runs = [(f, e, t) for f, e, t, _ in longest.sources]
        reused = runs[-1][1] * BLOCK_TOKENS if runs else 0
        finish = now
        for f, e, t in runs:  # sequential loads, each queued on its tier's link
            finish = links[t].transfer(finish, (e - f) * block_bytes)
            res.bytes_moved += (e - f) * block_bytes
        load_ms = (finish - now) + (cost.lookup_ms() + cost.mount_ms(reused // BLOCK_TOKENS) if runs else 0.0)
        res.ttft_ms.append(load_ms + cost.prefill_ms(len(req.token_ids), reused))
        res.tokens_total += len(req.token_ids)
        res.tokens_reused += reused
        kernel.commit(req, [b"\0" * payload_bytes] * len(keys), keys=keys)
        kernel.flush()
    return res


def summary(results: Mapping[str, ReplayResult]) -> str:
    """A table of the strategies side by side."""
    lines = [f"{'strategy':<10} {'requests':>8} {'hit ratio':>9} {'mean TTFT ms':>12} {'p90 TTFT ms':>11} "
             f"{'GB moved':>9}  actions"]  # fmt: skip
    for name, r in results.items():
        acts = ", ".join(f"{k} {v}" for k, v in sorted(r.actions.items()))
        lines.append(f"{name:<10} {len(r.ttft_ms):>8} {r.hit_ratio:>9.3f} {r.mean_ttft_ms:>12.1f} "
                     f"{r.p90_ttft_ms:>11.1f} {r.bytes_moved / 1e9:>9.1f}  {acts}")  # fmt: skip
    return "\n".join(lines)
