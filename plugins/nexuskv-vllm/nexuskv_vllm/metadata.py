"""What the connector's two sides tell each other every step.

Scheduler -> worker (`NexusKVMetadata`, in `SchedulerOutput.kv_connector_metadata`): blocks to load (each load
synchronous, before the forward, or asynchronous, in the background while other requests run), blocks to save,
and the requests vLLM preempted. With the `mp` executor it is pickled to every worker process: plain values and
the kernel's attrs contracts only, the plans sealed (a worker's kernel loads nothing whose MAC does not check).

Worker -> scheduler (`NexusKVWorkerMeta`, in `KVConnectorOutput.kv_connector_worker_meta`): which blocks each rank
stored and which it lost. vLLM folds the ranks' reports into one (`aggregate`); the scheduler keeps each block's
mask of holding ranks across steps, indexes a block while every rank holds its shard and drops it when one lost
it, so its index does not promise a block one rank lacks (and when it does anyway, that rank's load fails and every
rank recomputes: vLLM unions the failed blocks of all ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from nexuskv import Plan, Request

__all__ = ["LoadSpec", "NexusKVMetadata", "NexusKVWorkerMeta", "SaveSpec"]


@dataclass
class LoadSpec:
    """Load blocks [first, first + len(block_ids)) of the plan into vLLM's blocks `block_ids`.

    `keys` are the scheduler's (rank 0's) keys; a worker of another rank derives its own from `request`.
    """

    req_id: str
    request: Request
    keys: list[bytes]
    plan: Plan
    first: int
    block_ids: list[int]
    asynchronous: bool = False
    group_ids: list[list[int]] | None = None  # hybrid: per KV cache group, the vLLM ids to fill (see `hybrid`)


@dataclass
class SaveSpec:
    """Save the request's blocks `blocks` (indices in the request) held in vLLM's blocks `block_ids`."""

    req_id: str
    request: Request
    keys: list[bytes]
    blocks: list[int]
    block_ids: list[int]
    group_ids: list[list[list[int]]] | None = None  # hybrid: per saved block, per group, the vLLM ids of its payload


@dataclass
class NexusKVMetadata(KVConnectorMetadata):
    """One step's loads, saves (copied after each layer, committed after the step) and preempted requests."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass
class NexusKVWorkerMeta(KVConnectorWorkerMetadata):
    """One step's report, one rank's or several ranks' folded together, by the scheduler's (rank 0's) keys.

    `stored[key]` = (tier, node, epoch, ranks, groups): where the first reporting rank holds the block, the bit mask
    of the ranks that report it stored in this step, and the state groups every one of them holds. `removed[key]`
    = the ranks that lost it. Ranks may place a block in different steps: the scheduler keeps each key's mask of
    holding ranks over steps and indexes the block while it is every rank's.
    """

    stored: dict[bytes, tuple[str, str, int, int, int]] = field(default_factory=dict)
    removed: dict[bytes, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> NexusKVWorkerMeta:
        """Rank masks united, group masks intersected (vLLM folds the ranks' reports into rank 0's with this)."""
        if not isinstance(other, NexusKVWorkerMeta):
            return self
        stored = dict(self.stored)
        for key, (tier, node, epoch, ranks, groups) in other.stored.items():
            mine = stored.get(key)
            stored[key] = (tier, node, epoch, ranks, groups) if mine is None else \
                (*mine[:3], mine[3] | ranks, mine[4] & groups)  # fmt: skip
        removed = dict(self.removed)
        for key, ranks in other.removed.items():
            removed[key] = removed.get(key, 0) | ranks
        return NexusKVWorkerMeta(stored=stored, removed=removed)
