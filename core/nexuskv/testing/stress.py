"""A randomized, model-checked stress run of a kernel: many threads, tenants, sessions, extras and tiers at once.

Threads pick operations at random (session and plain keys, commits, plans and loads with and without
deadlines, plans used for another tenant's request) over requests drawn from shared documents, multi-turn
sessions and unique prompts, for tenants with and without share rules, on layouts with paged and checkpointed
groups. Tiers are small, so evictions, demotions, promotions and prefetches happen all the time.

The reference model is deliberately simple and shares nothing with the kernel: the state of block b of a request
is a hash of exactly what it depends on (the namespace, the model, every token and extra input up to the end of
the block, the group). Every key list `keys_for` returns is compared with a fresh chain of a separate keyer, and
every payload `materialize` returns is compared with the model's state for the request's own namespace, or for
the owner's when a share rule of the shipped policies grants it. Anything else is a wrong restore.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
from attrs import define, field

from nexuskv.contracts import (
    ExtraInput,
    Layout,
    ModelIdentity,
    Namespace,
    PlanAction,
    Request,
    StateGroup,
    TokenizerIdentity,
)
from nexuskv.kernel import Kernel, KernelConfig
from nexuskv.logs import configure_logging
from nexuskv.resources import shipped
from nexuskv.state.identity import BlockKeyer
from nexuskv.state.index import Location

__all__ = ["StressReport", "index_problems", "reference_payload", "run"]

POLICIES = shipped("policies")
PAGE = 16
MODEL = ModelIdentity(name="tiny-llama", revision="stress")  # the shipped rag policy shares its docs for it
TOKENIZER = TokenizerIdentity(name="tiny-bpe")
LAYOUTS = (
    Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=PAGE),
    Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8),
                   StateGroup(kind="recurrent", layers=1)], page_size=PAGE),
)  # fmt: skip
TENANTS = ("chat", "rag", "strict", "globex", "partner-a")
SHARES = {("rag", "docs"): {"chat", "partner-a"}}  # what the shipped policies grant, as the model knows it


@define
class StressReport:
    """What a stress run did and found; `wrong_keys`, `wrong_restores` and `index_problems` must be zero."""

    operations: int = 0
    seconds: float = 0.0
    wrong_keys: int = 0
    wrong_restores: int = 0
    restores: int = 0
    blocks_restored: int = 0
    shared_restores: int = 0
    plans: int = 0
    fallbacks: int = 0
    refused_plans: int = 0
    commits_accepted: int = 0
    index_problems: list[str] = field(factory=list)
    errors: list[str] = field(factory=list)
    stats: dict[str, Any] = field(factory=dict)

    def merge(self, other: StressReport) -> None:
        """Add another thread's counts."""
        for name in ("operations", "wrong_keys", "wrong_restores", "restores", "blocks_restored",
                     "shared_restores", "plans", "fallbacks", "refused_plans", "commits_accepted"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.errors.extend(other.errors)


def reference_payload(ns: Namespace, request: Request, block: int, group: int, size: int = 64) -> bytes:
    """The model's state of `block` (0-based) of `request` in namespace `ns`: a hash of all it depends on."""
    end = (block + 1) * PAGE
    extras = sorted((x.position, x.digest) for x in request.extra_inputs if x.position < end)
    what = repr((ns.tenant, ns.scope, ns.cache_salt, request.model.name, request.model.revision,
                 tuple(request.token_ids[:end]), extras, group, request.layout.kind))  # fmt: skip
    return hashlib.shake_256(what.encode()).digest(size)


def index_problems(kernel: Kernel) -> list[str]:
    """Where the index and the tiers disagree (call when quiet): a held entry not in its tier, or the reverse."""
    index = kernel.index
    if not hasattr(index, "keys_at"):  # the builtin and native indexes list a location's keys; others cannot be checked
        return []
    out = []
    for tier, store in kernel.tiers.items():
        loc = Location(tier, kernel.node, kernel.epoch)
        held = {(k, g) for k in index.keys_at(loc) for g in range(8) if index.get(k).mask_at(tier=tier) & (1 << g)}
        slots = {(s[:-1], s[-1]) for s in store.slots()}
        out += [f"{tier}: indexed but not held: {k.hex()}/{g}" for k, g in sorted(held - slots)]
        out += [f"{tier}: held but not indexed: {k.hex()}/{g}" for k, g in sorted(slots - held)]
    return out


class _Worker:
    """One thread's random operations and checks."""

    def __init__(self, kernel: Kernel, keyer: BlockKeyer, seed: int, docs: list[list[int]], stop: Callable[[], bool],
                 lock: threading.Lock, plans: list[tuple[Request, Any]]) -> None:  # fmt: skip
        self.k, self.keyer, self.rng, self.docs, self.stop = kernel, keyer, random.Random(seed), docs, stop
        self.lock, self.shared_plans = lock, plans
        self.r = StressReport()
        self.sessions: dict[str, Request] = {}
        self.seed = seed

    def request(self) -> tuple[Request, str | None]:
        rng = self.rng
        if rng.random() < 0.35 and self.sessions:  # the next turn of one of this thread's sessions
            name = rng.choice(sorted(self.sessions))
            prev = self.sessions[name]
            more = [rng.randrange(40_000) for _ in range(rng.randrange(1, 3 * PAGE))]
            req = attrs.evolve(prev, request_id=f"{name}-{len(prev.token_ids)}", token_ids=[*prev.token_ids, *more])
            self.sessions[name] = req
            return req, name
        tenant = rng.choice(TENANTS)
        doc = rng.choice(self.docs)
        tokens = [*doc, *(rng.randrange(40_000) for _ in range(rng.randrange(0, 3 * PAGE)))]
        if rng.random() < 0.15:
            tokens = [rng.randrange(40_000) for _ in range(rng.randrange(PAGE, 8 * PAGE))]  # a unique prompt
        scope = "docs" if tenant == "rag" and rng.random() < 0.7 else ""
        extras = [ExtraInput(position=rng.randrange(len(tokens)), digest=f"img-{rng.randrange(3)}")
                  for _ in range(rng.random() < 0.25)]  # fmt: skip
        req = Request(request_id=f"t{self.seed}-{rng.randrange(1 << 30)}", tenant=tenant, scope=scope,
                      model=MODEL, tokenizer=TOKENIZER, layout=rng.choice(LAYOUTS), token_ids=tokens,
                      extra_inputs=extras)  # fmt: skip
        name = None
        if rng.random() < 0.3:
            name = f"s{self.seed}-{rng.randrange(3)}"
            self.sessions[name] = req
        return req, name

    def keys(self, req: Request, session: str | None) -> list[bytes]:
        got = self.k.keys_for(req, session)
        self.r.operations += 1
        if got != self.keyer.request_keys(req):
            self.r.wrong_keys += 1
        return got

    def check(self, req: Request, plan: Any, got: Any) -> None:
        self.r.restores += 1
        ns = plan.namespace if plan.namespace is not None else req.namespace
        allowed = ns == req.namespace or (req.tenant in SHARES.get((ns.tenant, ns.scope), set())
                                          and ns.cache_salt == req.cache_salt)  # fmt: skip
        if got.states and ns != req.namespace:
            self.r.shared_restores += 1
        for (b, g), st in got.states.items():
            self.r.blocks_restored += 1
            if not allowed or bytes(st.payload) != reference_payload(ns, req, b, g):
                self.r.wrong_restores += 1

    def step(self) -> None:
        rng, k = self.rng, self.k
        req, session = self.request()
        op = rng.random()
        if op < 0.15:  # produce state: commit what the model says this request's blocks are
            keys = self.keys(req, session)
            groups = len(req.layout.groups)
            payloads = {(b, g): reference_payload(req.namespace, req, b, g) for b in range(len(keys))
                        for g in range(groups)}  # fmt: skip
            self.r.commits_accepted += k.commit(req, payloads, keys=keys).accepted
            self.r.operations += 1
            if rng.random() < 0.3:  # sometimes wait for the writer (an engine waits on its GPU: the writer runs)
                k.flush(5.0)
                self.r.operations += 1
        elif op < 0.8:  # plan and load
            deadline = rng.choice((None, None, None, 0.05, 0.5))
            keys = self.keys(req, session) if rng.random() < 0.5 else None
            plan = k.plan(req, keys=keys, session=None if keys else session, deadline_ms=deadline)
            self.r.plans += 1
            self.r.fallbacks += bool(plan.reasons and plan.reasons[0].startswith("fail-open"))
            if plan.action == PlanAction.MATERIALIZE:
                got = k.materialize(plan, req)
                self.check(req, plan, got)
                self.r.operations += 1
                if rng.random() < 0.2:
                    with self.lock:
                        self.shared_plans.append((req, plan))
                        del self.shared_plans[:-50]
            self.r.operations += 1
        elif op < 0.93:  # a plan made for someone else, used for a request of another tenant with the same tokens
            with self.lock:
                other = rng.choice(self.shared_plans) if self.shared_plans else None
            if other is not None:
                plan = other[1]
                req = attrs.evolve(other[0], request_id=f"{other[0].request_id}-x", tenant=rng.choice(TENANTS),
                                   scope=rng.choice(("", "docs")))  # fmt: skip
                got = k.materialize(plan, req)
                self.r.refused_plans += got.reason.startswith("refused")
                self.check(req, plan, got)
                self.r.operations += 1
        elif op < 0.95:  # links change: a slow disk makes plans prefetch, a fast one makes them promote on hit
            k.bandwidth_scale = {"disk": rng.choice((1e-4, 0.02, 1.0))}
            self.r.operations += 1
        else:  # keys only
            self.keys(req, session)

    def run(self) -> StressReport:
        while not self.stop():
            try:
                self.step()
            except Exception as exc:  # every error is a finding: recorded, and the run goes on
                self.r.errors.append(f"{type(exc).__name__}: {exc}")
                if len(self.r.errors) > 20:
                    break
        return self.r


def run(*, operations: int | None = None, seconds: float | None = None, threads: int = 8, seed: int = 0,
        config: dict[str, Any] | None = None,
        progress: Callable[[int], None] | None = None) -> StressReport:  # fmt: skip
    """Stress a fresh kernel until `operations` are done or `seconds` pass; the report says what went wrong."""
    if operations is None and seconds is None:
        raise ValueError("give operations or seconds")
    secret = os.urandom(32)
    cfg = dict(node="stress", policies=str(POLICIES), deadline_ms=50.0, bandwidth_scale={"disk": 0.02},
               tiers={"dram": {"store": "dram", "capacity_bytes": 400 * 64},
                      "disk": {"store": "dram", "capacity_bytes": 1600 * 64}})  # fmt: skip
    cfg.update(config or {})
    rng = random.Random(seed)
    docs = [[rng.randrange(40_000) for _ in range(rng.randrange(2, 7) * PAGE)] for _ in range(8)]
    t0 = time.monotonic()

    def stop() -> bool:
        if seconds is not None and time.monotonic() - t0 > seconds:
            return True
        return operations is not None and sum(w.r.operations for w in workers) >= operations

    report = StressReport()
    lock = threading.Lock()
    shared: list[tuple[Request, Any]] = []
    with Kernel(KernelConfig.from_mapping(cfg), secret=secret) as kernel:
        keyer = BlockKeyer(secret, PAGE)  # the reference: a keyer of its own, no sessions, no caches shared
        workers = [_Worker(kernel, keyer, seed * 1000 + i, docs, stop, lock, shared) for i in range(threads)]
        ts = [threading.Thread(target=w.run, name=f"stress-{i}") for i, w in enumerate(workers)]
        for t in ts:
            t.start()
        while any(t.is_alive() for t in ts):
            for t in ts:
                t.join(1.0)
            if progress is not None:
                progress(sum(w.r.operations for w in workers))
        for w in workers:
            report.merge(w.r)
        kernel.flush(30)
        kernel.prefetcher.wait_idle(30)
        report.index_problems = index_problems(kernel)
        report.seconds = time.monotonic() - t0
        report.stats = {"writer": dict(kernel.writer.stats), "prefetch": dict(kernel.prefetcher.stats),
                        "evictions": {t: getattr(s, "evictions", 0) for t, s in kernel.tiers.items()},
                        "orphans": kernel.writes.orphans, "deadline_fallbacks": kernel.reads.deadline_fallbacks}
    return report


if __name__ == "__main__":  # pragma: no cover - `python -m nexuskv.testing.stress` for a quick look
    configure_logging(level="error", force=True)
    print(run(seconds=10))
