"""`NexusKVConnector`: the vLLM V1 KV connector class that vLLM loads; it wires vLLM's calls to the kernel.

    kv_transfer_config = {
        "kv_connector": "NexusKVConnector",
        "kv_connector_module_path": "nexuskv_vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": "kernel.toml", "tenant": "default-tenant"},
    }

The engine must run its worker in the engine-core process (`distributed_executor_backend="uni"`): the
scheduler-side and worker-side connectors share one kernel (`shared`). Scheduler-side calls go to
`SchedulerSide`, worker-side calls to `WorkerSide`; this class holds no state of its own beyond them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from nexuskv import get_logger
from nexuskv_vllm import shared
from nexuskv_vllm.identity import EngineIdentity
from nexuskv_vllm.metadata import NexusKVMetadata
from nexuskv_vllm.scheduler import SchedulerSide
from nexuskv_vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = ["NexusKVConnector"]

log = get_logger(__name__)


class NexusKVConnector(KVConnectorBase_V1):
    """NexusKV decides, per request, what vLLM loads from the tiers, what it recomputes, and what it saves."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        if "config" not in extra:
            raise ValueError("nexuskv_vllm: kv_connector_extra_config needs 'config', the kernel's TOML file")
        backend = vllm_config.parallel_config.distributed_executor_backend  # resolved by vLLM before connectors
        if not (backend == "uni" or (isinstance(backend, type) and issubclass(backend, UniProcExecutor))):
            raise ValueError(f"nexuskv_vllm needs distributed_executor_backend='uni' (got {backend!r}): the "
                             "scheduler and the worker share one kernel in the engine-core process")  # fmt: skip
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            raise ValueError("nexuskv_vllm needs kv_load_failure_policy='recompute': a block that fails to load "
                             "must be recomputed, not fail the request")  # fmt: skip
        self._engine_id = str(tc.engine_id)
        self.kernel = shared.acquire(self._engine_id, extra["config"])
        try:
            self.identity = EngineIdentity.from_vllm_config(vllm_config, extra)
            self.scheduler = SchedulerSide(self.kernel, self.identity, default_tenant=extra.get("tenant"))
        except Exception:
            shared.release(self._engine_id)
            raise
        self.worker = WorkerSide(self.kernel)
        log.info("NexusKV connector ready", role=role.name, model=self.identity.model.name,
                 block_size=self.scheduler.block, tiers=list(self.kernel.tier_order))  # fmt: skip

    # ------------------------------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens vLLM takes from NexusKV beyond its own prefix cache (a plan that pays, the policy allowing)."""
        return self.scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember which of the request's new blocks to fill from NexusKV."""
        self.scheduler.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves, for the worker."""
        return self.scheduler.step(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks were saved as they filled (copied out in the step that filled them): vLLM may free them now."""
        self.scheduler.finished(request)
        return False, None

    # ------------------------------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged KV tensors, one per attention layer."""
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Read and verify this step's planned blocks before the forward."""
        meta = self._get_connector_metadata()
        if isinstance(meta, NexusKVMetadata) and meta.loads:
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Mount this layer's restored blocks."""
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Copy out this layer's part of the blocks this step completes."""
        meta = self._get_connector_metadata()
        if isinstance(meta, NexusKVMetadata) and meta.saves:
            self.worker.save_layer(layer_name, kv_layer, meta)

    def wait_for_save(self) -> None:
        """End the step: commit its completed blocks through the kernel's bounded writer, reset its state."""
        meta = self._connector_metadata
        if isinstance(meta, NexusKVMetadata):
            self.worker.end_step(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that were planned but not mounted: vLLM recomputes them."""
        return self.worker.take_errors()

    def shutdown(self) -> None:
        """Flush the writer (disk tiers write behind) and close the kernel when the last role leaves."""
        shared.release(self._engine_id)
