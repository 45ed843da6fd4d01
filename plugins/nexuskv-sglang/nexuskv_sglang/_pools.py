"""Private: SGLang's host pools as the groups of one NexusKV layout.

A hybrid SGLang model keeps several host pools: the KV pool (the anchor, full-attention layers: dense or MLA
latent pages), and beside it a sliding-window pool (`swa`, SWA layers' pages, of which a prefix needs only the
trailing window) or a Mamba pool (`mamba`, one recurrent-state checkpoint per page boundary, of which a prefix
needs only the one at its end). NexusKV models the same thing as one layout with one group per pool: KV is group
0 (`dense` / `latent`: every page of a prefix), SWA a `windowed` group and Mamba a `recurrent` group (both
checkpointed: valid at a cut only where the cut's page holds them). A page's payload for pool P is stored under
the page's block key in P's group, so one plan answers for all pools at once.

Other pools (DeepSeek's indexer and compressed pools, draft pools) are not mapped: a v2 call that names one is
answered "nothing stored / nothing worth fetching" (SGLang recomputes), with the pool named in the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from sglang.srt.mem_cache.hicache_storage import PoolName

from nexuskv import Layout, StateGroup

__all__ = ["POOL_ORDER", "Pool", "pools_of"]

POOL_ORDER = (PoolName.KV, PoolName.SWA, PoolName.MAMBA)
"""The pools mapped to NexusKV groups, in group order (a model has the KV pool and at most one of the others)."""


@attrs.frozen
class Pool:
    """One SGLang host pool as a NexusKV group."""

    name: str
    group: int
    host: Any
    page_size: int  # host indices per page (a Mamba pool has one checkpoint per page: 1)
    page_bytes: int
    flat_dtype: Any  # the dtype of the pool's flat pages (`get_dummy_flat_data_page`)


def _group(name: str, host: Any, storage_config: Any, extra: Mapping[str, Any], page_bytes: int) -> StateGroup:
    if name == PoolName.KV:
        if storage_config.is_mla_model:
            return StateGroup(kind="latent", layers=int(host.layer_num),
                              latent_dim=int(host.kv_lora_rank + host.qk_rope_head_dim))  # fmt: skip
        return StateGroup(kind="dense", layers=int(host.layer_num), kv_heads=int(host.head_num),
                          head_dim=int(host.head_dim))  # fmt: skip
    if name == PoolName.SWA:
        return StateGroup(kind="windowed", layers=int(host.layer_num), kv_heads=int(getattr(host, "head_num", 0)),
                          head_dim=int(getattr(host, "head_dim", 0)),
                          window=int(extra.get("swa_window", 0)))  # fmt: skip
    layers = int(host.num_mamba_layers)
    return StateGroup(kind="recurrent", layers=layers, latent_dim=max(1, page_bytes // layers))


def pools_of(anchor: Any, registered: Mapping[str, Any], storage_config: Any) -> tuple[Layout, dict[str, Pool]]:
    """The layout (one group per mapped pool) and each pool's group, from the anchor KV pool and the v2 pools.

    Raises ValueError for a pool NexusKV cannot map, naming it.
    """
    extra = dict(storage_config.extra_config or {})
    hosts: dict[str, Any] = {PoolName.KV.value: anchor}
    for name, host in registered.items():
        name = str(name)
        if name == PoolName.KV.value:
            continue  # the anchor, registered again through v2
        if name not in {p.value for p in POOL_ORDER}:
            raise ValueError(f"nexuskv: SGLang's '{name}' host pool has no NexusKV state kind (mapped: kv, swa, "
                             "mamba)")  # fmt: skip
        hosts[name] = host
    if PoolName.SWA.value in hosts and PoolName.MAMBA.value in hosts:
        raise ValueError("nexuskv: a model with both a sliding-window and a Mamba pool is not mapped")
    if len(hosts) > 1 and storage_config.is_mla_model and int(storage_config.tp_size) > 1:
        # SGLang writes MLA pages from one rank only, but a hybrid layout keys every group by rank (Mamba state
        # differs by rank): ranks other than the writer would never find their KV pages
        raise ValueError("nexuskv: an MLA model with a Mamba or sliding-window pool at tensor parallel > 1 is not "
                         "mapped (its latent pages are written by one rank; the hybrid layout keys them per rank)")
    groups: list[StateGroup] = []
    pools: dict[str, Pool] = {}
    for name in (p.value for p in POOL_ORDER):
        if name not in hosts:
            continue
        host = hosts[name]
        dummy = host.get_dummy_flat_data_page()
        page_bytes = dummy.numel() * dummy.element_size()
        pools[name] = Pool(name, len(groups), host, int(host.page_size), page_bytes, dummy.dtype)
        groups.append(_group(name, host, storage_config, extra, page_bytes))
    tp = (int(storage_config.tp_rank), int(storage_config.tp_size))
    return Layout(groups=groups, page_size=int(anchor.page_size), tp_rank=tp[0], tp_size=tp[1]), pools
