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
from collections.abc import Sequence
from typing import Any

from attrs import define, evolve, field

from nexuskv import ExtraInput, Kernel, KeyChain, Plan, PlanAction, Request, get_logger
from nexuskv_vllm.identity import EngineIdentity, adapter_identity, request_scope
from nexuskv_vllm.metadata import LoadSpec, NexusKVMetadata, SaveSpec

__all__ = ["SchedulerSide"]

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

    def __init__(self, kernel: Kernel, engine: EngineIdentity, *, default_tenant: str | None = None) -> None:
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
        self._blocks: dict[str, list[int]] = {}  # req -> its vLLM block ids

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
        if track is None:
            return 0
        if cached is None:
            prompt = track.request.token_ids
            keys = track.keys(prompt, (len(prompt) - 1) // self.block)  # leave a token to compute
            if not keys:
                return 0
            cached = (keys, self.kernel.plan(track.request, keys=keys), 0)
        keys, plan, _ = cached
        with self._lock:
            self._plans[rid] = (keys, plan, num_computed_tokens)
        if plan.action != PlanAction.MATERIALIZE:
            return 0
        return max(0, plan.tokens_reused - num_computed_tokens)

    def allocated(self, req: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks; remember which of them the worker fills from NexusKV."""
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
            self._loads[rid] = LoadSpec(rid, track.request, keys, plan, first, list(block_ids[first:first + count]))

    # ------------------------------------------------------------------------------------------ one step

    def step(self, out: Any) -> NexusKVMetadata:
        """The worker's metadata for one `SchedulerOutput`: loads to do before the forward, blocks to save after."""
        with self._lock:
            loads, self._loads = list(self._loads.values()), {}
            todo: list[tuple[str, int, int]] = []
            for new in out.scheduled_new_reqs:
                self._blocks[new.req_id] = list(new.block_ids[0])
                todo.append((new.req_id, new.num_computed_tokens, out.num_scheduled_tokens.get(new.req_id, 0)))
            cached = out.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                new_ids = cached.new_block_ids[i]
                if new_ids is not None:
                    if rid in cached.resumed_req_ids:
                        self._blocks[rid] = list(new_ids[0])
                    else:
                        self._blocks.setdefault(rid, []).extend(new_ids[0])
                todo.append((rid, cached.num_computed_tokens[i], out.num_scheduled_tokens.get(rid, 0)))
            jobs = [(rid, before, before + n, self._live.get(rid), list(self._blocks.get(rid, ())))
                    for rid, before, n in todo]  # fmt: skip
        saves = [s for s in (self._save(*job) for job in jobs) if s is not None]
        return NexusKVMetadata(loads=loads, saves=saves)

    def _save(self, rid: str, before: int, after: int, req: Any, block_ids: list[int]) -> SaveSpec | None:
        """The blocks completed between `before` and `after` computed tokens, if any and if the request has a tenant."""
        first, end = before // self.block, after // self.block
        if req is None or end <= first or end > len(block_ids):
            return None
        tokens = list(req.all_token_ids[: end * self.block])
        track = self._track(req)
        if len(tokens) < end * self.block or track is None:
            return None
        keys = track.keys(tokens, end)
        todo = [b for b in range(first, end) if self.kernel.index.get(keys[b]) is None]  # held: not again
        if not todo:
            return None
        return SaveSpec(rid, evolve(track.request, token_ids=tuple(tokens)), keys, todo, [block_ids[b] for b in todo])

    def finished(self, req: Any) -> None:
        """The request is done: forget it (its blocks were saved as they filled)."""
        rid = str(req.request_id)
        with self._lock:
            for table in (self._tracks, self._plans, self._loads, self._live, self._blocks):
                table.pop(rid, None)
