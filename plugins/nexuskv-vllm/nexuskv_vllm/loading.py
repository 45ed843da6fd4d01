"""Loading planned blocks into vLLM's paged KV tensors, synchronously before a forward or in the background.

`kernel.materialize` reads the planned tier with checksums and a timeout; each payload is then checked against
this engine (identity, tensor names, dtypes, shapes, size) before any byte reaches vLLM. A block that is missing,
corrupt, slow or foreign, and every block after it, is reported to vLLM (`get_block_ids_with_load_errors`), which
recomputes from there: vLLM never attends over random or partial data.

- **Synchronous** loads (`LoadSpec.asynchronous` false) are read in `start_load_kv` and mounted layer by layer as
  vLLM reaches each layer (`mount_layer`).
- **Asynchronous** loads run on the loader's threads while vLLM runs other requests; the request waits in
  vLLM's `WAITING_FOR_REMOTE_KVS`. A finished load copies its blocks straight into vLLM's tensors (they are this
  request's, allocated and not read until vLLM is told) and is reported by `finished()`, with its failed blocks
  in the same step. A load still running `load_timeout_ms` plus `grace_ms` after it started is given up: all of
  its blocks are reported failed and, under the same lock its copy takes, it can no longer write into vLLM's
  tensors, which vLLM may hand to another request once it has recomputed. While a load runs, a `finished` call in
  a step that ran no forward waits up to `poll_ms` for it: an engine with nothing else to do calls it every step,
  and a spinning model-runner thread would take the GIL from the very threads doing the load. The timeout counts
  from submission: a load that cannot even start within it (every load thread busy) is given up too.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from attrs import define, field

from nexuskv import Kernel, LoadReport, Request, TensorSpec, get_logger
from nexuskv_vllm.hybrid import KVGroup, group_specs
from nexuskv_vllm.metadata import LoadSpec

__all__ = ["Loader"]

log = get_logger(__name__)

Mount = tuple[str, int, torch.Tensor]  # (layer, vLLM block id, the block's data for that layer)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(spec: TensorSpec) -> int:
    n = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    for d in spec.shape:
        n *= d
    return n


@define
class _Job:
    """One asynchronous load: its blocks, when it started, and whether it may still write into vLLM's tensors."""

    spec: LoadSpec
    started: float
    future: concurrent.futures.Future[int] | None = None
    lock: threading.Lock = field(factory=threading.Lock)
    cancelled: bool = False


class Loader:
    """Per-worker loads; every method is safe to call from any thread."""

    def __init__(self, kernel: Kernel, own: Callable[[LoadSpec], tuple[Request, list[bytes]]], *,
                 grace_ms: float = 500.0, threads: int = 4, poll_ms: float = 5.0,
                 groups: tuple[KVGroup, ...] | None = None) -> None:  # fmt: skip
        self.kernel = kernel
        self.groups = groups  # a hybrid model's KV cache groups: its loads succeed or fail whole
        self._failed_loads: set[str] = set()  # hybrid requests whose load failed (vLLM's `failed_recving`)
        self.own = own  # this rank's request and keys for a load (another rank's shard has other keys)
        self.grace_ms = grace_ms
        self.poll_s = poll_ms / 1e3  # how long `finished` waits for a running load before answering
        self.caches: dict[str, torch.Tensor] = {}
        self.specs: tuple[TensorSpec, ...] = ()
        self.slices: dict[str, tuple[int, int]] = {}
        self.block_nbytes = 0
        self._lock = threading.Lock()
        self._pending: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)  # layer -> (block id, data)
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._jobs: dict[str, _Job] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nexuskv-vllm-load")
        self.forward_ran = False  # set by the connector when this step ran a forward (then `finished` never waits)
        self.stats = {"blocks_loaded": 0, "blocks_failed": 0, "loads": 0, "loads_async": 0, "loads_timed_out": 0,
                      "bytes_loaded": 0}  # fmt: skip
        self.lost: list[bytes] = []  # own keys of blocks that failed to load (the worker reports them removed)

    def counters(self) -> dict[str, int]:
        """A snapshot of the load counters (`stats`), taken under the loader's lock."""
        with self._lock:
            return dict(self.stats)

    def register(self, caches: dict[str, torch.Tensor], specs: tuple[TensorSpec, ...],
                 slices: dict[str, tuple[int, int]], block_nbytes: int) -> None:  # fmt: skip
        self.caches, self.specs, self.slices, self.block_nbytes = caches, specs, slices, block_nbytes

    # ------------------------------------------------------------------------------------------ both kinds

    def _read(self, spec: LoadSpec) -> tuple[int, list[Mount], int]:
        """Materialize and check one load: (blocks that will be mounted, their mounts, payload bytes)."""
        request, keys = self.own(spec)
        got = self.kernel.materialize(spec.plan, request, keys=keys)
        if spec.group_ids is not None:
            return self._read_groups(spec, request, got)
        mounts: list[Mount] = []
        good = nbytes = 0
        for i, block_id in enumerate(spec.block_ids):
            b = spec.first + i
            state = got.states.get((b, 0)) if b < got.blocks else None
            if state is None:
                break
            why = self._mismatch(request, state.descriptor, len(state.payload))
            if why:
                log.warning("restored block refused; vLLM recomputes from it", request_id=spec.req_id, block=b,
                            reason=why)  # fmt: skip
                tier = state.descriptor.placement.tier
                self.kernel.report_load_result(spec.plan, LoadReport(ok=False, failed_block=b, tier=tier, reason=why,
                                                                     corrupt=True), request=request)  # fmt: skip
                break
            with warnings.catch_warnings():  # read-only buffer: we only copy out of it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(state.payload, dtype=torch.uint8)
            for (name, cache), (offset, n) in zip(self.caches.items(), self.slices.values(), strict=True):
                mounts.append((name, block_id, raw[offset:offset + n].view(cache.dtype).view(cache.shape[1:])))
            good += 1
            nbytes += len(state.payload)
        if good < len(spec.block_ids):
            if got.reason:
                log.info("planned load incomplete; vLLM recomputes the rest", request_id=spec.req_id,
                         loaded=good, planned=len(spec.block_ids), reason=got.reason)  # fmt: skip
            if spec.first + good < len(keys):
                with self._lock:
                    self.lost.append(keys[spec.first + good])
        return good, mounts, nbytes

    def _read_groups(self, spec: LoadSpec, request: Request, got: Any) -> tuple[int, list[Mount], int]:
        """A hybrid model's load, all or nothing: dense groups' blocks, windowed groups' state at the cut."""
        assert self.groups is not None and spec.group_ids is not None
        end = spec.first + len(spec.block_ids)
        mounts: list[Mount] = []
        nbytes = 0
        why = "" if got.blocks >= end else f"materialized {got.blocks} of {end} blocks ({got.reason})"
        for g, (group, ids) in enumerate(zip(self.groups, spec.group_ids, strict=True)):
            blocks = range(spec.first, end) if group.kind == "dense" else range(end - 1, end)
            per_block = [[i] for i in ids] if group.kind == "dense" else [ids]
            if why or not ids or len(per_block) != len(blocks):
                why = why or f"group {g}: no vLLM blocks to fill"
                break
            for b, bids in zip(blocks, per_block, strict=True):
                state = got.states.get((b, g))
                if state is None:
                    why = f"block {b} group {g} not loaded"
                    break
                desc = state.descriptor
                want = group_specs(self.caches, group.layers, len(bids), _dtype)
                if (desc.model, desc.tokenizer, desc.layout) != (request.model, request.tokenizer, request.layout):
                    why = "state of another model, tokenizer, layout or rank"
                elif tuple(desc.tensors) != want:
                    why = f"block {b} group {g}: tensor specs are not this engine's"
                elif len(state.payload) != sum(_nbytes(t) for t in want):
                    why = f"block {b} group {g}: payload of {len(state.payload)} bytes"
                if why:
                    break
                with warnings.catch_warnings():  # read-only buffer: we only copy out of it
                    warnings.simplefilter("ignore", UserWarning)
                    raw = torch.frombuffer(state.payload, dtype=torch.uint8)
                offset = 0
                for name, t in zip(group.layers, want, strict=True):
                    n = _nbytes(t)
                    cache = self.caches[name]
                    data = raw[offset:offset + n].view(cache.dtype).view(len(bids), *cache.shape[1:])
                    mounts.append((name, bids, data))  # type: ignore[arg-type]
                    offset += n
                nbytes += len(state.payload)
            if why:
                break
        if why:
            log.info("hybrid load failed; vLLM recomputes the request", request_id=spec.req_id, reason=why)
            return 0, [], 0
        return len(spec.block_ids), mounts, nbytes

    def _mismatch(self, req: Request, desc: Any, nbytes: int) -> str:
        """Why a verified payload is still not this engine's state for this block ("" when it is)."""
        if (desc.model, desc.tokenizer, desc.layout) != (req.model, req.tokenizer, req.layout):
            return "state of another model, tokenizer, layout or rank"
        if tuple(desc.tensors) != self.specs:
            return f"tensor specs {[(t.name, t.dtype, t.shape) for t in desc.tensors][:2]}... are not this engine's"
        if nbytes != self.block_nbytes:
            return f"payload of {nbytes} bytes, this engine's blocks hold {self.block_nbytes}"
        return ""

    def _failed(self, spec: LoadSpec, good: int) -> None:
        with self._lock:
            if good < len(spec.block_ids) and spec.group_ids is not None:  # block ids are per group: whole request
                self._failed_loads.add(spec.req_id)
                self.stats["blocks_failed"] += len(spec.block_ids)
                return
            if good < len(spec.block_ids):
                self._errors.update(spec.block_ids[good:])
                self._failed_reqs.add(spec.req_id)
                self.stats["blocks_failed"] += len(spec.block_ids) - good
            self.stats["blocks_loaded"] += good

    # ------------------------------------------------------------------------------------------ synchronous

    def start(self, loads: list[LoadSpec]) -> None:
        """Start this step's loads: synchronous ones are read now and mounted by `mount_layer`."""
        for spec in loads:
            if spec.asynchronous or spec.group_ids is not None:  # hybrid loads fail per request: never in-step
                self._start_async(spec)
                continue
            try:
                good, mounts, nbytes = self._read(spec)
            except Exception as exc:  # a bug or a plugin raising: recompute, never stall the forward
                log.warning("load failed; vLLM recomputes", request_id=spec.req_id, error=repr(exc))
                good, mounts, nbytes = 0, [], 0
            with self._lock:
                for name, block_id, data in mounts:
                    self._pending[name].append((block_id, data))
                self.stats["loads"] += 1
                self.stats["bytes_loaded"] += nbytes
            self._failed(spec, good)

    def mount_layer(self, layer: str) -> None:
        """Mount the layer's queued blocks (vLLM is about to run that layer's attention)."""
        with self._lock:
            todo = self._pending.pop(layer, [])
        cache = self.caches.get(layer)
        for block_id, data in todo:
            cache[block_id].copy_(data)

    def _take(self, name: str, empty: Any) -> Any:
        """The collection held in attribute `name`, replaced by `empty`, under the lock."""
        with self._lock:
            got = getattr(self, name)
            setattr(self, name, empty)
        return got

    def take_failed_requests(self) -> set[str]:
        """Requests of this step whose synchronous load failed somewhere (their saves this step are skipped)."""
        return self._take("_failed_reqs", set())

    def take_errors(self) -> set[int]:
        """Blocks that failed to load since the last call; queued mounts vLLM never waited for count too."""
        with self._lock:
            for todo in self._pending.values():  # a layer whose attention never ran: not mounted
                self._errors.update(block_id for block_id, _ in todo)
            self._pending.clear()
            errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------------------------------------ asynchronous

    def _start_async(self, spec: LoadSpec) -> None:
        job = _Job(spec, time.monotonic())
        with self._lock:
            if spec.req_id in self._jobs:  # one load per request at a time; vLLM never sends two
                return
            self._jobs[spec.req_id] = job
            self.stats["loads_async"] += 1
        job.future = self._pool.submit(self._run_async, job)

    def _run_async(self, job: _Job) -> int:
        """Read, check and copy one asynchronous load into vLLM's tensors; returns the blocks mounted."""
        if job.cancelled:  # given up or released before a thread took it
            return 0
        try:
            good, mounts, nbytes = self._read(job.spec)
        except Exception as exc:
            log.warning("asynchronous load failed; vLLM recomputes", request_id=job.spec.req_id, error=repr(exc))
            return 0
        with job.lock:
            if job.cancelled:  # given up: vLLM has been told these blocks failed and may reuse them
                return 0
            for name, block_id, data in mounts:
                if isinstance(block_id, list):  # a hybrid group's blocks, layer by layer
                    cache = self.caches[name]
                    cache.index_copy_(0, torch.tensor(block_id, device=cache.device), data.to(cache.device))
                else:
                    self.caches[name][block_id].copy_(data)
        with self._lock:
            self.stats["bytes_loaded"] += nbytes
        return good

    def finished(self) -> set[str]:
        """Requests whose asynchronous load is over (done, failed or given up).

        Their failed blocks go to `take_errors` now, so vLLM sees them in the same step.
        """
        limit_s = (self.kernel.config.load_timeout_ms + self.grace_ms) / 1e3
        with self._lock:
            jobs = list(self._jobs.values())
        running = [job.future for job in jobs if job.future is not None and not job.future.done()]
        idle, self.forward_ran = not self.forward_ran, False
        if running and idle and self.poll_s > 0:  # an idle engine polls every step: sleep, so loads get the GIL
            concurrent.futures.wait(running, timeout=self.poll_s, return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        done: list[tuple[_Job, int]] = []
        for job in jobs:
            assert job.future is not None
            if job.future.done():
                done.append((job, job.future.result() if job.future.exception() is None else 0))
            elif now - job.started > limit_s:
                with job.lock:  # after this, the load cannot write into vLLM's tensors
                    job.cancelled = True
                job.future.cancel()
                log.warning("asynchronous load past its timeout; vLLM recomputes", request_id=job.spec.req_id,
                            waited_s=round(now - job.started, 3))  # fmt: skip
                with self._lock:
                    self.stats["loads_timed_out"] += 1
                done.append((job, 0))
        for job, good in done:
            with self._lock:
                self._jobs.pop(job.spec.req_id, None)
            self._failed(job.spec, good)
        return {job.spec.req_id for job, _ in done}

    def release(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM finished, those whose asynchronous load was not reported over yet, now over.

        vLLM keeps an aborted `WAITING_FOR_REMOTE_KVS` request's blocks until `finished_recving` names it; a load
        still running is cancelled here under its lock (it can no longer write), and the request is returned for
        `get_finished` to report as received, exactly once (every rank does, which vLLM's aggregator counts).
        """
        with self._lock:
            jobs = [self._jobs.pop(rid) for rid in finished_req_ids if rid in self._jobs]
        for job in jobs:
            with job.lock:
                job.cancelled = True
            if job.future is not None:
                job.future.cancel()  # not started yet: never runs
        return {job.spec.req_id for job in jobs}

    def take_failed_loads(self) -> set[str]:
        """Hybrid requests whose load failed since the last call (reported as `failed_recving`)."""
        return self._take("_failed_loads", set())

    def take_lost(self) -> list[bytes]:
        """Own keys of blocks that failed to load since the last call."""
        return self._take("lost", [])

    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    def close(self) -> None:
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            with job.lock:
                job.cancelled = True
        self._pool.shutdown(wait=False, cancel_futures=True)
