"""`NexusKVConnector`: the vLLM V1 KV connector class that vLLM loads; it wires vLLM's calls to the kernel.

    kv_transfer_config = {
        "kv_connector": "NexusKVConnector",
        "kv_connector_module_path": "nexuskv_vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": "kernel.toml", "tenant": "default-tenant"},
    }

Executors: `uni` (scheduler and worker in the engine-core process, one kernel) and `mp` (the scheduler side in the
engine-core process, each tensor-parallel rank in a worker process; every process has a kernel of its own over
tier directories of its own, and the workers tell the scheduler what they hold through vLLM's worker metadata).
`kv_role`: `kv_both`, or `kv_producer` / `kv_consumer` for prefill/decode disaggregation (`roles`).
`kv_connector_extra_config`: `config` (the kernel's TOML file, required), `tenant` (default tenant), `load_async`
(load in the background while other requests run), `report_wait_ms` (how long a step that saved blocks waits for
them to be placed, so the next request can plan them; 0: reported from the next step), `events_token_ids` (token
ids in KV events), `model_name`, `weights_hash` (see `identity`). Scheduler-side calls go to `SchedulerSide`,
worker-side calls to `WorkerSide`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attrs import evolve
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from nexuskv import get_logger
from nexuskv_vllm import shared
from nexuskv_vllm.events import Events
from nexuskv_vllm.hybrid import kv_groups
from nexuskv_vllm.identity import EngineIdentity
from nexuskv_vllm.metadata import NexusKVMetadata
from nexuskv_vllm.roles import PRODUCER_REPORT_WAIT_MS, role_of
from nexuskv_vllm.scheduler import SchedulerSide
from nexuskv_vllm.stats import NexusKVPromMetrics, NexusKVStats
from nexuskv_vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["NexusKVConnector", "executor_kind"]

log = get_logger(__name__)


def executor_kind(backend: Any) -> str:
    """"uni" or "mp" for the executors the connector runs under; ValueError for any other."""
    if backend == "uni" or (isinstance(backend, type) and issubclass(backend, UniProcExecutor)):
        return "uni"
    if backend == "mp" or (isinstance(backend, type) and issubclass(backend, MultiprocExecutor)):
        return "mp"
    raise ValueError(f"nexuskv_vllm runs under distributed_executor_backend 'uni' or 'mp' (got {backend!r})")


class NexusKVConnector(KVConnectorBase_V1, SupportsHMA):
    """NexusKV decides, per request, what vLLM loads from the tiers, what it recomputes, and what it saves."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        if "config" not in extra:
            raise ValueError("nexuskv_vllm: kv_connector_extra_config needs 'config', the kernel's TOML file")
        pc = vllm_config.parallel_config
        self.executor = executor_kind(pc.distributed_executor_backend)  # resolved by vLLM before connectors
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            raise ValueError("nexuskv_vllm needs kv_load_failure_policy='recompute': a block that fails to load "
                             "must be recomputed, not fail the request")  # fmt: skip
        if int(pc.pipeline_parallel_size) != 1:
            raise ValueError("nexuskv_vllm does not support pipeline parallelism yet (pipeline_parallel_size 1)")
        if int(getattr(pc, "data_parallel_size", 1)) != 1:
            raise ValueError("nexuskv_vllm does not support data parallelism yet (data_parallel_size 1): its "
                             "engines' processes would share tier directories; run one engine per config")  # fmt: skip
        self.kv_role = role_of(getattr(tc, "kv_role", None))
        if self.kv_role != "kv_both" and (self.executor != "uni" or int(pc.tensor_parallel_size) != 1):
            raise ValueError("nexuskv_vllm: kv_producer / kv_consumer run under the 'uni' executor with "
                             "tensor_parallel_size 1 (one kernel serves and fetches the engine's tiers)")  # fmt: skip
        if self.kv_role == "kv_producer":
            extra.setdefault("report_wait_ms", PRODUCER_REPORT_WAIT_MS)  # grants cover the blocks just saved
        tp_rank, tp_size = 0, int(pc.tensor_parallel_size)
        if role == KVConnectorRole.WORKER and self.executor == "mp":
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = int(get_tensor_model_parallel_rank())
        if self.executor == "uni":
            part = None  # one process: both roles share one kernel
        else:
            part = "scheduler" if role == KVConnectorRole.SCHEDULER else f"rank-{tp_rank}-of-{tp_size}"
        self._kernel_key = f"{tc.engine_id}/{part or 'uni'}"
        self.groups = kv_groups(kv_cache_config) if kv_cache_config is not None else None
        if self.groups is not None:
            sizes = {int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups}
            if sizes != {int(vllm_config.cache_config.block_size)}:
                raise ValueError(f"nexuskv_vllm: KV cache groups with block sizes {sorted(sizes)}: one size only")
        self.kernel = shared.acquire(self._kernel_key, extra["config"], part)
        try:
            self.identity = EngineIdentity.from_vllm_config(vllm_config, extra)
            if self.groups is not None:  # vLLM's hybrid manager: one NexusKV state group per KV cache group
                self.identity = evolve(self.identity, layout=evolve(
                    self.identity.layout, groups=tuple(g.state_group() for g in self.groups)))  # fmt: skip
            kv_events = getattr(vllm_config, "kv_events_config", None)
            events = Events(token_ids=bool(extra.get("events_token_ids"))) \
                if kv_events is not None and getattr(kv_events, "enable_kv_cache_events", False) else None  # fmt: skip
            self.scheduler = SchedulerSide(self.kernel, self.identity, default_tenant=extra.get("tenant"),
                                           load_async=bool(extra.get("load_async")),
                                           shares_worker_kernel=self.executor == "uni", events=events,
                                           groups=self.groups, role=self.kv_role)  # fmt: skip
        except Exception:
            shared.release(self._kernel_key)
            raise
        self.worker = WorkerSide(self.kernel, tp_rank=tp_rank, tp_size=tp_size, groups=self.groups,
                                 report_wait_ms=float(extra.get("report_wait_ms", 0.0)))  # fmt: skip
        log.info("NexusKV connector ready", role=role.name, executor=self.executor, tp_rank=tp_rank, tp_size=tp_size,
                 model=self.identity.model.name, block_size=self.scheduler.block, load_async=self.scheduler.load_async,
                 tiers=list(self.kernel.tier_order))  # fmt: skip

    # ------------------------------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens vLLM takes from NexusKV beyond its own prefix cache, and whether they load in the background.

        The tokens are a plan's that pays, the policy allowing; they load asynchronously with `load_async`.
        """
        n = self.scheduler.matched(request, num_computed_tokens)
        return n, bool(n) and self.scheduler.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember which of the request's new blocks to fill from NexusKV."""
        self.scheduler.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves, for the workers."""
        return self.scheduler.step(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report of a step: what every rank now holds, what one lost."""
        try:
            if connector_output.failed_recving:
                self.scheduler.load_failed(set(connector_output.failed_recving))
            self.scheduler.reported(connector_output.kv_connector_worker_meta)
        except Exception as exc:  # never fail vLLM's step over a report: the index is a hint, loads are checked
            log.warning("worker report not applied", error=repr(exc))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the request's blocks until the workers release them (`get_finished`).

        Saves never outlive their step; a request given an asynchronous load keeps its blocks until the workers
        report that load can no longer write into them.
        """
        return self._finished(request)

    def request_finished_all_groups(
            self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:  # fmt: skip
        """`request_finished` for hybrid models (vLLM passes every group's blocks; the answer is the same)."""
        return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        try:
            params = self.scheduler.handoff(request)  # a prefill engine's grant (kv_producer), else None
        except Exception as exc:  # never fail vLLM's step over a grant: the decode side recomputes without one
            log.warning("handoff grant not issued", request_id=str(request.request_id), error=repr(exc))
            params = None
        return self.scheduler.finished(request), params

    @property
    def requires_kv_delivery(self) -> bool:
        """False: nothing is handed off from vLLM's blocks (a producer copies each block out as a step completes it).

        A preempted request may therefore finish as usual.
        """
        return False

    def take_events(self) -> list[Any]:
        """NexusKV's stored and removed blocks as vLLM KV events (with `kv_events_config` only)."""
        return self.scheduler.events.take() if self.scheduler.events is not None else []

    # ------------------------------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged KV tensors, one per attention layer (this rank's heads)."""
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start the step's loads: synchronous ones are read and verified now, asynchronous ones in the background."""
        meta = self._get_connector_metadata()
        if isinstance(meta, NexusKVMetadata) and meta.loads:
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Mount this layer's restored blocks."""
        self.worker.loader.forward_ran = True
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Copy out this layer's part of the blocks this step completes (a failure: those blocks are not saved)."""
        self.worker.loader.forward_ran = True
        meta = self._get_connector_metadata()
        if isinstance(meta, NexusKVMetadata) and meta.saves:
            try:
                self.worker.save_layer(layer_name, kv_layer, meta)
            except Exception as exc:
                log.warning("save copy failed; this step's blocks are not saved", layer=layer_name, error=repr(exc))
                meta.saves.clear()

    def wait_for_save(self) -> None:
        """End the step: commit its completed blocks through the kernel's bounded writer, reset its state."""
        meta = self._connector_metadata
        if isinstance(meta, NexusKVMetadata):
            self.worker.end_step(meta)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Nothing to finish before vLLM reuses a preempted request's blocks.

        Saves are copied out in the step that completes a block, and a request waiting for an asynchronous load is
        not running, so it cannot be preempted.
        """

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks vLLM may free now, requests whose asynchronous load is over)."""
        release, done, _ = self.worker.finished(finished_req_ids)
        return release or None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and the loads that failed as a whole (hybrid models: vLLM recomputes those requests)."""
        release, done, failed = self.worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=release, finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that were planned but not mounted: vLLM recomputes them (a failed rank's on every rank)."""
        return self.worker.take_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """What this rank now holds and lost, for the scheduler side (a failure here never fails the step)."""
        try:
            return self.worker.worker_meta()
        except Exception as exc:
            log.warning("worker report failed; the scheduler learns of this step's blocks later", error=repr(exc))
            return None

    # ------------------------------------------------------------------------------------------ metrics

    def get_kv_connector_stats(self) -> NexusKVStats | None:
        """This side's counters since the last call (vLLM sums ranks and sides)."""
        data = self.worker.take_stats() if self._role == KVConnectorRole.WORKER else self.scheduler.take_stats()
        return NexusKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> NexusKVStats | None:
        return NexusKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> NexusKVPromMetrics:  # fmt: skip
        return NexusKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Stop loads, flush the writer (disk tiers write behind), close the kernel when the last role leaves."""
        self.worker.close()
        shared.release(self._kernel_key)
