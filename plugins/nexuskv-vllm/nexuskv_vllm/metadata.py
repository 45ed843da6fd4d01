"""What the scheduler-side connector sends the worker-side one each step: blocks to load, blocks to save."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from nexuskv import Plan, Request

__all__ = ["LoadSpec", "NexusKVMetadata", "SaveSpec"]


@dataclass
class LoadSpec:
    """Load blocks [first, first + len(block_ids)) of the plan into vLLM's blocks `block_ids`."""

    req_id: str
    request: Request
    keys: list[bytes]
    plan: Plan
    first: int
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Save the request's blocks `blocks` (indices in the request) held in vLLM's blocks `block_ids`."""

    req_id: str
    request: Request
    keys: list[bytes]
    blocks: list[int]
    block_ids: list[int]


@dataclass
class NexusKVMetadata(KVConnectorMetadata):
    """One step's loads (before the forward) and saves (after each layer, committed after the step)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
