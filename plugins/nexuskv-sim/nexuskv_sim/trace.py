"""Mooncake-format traces: reading, writing and generating them (single-model and mixed-model workloads).

A line is `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}` with prefix block ids of
`BLOCK_TOKENS` (512) tokens: equal ids at the same position mean the same prefix, the last block may be partial.
Optional `model` and `tenant` fields (default "default") name the model a request needs and the tenant it
belongs to; tenants never share state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from attrs import define, field

from nexuskv import ContractError

__all__ = ["BLOCK_TOKENS", "TraceRecord", "generate", "generate_mixed", "read_trace", "scale", "token_ids",
           "write_trace"]

BLOCK_TOKENS = 512
DEFAULT = "default"
MIXED_MODELS = {"llama-8b": 0.6, "qwen-moe-30b": 0.25, "llama-70b": 0.15}
MIXED_TENANTS = ("acme", "globex", "initech", "umbrella")


@define(frozen=True)
class TraceRecord:
    """One request of a trace."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = field(converter=tuple)
    model: str = DEFAULT
    tenant: str = DEFAULT


def token_ids(hash_ids: Sequence[int], input_tokens: int, block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Synthetic token ids of a traced prompt, so that equal hash ids at equal positions give equal NexusKV keys.

    Block j of hash id h is `h * block_tokens + t` (mod 2^31): the trace's prefix hashes stay exact.
    """
    out: list[int] = []
    for j, h in enumerate(hash_ids):
        base = (h * block_tokens) % (2**31 - block_tokens)
        out.extend(range(base, base + min(block_tokens, input_tokens - j * block_tokens)))
    return out


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
                                  [int(h) for h in d["hash_ids"]], str(d.get("model", DEFAULT)),
                                  str(d.get("tenant", DEFAULT)))  # fmt: skip
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ContractError("trace", [(where, f"{type(exc).__name__}: {exc}")]) from None
            if rec.input_length <= 0 or len(rec.hash_ids) != -(-rec.input_length // BLOCK_TOKENS):
                msg = f"{len(rec.hash_ids)} hash_ids do not cover input_length {rec.input_length}"
                raise ContractError("trace", [(where, f"{msg} in {BLOCK_TOKENS}-token blocks")])
            if rec.output_length < 0:
                raise ContractError("trace", [(where, f"negative output_length {rec.output_length}")])
            yield rec


def write_trace(records: Iterable[TraceRecord], path: str | Path) -> int:
    """Write records as JSONL (`model` and `tenant` only when not "default"); return how many."""
    n = 0
    with Path(path).open("w") as fh:
        for r in records:
            d: dict[str, object] = {"timestamp": r.timestamp, "input_length": r.input_length,
                                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}  # fmt: skip
            if r.model != DEFAULT:
                d["model"] = r.model
            if r.tenant != DEFAULT:
                d["tenant"] = r.tenant
            fh.write(json.dumps(d) + "\n")
            n += 1
    return n


def scale(records: Iterable[TraceRecord], copies: int, *, window_ms: float | None = None) -> list[TraceRecord]:
    """A trace for a fleet `copies` times larger: the same request mix, `copies` times the tenants and sessions.

    Copy `c` of every record keeps its timestamp, lengths and model, takes its own tenant (`<tenant>.<c>`) and its
    own hash ids (offset by `c` times the trace's largest id + 1): no copy shares a prefix with another, so each
    copy's sessions reuse what they reused in the original and the arrival rate grows `copies` times. Only records
    before `window_ms` (the first part of the trace) when given. Ordered by time, then copy.
    """
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    base = [r for r in records if window_ms is None or r.timestamp < window_ms]
    span = 1 + max((max(r.hash_ids, default=0) for r in base), default=0)
    out = [TraceRecord(r.timestamp, r.input_length, r.output_length, [h + c * span for h in r.hash_ids], r.model,
                       f"{r.tenant}.{c}" if copies > 1 else r.tenant)
           for r in base for c in range(copies)]  # fmt: skip
    return sorted(out, key=lambda r: r.timestamp)  # stable: copies of one record stay in copy order


def _record(rng: random.Random, t: float, ctx: Sequence[int], out: tuple[int, int], model: str = DEFAULT,
            tenant: str = DEFAULT) -> TraceRecord:  # fmt: skip
    tail = rng.randint(1, BLOCK_TOKENS)
    return TraceRecord(round(t), (len(ctx) - 1) * BLOCK_TOKENS + tail, rng.randint(*out), ctx, model, tenant)


def generate(n: int = 400, *, seed: int = 0, mix: Mapping[str, float] | None = None,
             rate_per_s: float = 4.0) -> list[TraceRecord]:  # fmt: skip
    """A synthetic single-model workload: multi-turn chat, RAG over shared documents, agent loops, unique prompts.

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
        out.append(_record(rng, t, ctx, (1, 400)))
    return out


# Per model: request kinds and their weights. The expensive model (70b) is reuse-heavy (long shared system
# prompts and documents, long chats); the cheap one (8b) floods the caches with long one-off prompts.
_KINDS = {
    "llama-70b": {"chat": 0.45, "rag": 0.45, "unique": 0.10},
    "qwen-moe-30b": {"chat": 0.3, "rag": 0.4, "unique": 0.3},
    "llama-8b": {"chat": 0.15, "rag": 0.1, "unique": 0.75},
}


def generate_mixed(n: int = 1000, *, seed: int = 0, models: Mapping[str, float] | None = None,
                   tenants: Sequence[str] = MIXED_TENANTS, rate_per_s: float = 4.0,
                   n_docs: int = 40) -> list[TraceRecord]:  # fmt: skip
    """A mixed-model, multi-tenant workload where capacity binds and blocks differ in recompute cost per byte.

    `models` maps model name (a simulator profile model) to its share of requests (default: llama-8b 60%,
    qwen-moe-30b 25%, llama-70b 15%). Each (tenant, model) has its own system prompt (2-6 blocks) and `n_docs`
    shared documents (4-12 blocks, Zipf popularity, so the tail is revisited minutes apart). Requests are chat
    turns (system prompt + a session growing 1-2 blocks a turn), RAG (system prompt + document + question) or
    unique prompts (4-32 blocks sharing nothing), with the per-model mix of `_KINDS` (models not listed there
    use the qwen-moe-30b mix). Arrivals are Poisson at `rate_per_s`.
    """
    rng = random.Random(seed)
    shares = dict(models or MIXED_MODELS)
    names, weights = list(shares), list(shares.values())
    next_id = iter(range(10**12))
    sys_prompt = {(tn, m): [next(next_id) for _ in range(rng.randint(2, 6))] for tn in tenants for m in names}
    docs = {k: [[next(next_id) for _ in range(rng.randint(4, 12))] for _ in range(n_docs)] for k in sys_prompt}
    popularity = [1 / (i + 1) for i in range(n_docs)]  # Zipf: a few hot documents, a long tail revisited rarely
    live: dict[tuple[str, str], list[tuple[list[int], int]]] = {k: [] for k in sys_prompt}
    out: list[TraceRecord] = []
    t = 0.0
    while len(out) < n:
        t += rng.expovariate(rate_per_s) * 1000
        model = rng.choices(names, weights)[0]
        tenant = rng.choice(list(tenants))
        key = (tenant, model)
        mix = _KINDS.get(model, _KINDS["qwen-moe-30b"])
        kind = rng.choices(list(mix), list(mix.values()))[0]
        sessions = live[key]
        if kind == "chat" and sessions and rng.random() < 0.7:
            i = rng.randrange(len(sessions))
            ctx, left = sessions[i]
            ctx = ctx + [next(next_id) for _ in range(rng.randint(1, 2))]
            if left > 1:
                sessions[i] = (ctx, left - 1)
            else:
                sessions.pop(i)
        elif kind == "chat":
            ctx = sys_prompt[key] + [next(next_id) for _ in range(rng.randint(1, 3))]
            sessions.append((ctx, rng.randint(2, 10)))
        elif kind == "rag":
            ctx = sys_prompt[key] + rng.choices(docs[key], popularity)[0] + [next(next_id)]
        else:
            ctx = [next(next_id) for _ in range(rng.randint(4, 32))]
        out.append(_record(rng, t, ctx, (20, 400), model, tenant))
    return out
