"""Hybrid models: vLLM's KV cache groups as NexusKV state groups, and which vLLM blocks each group's state is.

With vLLM's hybrid KV cache manager (HMA, the connector is `SupportsHMA`) a model with sliding-window and full
attention layers has several KV cache groups, each with its own block table. A full-attention group is NexusKV
`dense` state: one payload per block, every page-aligned prefix restorable. A sliding-window group is `windowed`:
after a cut at block b the next token attends only to the last `window - 1` positions, which vLLM holds in the
`window_blocks(window, block_size)` blocks ending at b (it frees the blocks before them: their ids become 0, the
null block). So the group's state at b is one checkpoint payload holding those blocks, saved for every block the
engine completes; a cut is restorable where every dense group holds all blocks before it and every windowed group
holds a checkpoint at its last block (the kernel's restore points). Groups of any other kind (state-space layers,
`MambaSpec`) are refused with the group named: the connector does not move recurrent state yet.

Group payloads are layer-major: for each of the group's layers in order, that layer's slices of the payload's
blocks (`cache[layer][ids]`), back to back; the descriptor's tensor specs say so (`group_specs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attrs import define

from nexuskv import StateGroup, TensorSpec

__all__ = ["KVGroup", "group_specs", "kv_groups", "window_blocks"]


@define(frozen=True)
class KVGroup:
    """One vLLM KV cache group, as NexusKV sees it."""

    kind: str  # "dense" or "windowed"
    layers: tuple[str, ...]
    kv_heads: int
    head_dim: int
    window: int = 0  # tokens (windowed only)

    def state_group(self) -> StateGroup:
        return StateGroup(kind=self.kind, layers=len(self.layers), kv_heads=self.kv_heads, head_dim=self.head_dim,
                          window=self.window)  # fmt: skip


def window_blocks(window: int, block: int) -> int:
    """Blocks a sliding-window group's state at a block boundary spans: those holding the last `window - 1` tokens."""
    return max(1, -(-(window - 1) // block))


def kv_groups(kv_cache_config: Any) -> tuple[KVGroup, ...] | None:
    """The groups of a vLLM `KVCacheConfig`; None when it has one group (the connector's single-group path).

    ValueError, naming the group, for a kind the connector cannot move.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        return None
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            out.append(KVGroup("windowed", tuple(g.layer_names), int(spec.num_kv_heads), int(spec.head_size),
                               int(spec.sliding_window)))  # fmt: skip
        elif isinstance(spec, FullAttentionSpec) and type(spec) is FullAttentionSpec:
            out.append(KVGroup("dense", tuple(g.layer_names), int(spec.num_kv_heads), int(spec.head_size)))
        else:
            raise ValueError(f"nexuskv_vllm: KV cache group {i} ({type(spec).__name__}, layers "
                             f"{list(g.layer_names)[:3]}...) is not full or sliding-window attention: the connector "
                             "does not move that state yet; run without the connector, or with "
                             "disable_hybrid_kv_cache_manager=True where vLLM can merge the groups")  # fmt: skip
    return tuple(out)


def group_specs(caches: dict[str, Any], layers: Sequence[str], blocks: int, dtype_name: Any) -> tuple[TensorSpec, ...]:
    """The tensor specs of a group payload of `blocks` blocks (layer-major, see the module docstring)."""
    return tuple(TensorSpec(name=name, dtype=dtype_name(caches[name].dtype),
                            shape=(blocks, *tuple(caches[name].shape[1:]))) for name in layers)  # fmt: skip
