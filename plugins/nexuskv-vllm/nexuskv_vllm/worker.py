"""The worker side: copy planned blocks into vLLM's paged KV tensors, copy finished blocks out, report failures.

A block's payload is every attention layer's slice of that vLLM block (`kv_cache[block_id]`, whatever the
backend's interior layout), back to back in layer order; its descriptor lists the slices as tensor specs. On load,
`kernel.materialize` reads the planned tier with checksums and a timeout; each payload is then checked against
this engine (identity, tensor names, dtypes, shapes, size) before any byte reaches vLLM. A block that is missing,
corrupt, slow or foreign, and every block after it, is reported to vLLM (`get_block_ids_with_load_errors`), which
recomputes from there: vLLM never attends over random or partial data. Layers are mounted one by one as vLLM
reaches them (`wait_for_layer_load`). Saves copy each layer's finished blocks as the layer completes and hand the
step's payloads to the kernel's bounded writer in `wait_for_save` (`end_step`), so serialising and storing stay
off the forward.
"""

from __future__ import annotations

import threading
import warnings
from collections import defaultdict
from typing import Any

import torch

from nexuskv import Kernel, LoadReport, TensorSpec, get_logger
from nexuskv_vllm.metadata import LoadSpec, NexusKVMetadata, SaveSpec

__all__ = ["WorkerSide"]

log = get_logger(__name__)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WorkerSide:
    """Per-engine worker state (vLLM calls it from its model-runner thread; a lock guards it anyway)."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self._lock = threading.Lock()
        self.caches: dict[str, torch.Tensor] = {}
        self.specs: tuple[TensorSpec, ...] = ()
        self._pending: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)  # layer -> (block id, data)
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._staged: dict[str, tuple[torch.Tensor, set[str]]] = {}  # req -> ([blocks, payload bytes], layers in)
        self._slices: dict[str, tuple[int, int]] = {}  # layer -> (byte offset, bytes) in a block's payload
        self.block_nbytes = 0
        self.stats = {"blocks_loaded": 0, "blocks_failed": 0, "blocks_saved": 0, "saves_refused": 0}

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

    # ------------------------------------------------------------------------------------------ loads

    def start_load(self, meta: NexusKVMetadata) -> None:
        """Read and verify every planned block; queue each layer's copy for `wait_layer`."""
        for spec in meta.loads:
            ok = self._load_one(spec)
            if ok < len(spec.block_ids):
                with self._lock:
                    self._errors.update(spec.block_ids[ok:])
                    self._failed_reqs.add(spec.req_id)
                    self.stats["blocks_failed"] += len(spec.block_ids) - ok
            with self._lock:
                self.stats["blocks_loaded"] += ok

    def _load_one(self, spec: LoadSpec) -> int:
        """Queue the blocks of one load; returns how many of `spec.block_ids` will be mounted."""
        got = self.kernel.materialize(spec.plan, spec.request, keys=spec.keys)
        mounts: list[tuple[str, int, torch.Tensor]] = []
        good = 0
        for i, block_id in enumerate(spec.block_ids):
            b = spec.first + i
            state = got.states.get((b, 0)) if b < got.blocks else None
            if state is None:
                break
            why = self._mismatch(spec, state.descriptor, len(state.payload))
            if why:
                log.warning("restored block refused; vLLM recomputes from it", request_id=spec.req_id, block=b,
                            reason=why)  # fmt: skip
                tier = state.descriptor.placement.tier
                self.kernel.report_load_result(spec.plan, LoadReport(ok=False, failed_block=b, tier=tier, reason=why,
                                                                     corrupt=True), request=spec.request)  # fmt: skip
                break
            with warnings.catch_warnings():  # read-only buffer: we only copy out of it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(state.payload, dtype=torch.uint8)
            for (name, cache), (offset, n) in zip(self.caches.items(), self._slices.values(), strict=True):
                mounts.append((name, block_id, raw[offset:offset + n].view(cache.dtype).view(cache.shape[1:])))
            good += 1
        if good < len(spec.block_ids) and got.reason:
            log.info("planned load incomplete; vLLM recomputes the rest", request_id=spec.req_id,
                     loaded=good, planned=len(spec.block_ids), reason=got.reason)  # fmt: skip
        with self._lock:
            for name, block_id, data in mounts:
                self._pending[name].append((block_id, data))
        return good

    def _mismatch(self, spec: LoadSpec, desc: Any, nbytes: int) -> str:
        """Why a verified payload is still not this engine's state for this block ("" when it is)."""
        req = spec.request
        if (desc.model, desc.tokenizer, desc.layout) != (req.model, req.tokenizer, req.layout):
            return "state of another model, tokenizer or layout"
        if tuple(desc.tensors) != self.specs:
            return f"tensor specs {[(t.name, t.dtype, t.shape) for t in desc.tensors][:2]}... are not this engine's"
        if nbytes != self.block_nbytes:
            return f"payload of {nbytes} bytes, this engine's blocks hold {self.block_nbytes}"
        return ""

    def wait_layer(self, layer: str) -> None:
        """Mount the layer's queued blocks (vLLM is about to run that layer's attention)."""
        with self._lock:
            todo = self._pending.pop(layer, [])
        cache = self.caches.get(layer)
        for block_id, data in todo:
            cache[block_id].copy_(data)

    def take_errors(self) -> set[int]:
        """Blocks that failed to load since the last call; queued mounts vLLM never waited for count too."""
        with self._lock:
            for todo in self._pending.values():  # a layer whose attention never ran: not mounted
                self._errors.update(block_id for block_id, _ in todo)
            self._pending.clear()
            errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------------------------------------ saves

    def save_layer(self, layer: str, kv_layer: torch.Tensor, meta: NexusKVMetadata) -> None:
        """Copy this layer's slice of every block the step completes into the blocks' payload buffers.

        One copy, straight into the bytes the writer stores (vLLM may reuse its blocks later).
        """
        if layer not in self._slices:
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
            failed, self._failed_reqs = self._failed_reqs, set()
        for spec in meta.saves:
            buf, seen = staged.get(spec.req_id, (None, set()))
            if buf is None or spec.req_id in failed or seen != set(self.caches):
                continue  # this step attended over a block that failed to load, or a layer never ran: not saved
            self._commit(spec, buf)

    def _commit(self, spec: SaveSpec, buf: torch.Tensor) -> None:
        rows = buf.numpy()  # the writer keeps these views; the buffer is this step's alone
        payloads = {(b, 0): memoryview(rows[i]) for i, b in enumerate(spec.blocks)}
        tensors = {key: self.specs for key in payloads}
        result = self.kernel.commit(spec.request, payloads, keys=spec.keys, tensors=tensors)
        with self._lock:
            self.stats["blocks_saved"] += result.accepted
            self.stats["saves_refused"] += len(payloads) - result.accepted
