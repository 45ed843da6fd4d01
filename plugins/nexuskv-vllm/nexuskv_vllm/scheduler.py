"""The scheduler side: how many tokens vLLM gets from NexusKV, which blocks to load, which finished blocks to save.

`matched` asks `kernel.plan` (tenant policy, cost model, deadline) about the prompt's full blocks, always leaving
one token for vLLM to compute; the answer is the plan's restored tokens beyond what vLLM already holds, aligned
to the block size (the kernel's page size is vLLM's block size). `step` turns one `SchedulerOutput` into the
worker's metadata: the loads allocated since the last step, and every block that this step's forward completes
(prompt or generated), to be saved. A request's identity is built once and its tokens are hashed once: a
`KeyChain` per live request grows as the request decodes. Methods take vLLM's objects but only read plain fields
off them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from attrs import define, evolve, field

from nexuskv import ExtraInput, Kernel, KeyChain, Location, Plan, PlanAction, Request, get_logger
from nexuskv_vllm.events import Events
from nexuskv_vllm.hybrid import KVGroup, window_blocks
from nexuskv_vllm.identity import EngineIdentity, adapter_identity, request_scope
from nexuskv_vllm.metadata import LoadSpec, NexusKVMetadata, NexusKVWorkerMeta, SaveSpec
from nexuskv_vllm.roles import Role

__all__ = ["SchedulerSide"]

RANKS_PENDING = 1 << 20  # blocks whose holding ranks the scheduler remembers (mp executor)

log = get_logger(__name__)


@define
class _Track:
    """One live request: its kernel request (identity and prompt) and the key chain of its tokens so far."""

    request: Request
    chain: KeyChain
    fed: int  # tokens appended to the chain
    lock: threading.Lock = field(factory=threading.Lock)

    def keys(self, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """Keys of the first `blocks` blocks; `tokens` are the request's tokens so far (vLLM only appends)."""
        with self.lock:
            if len(self.chain.keys) < blocks and len(tokens) > self.fed:
                self.chain.extend(tokens[self.fed:], self.request.extra_inputs)
                self.fed = len(tokens)
            return self.chain.keys[:blocks]


class SchedulerSide:
    """Per-engine scheduler state; every method is safe to call from any thread."""

    def __init__(self, kernel: Kernel, engine: EngineIdentity, *, default_tenant: str | None = None,
                 load_async: bool = False, shares_worker_kernel: bool = True, events: Events | None = None,
                 groups: tuple[KVGroup, ...] | None = None, role: str = "kv_both") -> None:  # fmt: skip
        if kernel.keyer.page_size != engine.layout.page_size:
            raise ValueError(f"the kernel's page_size is {kernel.keyer.page_size} but vLLM's block size is "
                             f"{engine.layout.page_size}: set page_size = {engine.layout.page_size} in the "
                             "kernel config")  # fmt: skip
        self.kernel = kernel
        self.engine = engine
        self.block = engine.layout.page_size
        self.default_tenant = default_tenant
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track | None] = {}  # req -> identity and keys (None: no tenant, never reused)
        self._plans: dict[str, tuple[list[bytes], Plan, int]] = {}  # req -> plan of the last query
        self._loads: dict[str, LoadSpec] = {}  # allocated, not yet sent to the worker
        self._live: dict[str, Any] = {}  # req -> vLLM Request (its token list grows as it decodes)
        self._blocks: dict[str, list[list[int]]] = {}  # req -> its vLLM block ids, per KV cache group
        self._next_save: dict[str, int] = {}  # req -> first token not yet saved (a step may lack its tokens)
        self._failed: set[str] = set()  # requests whose load failed whole: never planned again (no retry loop)
        self.groups = groups  # several KV cache groups (vLLM's hybrid manager), or None
        # with several groups vLLM takes load failures per request only (`failed_recving`): asynchronous loads
        self.load_async = load_async or groups is not None
        self.shares_worker_kernel = shares_worker_kernel  # False: workers have kernels of their own (`mp`)
        self.events = events
        self.role = Role(kernel, role)  # P/D: what a prefill engine hands on, what a decode engine takes
        self._ranks: OrderedDict[bytes, int] = OrderedDict()  # key -> bit mask of the ranks holding it, so far
        self.stats = {"plans": 0, "plans_reuse": 0, "plan_fallbacks": 0, "tokens_planned": 0}
        self.stats_since: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------ identity
    def request(self, req: Any, tokens: Sequence[int]) -> Request | None:
        """The kernel request for a vLLM request's first `tokens`; None when it has no tenant (fail closed)."""
        scope = request_scope(getattr(req, "kv_transfer_params", None), getattr(req, "cache_salt", None),
                              self.default_tenant)  # fmt: skip
        if scope is None:
            return None
        model = self.engine.model
        lora = getattr(req, "lora_request", None)
        if lora is not None:
            model = evolve(model, adapter=adapter_identity(lora.lora_name, getattr(lora, "lora_path", None)))
        extras = tuple(ExtraInput(position=int(f.mm_position.offset), digest=str(f.identifier))
                       for f in (getattr(req, "mm_features", None) or ()))  # fmt: skip
        return Request(request_id=str(req.request_id), tenant=scope.tenant, model=model,
                       tokenizer=self.engine.tokenizer, layout=self.engine.layout, token_ids=tuple(tokens),
                       scope=scope.scope, cache_salt=scope.cache_salt, extra_inputs=extras)  # fmt: skip

    def _track(self, req: Any) -> _Track | None:
        """The request's track, built on first use (identity, then the prompt's keys); None: no tenant."""
        rid = str(req.request_id)
        with self._lock:
            if rid in self._tracks:
                return self._tracks[rid]
        try:
            nreq = self.request(req, list(req.prompt_token_ids or ()))
        except (OSError, ValueError) as exc:  # an adapter without files to hash: no key, no reuse
            log.warning("request cannot be keyed; recompute", request_id=rid, reason=str(exc))
            nreq = None
        track = None if nreq is None else _Track(nreq, self.kernel.session(nreq), len(nreq.token_ids))
        with self._lock:
            return self._tracks.setdefault(rid, track)

    # ------------------------------------------------------------------------------------------ loads

    def matched(self, req: Any, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` that vLLM should take from NexusKV (0: compute them)."""
        rid = str(req.request_id)
        with self._lock:
            self._live[rid] = req
            cached = self._plans.get(rid)
        track = self._track(req)
        if track is None or rid in self._failed:
            return 0
        if cached is None:
            prompt = track.request.token_ids
            keys = track.keys(prompt, (len(prompt) - 1) // self.block)  # leave a token to compute
            if not keys:
                return 0
            self.role.accept(req, track.request, keys)
            cached = (keys, self.kernel.plan(track.request, keys=keys), 0)
            self._count(cached[1])
            self.role.decided(track.request, cached[1])
        keys, plan, _ = cached
        with self._lock:
            self._plans[rid] = (keys, plan, num_computed_tokens)
        if plan.action != PlanAction.MATERIALIZE:
            return 0
        return max(0, plan.tokens_reused - num_computed_tokens)

    def allocated(self, req: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (one list per KV cache group); remember which to fill from NexusKV."""
        rid = str(req.request_id)
        with self._lock:
            self._live[rid] = req
            got = self._plans.pop(rid, None)
            track = self._tracks.get(rid)
            if num_external_tokens <= 0 or got is None or track is None:
                return
            keys, plan, local = got
            first = local // self.block
            count = num_external_tokens // self.block
            plan = self._from(plan, first)
            self._loads[rid] = LoadSpec(rid, track.request, keys, plan, first, list(block_ids[0][first:first + count]),
                                        asynchronous=self.load_async,
                                        group_ids=self._load_ids(block_ids, first, first + count))  # fmt: skip

    def _from(self, plan: Plan, first: int) -> Plan:
        """`plan` without the blocks before `first` (vLLM's own cache holds them: they are not read, nor fetched)."""
        start = first * self.block
        if start <= 0 or not plan.spans or plan.spans[0].start >= start:
            return plan
        spans = [evolve(s, start=max(s.start, start)) for s in plan.spans if s.end > start]
        return self.kernel.seal(evolve(plan, spans=spans, mac=""))

    # ------------------------------------------------------------------------------------------ one step

    def step(self, out: Any) -> NexusKVMetadata:
        """The worker's metadata for one `SchedulerOutput`: loads to do before the forward, blocks to save after."""
        with self._lock:
            loads, self._loads = list(self._loads.values()), {}
            todo: list[tuple[str, int, int]] = []
            for new in out.scheduled_new_reqs:
                self._blocks[new.req_id] = [list(g) for g in new.block_ids]
                todo.append((new.req_id, new.num_computed_tokens, out.num_scheduled_tokens.get(new.req_id, 0)))
            cached = out.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                new_ids = cached.new_block_ids[i]
                if new_ids is not None:
                    if rid in cached.resumed_req_ids:
                        self._blocks[rid] = [list(g) for g in new_ids]
                    else:
                        held = self._blocks.setdefault(rid, [[] for _ in new_ids])
                        for mine, more in zip(held, new_ids, strict=True):
                            mine.extend(more)
                todo.append((rid, cached.num_computed_tokens[i], out.num_scheduled_tokens.get(rid, 0)))
            jobs = [(rid, before, before + n, self._live.get(rid), [list(g) for g in self._blocks.get(rid, [[]])])
                    for rid, before, n in todo]  # fmt: skip
        saves = [s for s in (self._save(*job) for job in jobs) if s is not None]
        return NexusKVMetadata(loads=loads, saves=saves, preempted=sorted(out.preempted_req_ids or ()))

    def _save(self, rid: str, before: int, after: int, req: Any, groups: list[list[int]]) -> SaveSpec | None:
        """The blocks completed between `before` and `after` computed tokens, if any and if the request has a tenant."""
        if req is None or not self.role.saves:
            return None
        with self._lock:
            start = min(before, self._next_save.get(rid, before))
        # with async scheduling a step's last tokens are placeholders when the next step is planned: save what
        # the request's token list holds now, and the rest in a later step
        first, end = start // self.block, min(after, len(req.all_token_ids)) // self.block
        block_ids = groups[0]
        if end <= first or end > len(block_ids):
            return None
        tokens = list(req.all_token_ids[: end * self.block])
        track = self._track(req)
        if len(tokens) < end * self.block or track is None:
            return None
        with self._lock:
            if rid in self._live:
                self._next_save[rid] = end * self.block
        keys = track.keys(tokens, end)
        todo = [b for b in range(first, end) if self.kernel.index.get(keys[b]) is None]  # held: not again
        if not todo:
            return None
        if self.events is not None:
            self.events.saving(keys, todo, tokens, self.block, track.request)
        group_ids = None
        if self.groups is not None:
            group_ids = [self._save_ids(groups, b) for b in todo]
            todo = [b for b, ids in zip(todo, group_ids, strict=True) if ids is not None]
            group_ids = [ids for ids in group_ids if ids is not None]
            if not todo:
                return None
        return SaveSpec(rid, evolve(track.request, token_ids=tuple(tokens)), keys, todo, [block_ids[b] for b in todo],
                        group_ids=group_ids)  # fmt: skip

    # ------------------------------------------------------------------------------------------ hybrid models

    def _window(self, ids: Sequence[int], end: int, group: KVGroup) -> list[int] | None:
        """vLLM ids of a windowed group's blocks before block `end` that its state there needs (None: one is gone)."""
        got = list(ids[max(0, end - window_blocks(group.window, self.block)):end])
        return got if got and 0 not in got else None

    def _save_ids(self, groups: list[list[int]], b: int) -> list[list[int]] | None:
        """Per KV cache group, the vLLM ids whose data make block b's payload of that group (None: not savable)."""
        out: list[list[int]] = []
        for g, group in enumerate(self.groups or ()):
            if b >= len(groups[g]):
                return None
            ids = [groups[g][b]] if group.kind == "dense" else self._window(groups[g], b + 1, group)
            if ids is None or 0 in ids:
                return None
            out.append(ids)
        return out

    def _load_ids(self, block_ids: Sequence[Sequence[int]], first: int, end: int) -> list[list[int]] | None:
        """Per group, the vLLM ids a hybrid load fills: dense groups [first, end), windowed groups the state at end."""
        if self.groups is None:
            return None
        out: list[list[int]] = []
        for g, group in enumerate(self.groups):
            ids = list(block_ids[g][first:end]) if group.kind == "dense" else self._window(block_ids[g], end, group)
            out.append(ids or [])
        return out

    def handoff(self, req: Any) -> dict[str, Any] | None:
        """A producer's finished request: the `kv_transfer_params` granting its prompt's state (see `roles`)."""
        if not self.role.issues:
            return None
        with self._lock:
            track = self._tracks.get(str(req.request_id))
        if track is None:
            return None
        prompt = track.request.token_ids
        return self.role.grant(track.request, track.keys(prompt, (len(prompt) - 1) // self.block))

    def finished(self, req: Any) -> bool:
        """The request is done: forget it. Always False: vLLM may free its blocks at once.

        Its saves never outlive the step that completed each block. A request aborted while its asynchronous load
        runs is vLLM's to hold: it keeps the blocks of a request in `WAITING_FOR_REMOTE_KVS` until the workers
        report it in `finished_recving`, which they do once its load can no longer write (`Loader.release`).
        """
        rid = str(req.request_id)
        with self._lock:
            for table in (self._tracks, self._plans, self._loads, self._live, self._blocks, self._next_save):
                table.pop(rid, None)
            self._failed.discard(rid)
        self.role.forget(rid)
        return False

    def load_failed(self, req_ids: set[str]) -> None:
        """These requests' loads failed whole (vLLM recomputes them from token 0): do not plan them again."""
        with self._lock:
            self._failed |= {rid for rid in req_ids if rid in self._live}

    # ------------------------------------------------------------------------------------------ reports

    def reported(self, meta: Any) -> None:
        """The workers' report of one step (aggregated over ranks): index what all of them hold, drop what one lost.

        With the `uni` executor the worker commits into this very kernel, whose index is already exact; with `mp`
        each rank has its own kernel, and this index learns from the reports alone.
        """
        if not isinstance(meta, NexusKVWorkerMeta):
            return
        every = (1 << self.engine.layout.tp_size) - 1
        complete: dict[bytes, tuple[str, str, int, int]] = {}
        gone: set[bytes] = set()
        with self._lock:
            for key, (tier, node, epoch, ranks, groups) in meta.stored.items():
                held = self._ranks.pop(key, 0) | ranks
                self._ranks[key] = held  # to the back: the oldest are forgotten first
                if held == every:
                    complete[key] = (tier, node, epoch, groups)
            for key, ranks in meta.removed.items():
                if key in self._ranks:
                    self._ranks[key] &= ~ranks
                gone.add(key)
            while len(self._ranks) > RANKS_PENDING:  # bounded: the oldest keys' rank masks are forgotten
                self._ranks.popitem(last=False)
        if not self.shares_worker_kernel:
            index = self.kernel.index
            for key in gone:
                index.remove(key)
            for key, (tier, node, epoch, groups) in complete.items():
                index.insert(key, Location(tier, node, epoch), groups)
        if self.events is not None:
            self.events.reported({k: v[:3] for k, v in complete.items()}, gone)

    def _count(self, plan: Plan) -> None:
        with self._lock:
            self.stats["plans"] += 1
            if plan.action == PlanAction.MATERIALIZE:
                self.stats["plans_reuse"] += 1
                self.stats["tokens_planned"] += plan.tokens_reused
            elif plan.reasons and plan.reasons[0].startswith("fail-open:"):
                self.stats["plan_fallbacks"] += 1

    def take_stats(self) -> dict[str, int]:
        """Counters since the last call."""
        with self._lock:
            now = dict(self.stats) | self.role.counters()
        delta = {k: v - self.stats_since.get(k, 0) for k, v in now.items()}
        self.stats_since = now
        return {k: v for k, v in delta.items() if v}
