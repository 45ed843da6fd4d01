"""NexusKV as an SGLang HiCache storage backend (L3): identity-keyed pages and existence answers that are decisions.

SGLang loads it as a `dynamic` backend::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "nexuskv",
      "module_path": "nexuskv_sglang.backend", "class_name": "NexusKVStorage",
      "nexuskv_config": "/etc/nexuskv/kernel.toml", "tenant": "chat", "interface_v1": 1}'

What it answers:

- `batch_exists(keys)` is the number of leading pages *worth fetching*: the kernel plans the run (the tenant's
  policy, the tiers' and links' measured speeds, the deadline) and answers the pages of a `materialize` plan, or
  0 when recomputing them is predicted faster, the policy refuses reuse, or anything fails (fail-open). SGLang's
  prefetch then waits only for pages that beat recomputing.
- `get` / `batch_get` / `batch_get_v1` load pages through the kernel: checksums and MACs are verified, a page
  that does not verify is quarantined and answered as missing (SGLang recomputes it), never handed over.
- `set` / `batch_set` / `batch_set_v1` commit pages through the kernel's bounded writer: what its bounds refuse
  is answered False; the tenant's admit and place rules then apply in the writer (a page they refuse is logged,
  counted and never stored, so a later `batch_exists` does not count it).
- The multi-pool `*_v2` calls (hybrid models) map SGLang's KV pool to a dense / latent group, its sliding-window
  pool to a `windowed` group and its Mamba pool to a `recurrent` group of one layout (`_pools`): one plan answers
  for all pools, and `batch_exists_v2` gives SGLang the restorable prefix lengths its trailing-page pools allow.
- `get_stats()` is the kernel's decision counts and this backend's page counts.

Pages are keyed with the backend's full identity (`_pages`): model (name, revision, adapter, dtype), tokenizer,
tenant, scope, cache salt and rank, under the deployment secret.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from nexuskv import Kernel, PlanAction, get_logger
from nexuskv_sglang._pages import Identity, Pages
from nexuskv_sglang._pools import Pool, pools_of
from nexuskv_sglang._reads import Approvals, PageReader, Sink

__all__ = ["NexusKVStorage"]

log = get_logger("nexuskv_sglang")
KV = PoolName.KV.value
# Payloads are read into SGLang's pages without an intermediate copy: the tensor over a read-only payload is only
# ever copied from, so torch's "buffer is not writable" warning says nothing here.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class NexusKVStorage(HiCacheStorage):
    """SGLang's `HiCacheStorage` over a NexusKV kernel (see the module docstring). Thread-safe."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None, *,
                 kernel: Kernel | None = None) -> None:  # fmt: skip
        """Build from SGLang's config: `extra_config` names the kernel's TOML (`nexuskv_config`) and the tenant.

        `kernel=` hands over a kernel built elsewhere (an embedding process, tests); it is not closed here.
        """
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self.identity = Identity(storage_config)
        self._own_kernel = kernel is None
        if kernel is None:
            path = extra.get("nexuskv_config")
            if not path:
                raise ValueError("nexuskv: extra_config needs 'nexuskv_config' (the kernel's TOML config file)")
            kernel = Kernel.from_config(path)
        self.kernel = kernel
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}
        self.pools: dict[str, Pool] = {}
        self._pages: Pages | None = None
        self._lock = threading.Lock()
        self.reader = PageReader(kernel)
        ttl = float(extra.get("approval_ttl_s", 30.0))
        if not 0.0 <= ttl <= 3600.0:  # an approval outlives a policy change by at most this long
            raise ValueError(f"nexuskv: extra_config approval_ttl_s must be 0..3600 seconds, got {ttl!r}")
        self.approvals = Approvals(ttl)
        self._ops: dict[str, list[int]] = {"prefetch": [], "backup": []}  # pages per call, for SGLang's metrics
        self.counts = {"exists_pages": 0, "worth_pages": 0, "get_pages": 0, "got_pages": 0, "set_pages": 0,
                       "stored_pages": 0, "refused_pages": 0}  # fmt: skip

    # ------------------------------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host KV pool (the anchor): layout, dtype and page size come from it."""
        with self._lock:
            if self._pages is not None:
                raise RuntimeError("nexuskv: the host KV pool is registered already and pages are keyed by it")
            self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's further host pool (`swa`, `mamba`): a group of the layout (`_pools`)."""
        with self._lock:
            if self._pages is not None and str(host_pool_name) not in self.pools:
                log.error("nexuskv: a host pool registered after the first call is not served; SGLang recomputes "
                          "its state", pool=str(host_pool_name))  # fmt: skip
            self.registered_pools[str(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        """Every pool is known: build the layout now, so a pool NexusKV cannot map fails SGLang's attach, named."""
        self._ready()

    @property
    def pages(self) -> Pages | None:
        """Requests and keys for this backend's identity and layout (None until SGLang's pools are registered)."""
        return self._pages

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page."""
        self._ready()
        return self.pools[KV].page_bytes

    def _ready(self) -> Pages:
        pages = self._pages
        if pages is not None:
            return pages
        with self._lock:
            if self._pages is None:
                if self.mem_pool_host is None:
                    raise RuntimeError("nexuskv: SGLang has not registered its host pool (register_mem_pool_host)")
                layout, pools = pools_of(self.mem_pool_host, self.registered_pools, self.config)
                dtype = str(self.mem_pool_host.dtype).removeprefix("torch.")
                self.pools = pools
                self._pages = Pages(self.kernel, self.identity, layout, dtype)
                log.info("nexuskv storage backend ready", tenant=self.identity.tenant, model=self._pages.model.name,
                         kind=layout.kind, pools=sorted(pools), page_size=layout.page_size,
                         page_bytes=pools[KV].page_bytes)  # fmt: skip
            return self._pages

    def _count(self, **add: int) -> None:
        with self._lock:
            for k, v in add.items():
                self.counts[k] += v

    # ------------------------------------------------------------------------------------------ existence

    def exists(self, key: str) -> bool:
        """Whether one page is held (under this identity), whether or not fetching it would pay."""
        pages = self._ready()
        return self.kernel.index.get(pages.keys([key])[0]) is not None

    def plan(self, keys: Sequence[str]) -> Any:
        """The kernel's plan for a run of pages (its reasons say why pages are or are not worth fetching)."""
        return self._plan(keys)[0]

    def _plan(self, keys: Sequence[str]) -> tuple[Any, list[bytes]]:
        pages = self._ready()
        block_keys = pages.keys(keys)
        return self.kernel.plan(pages.request(len(keys)), keys=block_keys), block_keys

    def _worth(self, keys: Sequence[str]) -> tuple[int, list[bytes]]:
        """How many leading pages of `keys` the kernel's plan restores (0 unless it materializes), and their keys."""
        plan, block_keys = self._plan(keys)
        worth = plan.tokens_reused // self._ready().layout.page_size if plan.action == PlanAction.MATERIALIZE else 0
        return worth, block_keys

    def _servable(self, keys: Sequence[str]) -> tuple[int, list[bytes]]:
        """How many leading pages of `keys` a read serves (and their keys).

        All of them when an existence answer approved them a moment ago (`Approvals`), else what a plan of this
        run says.
        """
        if self.approvals.approved(keys):
            return len(keys), self._ready().keys(keys)
        return self._worth(keys)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` are worth fetching: the pages of the kernel's plan, else 0."""
        if not keys:
            return 0
        worth, _ = self._worth(keys)
        self.approvals.approve(keys[:worth])
        self._count(exists_pages=len(keys), worth_pages=worth)
        return worth

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:  # fmt: skip
        """The usable prefix over every pool: the kernel's plan, cut where each trailing-page pool holds its window.

        `restorable_prefix_pages` lists every prefix length up to the plan's that every pool can restore (SGLang
        intersects them across ranks); `extra_pool_hit_pages` is each pool's own longest restorable prefix.
        """
        transfers = list(pool_transfers or ())
        if not keys or not self._mapped(transfers, "batch_exists_v2"):
            return PoolTransferResult(0, {}, [])
        worth, block_keys = self._worth(keys)
        index = self.kernel.index
        masks = [0 if (h := index.get(k)) is None else h.mask_at() for k in block_keys[:worth]]
        restorable = list(range(1, worth + 1))
        hits: dict[str, int] = {KV: worth} if worth else {}
        for t in transfers:
            if str(t.name) == KV:
                continue
            bit = 1 << self.pools[str(t.name)].group
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                n = max(1, len(t.keys or ()))
                ok = {p for p in restorable if all(masks[i] & bit for i in range(max(0, p - n), p))}
            else:  # ALL_PAGES (BLOCK_GROUPS pools are not mapped)
                cut = next((i for i in range(worth) if not masks[i] & bit), worth)
                ok = set(range(1, cut + 1))
            if ok:
                hits[str(t.name)] = max(ok)
            restorable = [p for p in restorable if p in ok]
        final = restorable[-1] if restorable else 0
        self.approvals.approve(keys[:final])
        self._count(exists_pages=len(keys), worth_pages=final)
        return PoolTransferResult(final, hits, restorable)

    def _mapped(self, transfers: Sequence[PoolTransfer], call: str) -> bool:
        """True when every transfer names a pool NexusKV maps with a hit policy it implements (else logged)."""
        try:
            self._ready()
        except ValueError as e:
            log.error("nexuskv: SGLang's pools are not mapped; it recomputes", call=call, error=str(e))
            return False
        bad = [str(t.name) for t in transfers
               if str(t.name) not in self.pools or t.hit_policy == PoolHitPolicy.BLOCK_GROUPS]  # fmt: skip
        if bad:
            log.warning("nexuskv: a pool without a NexusKV group; SGLang recomputes", call=call, pools=bad)
        return not bad

    # ------------------------------------------------------------------------------------------ reads

    def _load(self, keys: Sequence[str], sink: Sink) -> int:
        """Read the KV pages of `keys` worth reading into `sink`; how many leading pages arrived (the rest: None).

        Not worth fetching now, refused, missing, or failing its checksum or MAC: SGLang recomputes that page and
        the rest. A read serves what an existence answer approved, else what a plan of the run says, so it never
        bypasses the tenant's policy or the deadline. Pages are read by key, not by position: SGLang's page hashes
        fix a page's prefix, and a run it reads need not start where the run it stored did.
        """
        worth, block_keys = self._servable(keys)
        got = self.reader.read(self.pools[KV], block_keys, worth, sink)
        self._count(get_pages=len(keys), got_pages=got)
        self._op("prefetch", got)
        return got

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page into `target_location` (a flat host tensor); None when it cannot be served."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:  # fmt: skip
        """Pages into `target_locations` (SGLang's dummy flat pages); None for each page that cannot be served."""
        targets: list[torch.Tensor | None] = list(target_locations or [None] * len(keys))

        def sink(i: int, src: torch.Tensor) -> None:
            if targets[i] is None:
                targets[i] = torch.empty_like(src)
            targets[i].view(torch.uint8).copy_(src.view(torch.uint8))

        got = self._load(keys, sink)
        return [t if i < got else None for i, t in enumerate(targets)]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:  # fmt: skip
        """Pages straight into SGLang's host pool at `host_indices` (a page per `page_size` indices)."""
        self._ready()
        got = self._load(keys, self._into(self.pools[KV], host_indices))
        return [i < got for i in range(len(keys))]

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:  # fmt: skip
        """Each pool's pages into its host pool, planned once over the KV run.

        A pool's page is read only when its page is among the plan's (so a read never bypasses the tenant's
        policy); each pool stops at its first page that fails.
        """
        out = {str(t.name): [False] * len(t.keys or ()) for t in transfers}
        if not transfers or not self._mapped(transfers, "batch_get_v2"):
            return out
        kv = next((t for t in transfers if str(t.name) == KV), None)
        allowed: dict[str, bytes] = {}
        if kv is not None and kv.keys:
            worth, block_keys = self._servable(list(kv.keys))
            allowed = dict(zip(list(kv.keys)[:worth], block_keys[:worth], strict=True))
        for t in transfers:
            pool, keys = self.pools[str(t.name)], list(t.keys or ())
            if not self._indices_fit(t, pool, "batch_get_v2"):
                continue
            if kv is None:  # a pool read on its own (SGLang reads the KV run first): what an answer approved
                n = next((i for i, k in enumerate(keys) if not self.approvals.approved([k])), len(keys))
                allowed.update(zip(keys[:n], self._ready().keys(keys[:n]), strict=True))
            n = next((i for i, key in enumerate(keys) if key not in allowed), len(keys))  # only the served pages
            got = self.reader.read(pool, [allowed[k] for k in keys[:n]], n, self._into(pool, t.host_indices))
            out[str(t.name)] = [i < got for i in range(len(keys))]
            self._count(get_pages=len(keys), got_pages=got)
            self._op("prefetch", got)
        return out

    @staticmethod
    def _into(pool: Pool, host_indices: torch.Tensor) -> Sink:
        """The sink that copies page i into `pool` at its i-th page of `host_indices`."""
        return lambda i, src: pool.host.set_from_flat_data_page(int(host_indices[i * pool.page_size]), src)

    @staticmethod
    def _indices_fit(t: PoolTransfer, pool: Pool, call: str) -> bool:
        want = len(t.keys or ()) * pool.page_size
        if t.host_indices is None or t.host_indices.numel() != want:
            log.error("nexuskv: host indices do not fit the keys; nothing moved", call=call, pool=pool.name,
                      expected=want, got=0 if t.host_indices is None else t.host_indices.numel())  # fmt: skip
            return False
        return True

    # ------------------------------------------------------------------------------------------ writes

    def _commit(self, keys: Sequence[str], payloads: Sequence[bytes], group: int = 0) -> list[bool]:
        """Commit pages (of one group) through the kernel's bounded writer and the tenant's rules; which were taken."""
        pages = self._ready()
        request = pages.request(len(keys))
        result = self.kernel.commit(request, {(b, group): p for b, p in enumerate(payloads)}, keys=pages.keys(keys))
        ok = [b < result.accepted for b in range(len(keys))]  # the writer takes a prefix, refuses the rest
        self._count(set_pages=len(keys), stored_pages=sum(ok), refused_pages=len(keys) - sum(ok))
        self._op("backup", sum(ok))
        return ok

    @staticmethod
    def _bytes(value: torch.Tensor) -> bytes:
        return value.contiguous().view(torch.uint8).numpy().tobytes()

    @classmethod
    def _pages_of(cls, pool: Pool, host_indices: torch.Tensor, n: int) -> list[bytes]:
        """The bytes of `n` pages of `pool` at `host_indices` (a page per `pool.page_size` indices)."""
        return [cls._bytes(pool.host.get_data_page(int(host_indices[i * pool.page_size]), flat=True))
                for i in range(n)]  # fmt: skip

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page (a flat host tensor)."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:  # fmt: skip
        """Store pages; True only when every page was accepted."""
        return all(self._commit(keys, [self._bytes(v) for v in values]))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:  # fmt: skip
        """Pages straight from SGLang's host pool at `host_indices`."""
        self._ready()
        return self._commit(keys, self._pages_of(self.pools[KV], host_indices, len(keys)))

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:  # fmt: skip
        """Each pool's pages from its host pool, committed to the pool's group."""
        out = {str(t.name): [False] * len(t.keys or ()) for t in transfers}
        if not transfers or not self._mapped(transfers, "batch_set_v2"):
            return out
        for t in transfers:
            pool, keys = self.pools[str(t.name)], list(t.keys or ())
            if keys and self._indices_fit(t, pool, "batch_set_v2"):
                out[str(t.name)] = self._commit(keys, self._pages_of(pool, t.host_indices, len(keys)), pool.group)
        return out

    # ------------------------------------------------------------------------------------------ the rest

    def _op(self, kind: str, pages: int) -> None:
        with self._lock:
            ops = self._ops[kind]
            if len(ops) < 4096:  # drained by SGLang's metrics loop; bounded when nobody drains
                ops.append(pages)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics`: pages per read and per write since the last call; NexusKV's counts as `.nexuskv`.

        SGLang's metrics loop calls it every step and needs that type (`stats()` gives the counts alone).
        """
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            prefetch, backup = self._ops["prefetch"], self._ops["backup"]
            self._ops = {"prefetch": [], "backup": []}
        metrics = StorageMetrics(prefetch_pgs=prefetch, backup_pgs=backup)
        metrics.nexuskv = self.stats()
        return metrics

    def stats(self) -> dict[str, Any]:
        """This backend's page counts and the kernel's decision count."""
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
        out["decisions"] = self.kernel.decisions
        return out

    def clear(self) -> None:
        """SGLang's "clear the L3 cache": NexusKV's tiers are shared and evict by policy; nothing is dropped here."""
        log.info("nexuskv storage backend: clear() asked; shared tiers are not cleared from one server")

    def close(self) -> None:
        """Stop the reader threads; close the kernel this backend built (not one it was handed)."""
        self.reader.close()
        if self._own_kernel:
            self.kernel.close()
