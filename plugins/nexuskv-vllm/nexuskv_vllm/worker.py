"""The worker side: this rank's shard of every planned block in, every finished block out, and what it holds.

A block's payload is every attention layer's slice of that vLLM block (`kv_cache[block_id]`, whatever the
backend's interior layout), back to back in layer order; its descriptor lists the slices as tensor specs. With
tensor parallelism each rank holds its own heads, so each rank keys its shard with its own layout (`tp_rank`,
`tp_size`: the kernel keys latent state without them, so latent state would be one block for all ranks) and
derives its keys from the request itself. Loads are `Loader`'s (synchronous or in the background). Saves copy
each layer's finished blocks as the layer completes and hand the step's payloads to the kernel's bounded writer in
`wait_for_save` (`end_step`), so serialising and storing stay off the forward; `Residency` then tells the
scheduler, step by step, which of them this rank holds and which it lost (`worker_meta`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from attrs import evolve

from nexuskv import Kernel, KeyChain, Layout, Request, TensorSpec, get_logger
from nexuskv_vllm.hybrid import KVGroup, group_specs
from nexuskv_vllm.loading import Loader
from nexuskv_vllm.metadata import LoadSpec, NexusKVMetadata, NexusKVWorkerMeta, SaveSpec
from nexuskv_vllm.residency import Residency

__all__ = ["WorkerSide"]

log = get_logger(__name__)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WorkerSide:
    """One rank's worker state (vLLM calls it from its model-runner thread; locks guard it anyway)."""

    def __init__(self, kernel: Kernel, *, tp_rank: int = 0, tp_size: int = 1, report_wait_ms: float = 0.0,
                 groups: tuple[KVGroup, ...] | None = None) -> None:  # fmt: skip
        self.kernel = kernel
        self.groups = groups  # several KV cache groups (vLLM's hybrid manager), or None
        self.report_wait_s = report_wait_ms / 1e3  # how long a step that saved waits for its blocks to be placed
        self._saved_this_step = False
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._lock = threading.Lock()
        self.caches: dict[str, torch.Tensor] = {}
        self.specs: tuple[TensorSpec, ...] = ()
        self._staged: dict[str, tuple[torch.Tensor, set[str]]] = {}  # req -> ([blocks, payload bytes], layers in)
        self._slices: dict[str, tuple[int, int]] = {}  # layer -> (byte offset, bytes) in a block's payload
        self._chains: dict[str, tuple[KeyChain, int]] = {}  # req -> this rank's key chain, tokens fed
        self._chain_lock = threading.Lock()
        self.block_nbytes = 0
        self.loader = Loader(kernel, self._own_load, groups=groups)
        self.residency = Residency()
        self._saves = {"blocks_saved": 0, "saves_refused": 0, "bytes_saved": 0}
        self.stats_since: dict[str, int] = {}  # counters at the last `take_stats`

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of this rank's counters: its saves, and the loader's loads."""
        with self._lock:
            saves = dict(self._saves)
        return saves | self.loader.counters()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer paged KV tensors, `[num_blocks, ...]` each."""
        self.caches = dict(kv_caches)
        self.specs = tuple(TensorSpec(name=name, dtype=_dtype_name(t.dtype), shape=tuple(t.shape[1:]))
                           for name, t in self.caches.items())  # fmt: skip
        offset = 0
        for name, t in self.caches.items():
            n = t[0].numel() * t.element_size()
            self._slices[name] = (offset, n)
            offset += n
        self.block_nbytes = offset
        self.loader.register(self.caches, self.specs, self._slices, offset)

    # ------------------------------------------------------------------------------------------ this rank's keys

    def _layout(self, layout: Layout) -> Layout:
        return layout if (layout.tp_rank, layout.tp_size) == (self.tp_rank, self.tp_size) else \
            evolve(layout, tp_rank=self.tp_rank, tp_size=self.tp_size)  # fmt: skip

    def _own(self, request: Request, keys: list[bytes], blocks: int,
             remember: bool = True) -> tuple[Request, list[bytes]]:  # fmt: skip
        """This rank's request and its first `blocks` keys (the scheduler's when this rank keys the same).

        Saves `remember` the request's chain (it grows as the request decodes; `finished` drops it); loads do not
        (a load may run after vLLM finished its request).
        """
        layout = self._layout(request.layout)
        if layout is request.layout:
            return request, keys
        own = evolve(request, layout=layout)
        if not remember:
            return own, list(self.kernel.session(own).keys[:blocks])
        with self._chain_lock:  # the loader's threads and the model runner's may key one request
            chain, fed = self._chains.get(request.request_id, (None, 0))
            if chain is None or fed > len(own.token_ids):
                chain, fed = self.kernel.session(own), len(own.token_ids)
            elif len(chain.keys) < blocks and len(own.token_ids) > fed:
                chain.extend(own.token_ids[fed:], own.extra_inputs)
                fed = len(own.token_ids)
            self._chains[request.request_id] = (chain, fed)
        return own, list(chain.keys[:blocks])

    def _own_load(self, spec: LoadSpec) -> tuple[Request, list[bytes]]:
        return self._own(spec.request, spec.keys, len(spec.keys), remember=False)

    # ------------------------------------------------------------------------------------------ loads

    def start_load(self, meta: NexusKVMetadata) -> None:
        """Start the step's loads (`Loader.start`)."""
        self.loader.start(meta.loads)

    def wait_layer(self, layer: str) -> None:
        self.loader.mount_layer(layer)

    def take_errors(self) -> set[int]:
        return self.loader.take_errors()

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests whose saves are done: none, requests whose asynchronous load is over, those that failed whole).

        Saves never outlive their step (each block is copied out while the step runs). A finished request whose
        load was still running is reported over once it can no longer write (`Loader.release`). A hybrid model's
        failed load fails its request as a whole: vLLM recomputes it from token 0.
        """
        with self._chain_lock:
            for rid in finished_req_ids:
                self._chains.pop(rid, None)
        released = self.loader.release(finished_req_ids)
        done = self.loader.finished() | released
        return set(), done, self.loader.take_failed_loads() - released

    # ------------------------------------------------------------------------------------------ saves

    def save_layer(self, layer: str, kv_layer: torch.Tensor, meta: NexusKVMetadata) -> None:
        """Copy this layer's slice of every block the step completes into the blocks' payload buffers.

        One copy, straight into the bytes the writer stores (vLLM may reuse its blocks later). Hybrid models' blocks
        are copied at the end of the step instead (`end_step`): a group's payload spans several of its blocks.
        """
        if layer not in self._slices or self.groups is not None:
            return
        offset, n = self._slices[layer]
        for spec in meta.saves:
            with self._lock:
                buf, seen = self._staged.setdefault(
                    spec.req_id, (torch.empty((len(spec.block_ids), self.block_nbytes), dtype=torch.uint8), set()))
                seen.add(layer)
            for i, block_id in enumerate(spec.block_ids):
                buf[i, offset:offset + n].view(kv_layer.dtype).view(kv_layer.shape[1:]).copy_(kv_layer[block_id])

    def end_step(self, meta: NexusKVMetadata) -> None:
        """Hand the step's completed blocks to the kernel's writer (bounded; returns at once).

        Called at the end of every step, saves or not: which requests failed to load is this step's alone.
        """
        with self._lock:
            staged, self._staged = self._staged, {}
        failed = self.loader.take_failed_requests()
        for spec in meta.saves:
            try:
                if spec.group_ids is not None:
                    if spec.req_id not in failed:
                        self._commit_groups(spec)
                    continue
                buf, seen = staged.get(spec.req_id, (None, set()))
                if buf is None or spec.req_id in failed or seen != set(self.caches):
                    continue  # this step attended over a block that failed to load, or a layer never ran: not saved
                self._commit(spec, buf)
            except Exception as exc:  # a save is never worth a failed step: the blocks are just not saved
                log.warning("save failed; those blocks are not saved", request_id=spec.req_id, error=repr(exc))

    def _commit(self, spec: SaveSpec, buf: torch.Tensor) -> None:
        request, keys = self._own(spec.request, spec.keys, len(spec.keys))
        rows = buf.numpy()  # the writer keeps these views; the buffer is this step's alone
        payloads = {(b, 0): memoryview(rows[i]) for i, b in enumerate(spec.blocks)}
        tensors = {key: self.specs for key in payloads}
        self._hand_over(spec, request, keys, payloads, tensors, groups=1,
                        nbytes=lambda accepted: accepted * self.block_nbytes)

    def _hand_over(self, spec: SaveSpec, request: Request, keys: list[bytes], payloads: dict, tensors: dict, *,
                   groups: int, nbytes: Any) -> None:  # fmt: skip
        """Commit a step's payloads, remember them for the reports, count them (`nbytes(accepted)` bytes saved)."""
        result = self.kernel.commit(request, payloads, keys=keys, tensors=tensors)
        self._saved_this_step = True
        self.residency.committed([keys[b] for b in spec.blocks], [spec.keys[b] for b in spec.blocks], groups=groups)
        with self._lock:
            self._saves["blocks_saved"] += result.accepted
            self._saves["saves_refused"] += len(payloads) - result.accepted
            self._saves["bytes_saved"] += nbytes(result.accepted)

    def _commit_groups(self, spec: SaveSpec) -> None:
        """A hybrid model's blocks: per block and group, the group's layers' slices of its vLLM blocks, layer-major.

        Copied after the step's forward (vLLM frees a sliding-window group's blocks only when it next allocates).
        """
        assert self.groups is not None and spec.group_ids is not None
        request, keys = self._own(spec.request, spec.keys, len(spec.keys))
        payloads: dict[tuple[int, int], memoryview] = {}
        tensors: dict[tuple[int, int], tuple[TensorSpec, ...]] = {}
        for b, per_group in zip(spec.blocks, spec.group_ids, strict=True):
            for g, (group, ids) in enumerate(zip(self.groups, per_group, strict=True)):
                parts = [self.caches[name].index_select(0, torch.tensor(ids, device=self.caches[name].device))
                         .contiguous().view(torch.uint8).reshape(-1) for name in group.layers]  # fmt: skip
                payloads[(b, g)] = memoryview(torch.cat(parts).cpu().numpy())
                tensors[(b, g)] = group_specs(self.caches, group.layers, len(ids), _dtype_name)
        sizes = [len(p) for p in payloads.values()]  # the writer accepts a prefix, in order
        self._hand_over(spec, request, keys, payloads, tensors, groups=(1 << len(self.groups)) - 1,
                        nbytes=lambda accepted: sum(sizes[:accepted]))

    # ------------------------------------------------------------------------------------------ reports

    def worker_meta(self) -> NexusKVWorkerMeta | None:
        """This step's report to the scheduler: blocks newly held, blocks lost (by the scheduler's keys).

        A block is reported once the writer has placed it: from the next step on, or from this one when the step
        that saved it waits up to `report_wait_ms` for the writer (so that the very next request can plan it).
        """
        if self._saved_this_step and self.report_wait_s > 0:
            self.kernel.flush(self.report_wait_s)
        self._saved_this_step = False
        stored, removed = self.residency.sweep(self.kernel.index)
        every = (1 << len(self.groups)) - 1 if self.groups is not None else 1
        for own in self.loader.take_lost():
            held = self.kernel.index.get(own)
            if held is None or held.mask & every != every:  # truly gone, wholly or a group (not a slow read)
                theirs = self.residency.lost(own)
                if theirs is not None:
                    removed.add(theirs)
        if not stored and not removed:
            return None
        me = 1 << self.tp_rank
        return NexusKVWorkerMeta(stored={k: (loc.tier, loc.node, loc.epoch, me, groups)
                                         for k, (loc, groups) in stored.items()},
                                 removed=dict.fromkeys(removed, me))  # fmt: skip

    def take_stats(self) -> dict[str, int]:
        """Counters since the last call (vLLM sums them over ranks and over its logging interval)."""
        now = self.stats
        delta = {k: v - self.stats_since.get(k, 0) for k, v in now.items()}
        self.stats_since = now
        return {k: v for k, v in delta.items() if v}

    def close(self) -> None:
        self.loader.close()
