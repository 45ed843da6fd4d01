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
- `get_stats()` is the kernel's decision counts and this backend's page counts.

Pages are keyed with the backend's full identity (`_pages`): model (name, revision, adapter, dtype), tokenizer,
tenant, scope, cache salt and rank, under the deployment secret.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from nexuskv import Kernel, PlanAction, get_logger
from nexuskv_sglang._pages import Identity, Pages, layout_of

__all__ = ["NexusKVStorage"]

log = get_logger("nexuskv_sglang")


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
        self.pages: Pages | None = None
        self.page_bytes = 0
        self._lock = threading.Lock()
        self.counts = {"exists_pages": 0, "worth_pages": 0, "get_pages": 0, "got_pages": 0, "set_pages": 0,
                       "stored_pages": 0, "refused_pages": 0}  # fmt: skip

    # ------------------------------------------------------------------------------------------ set-up

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host KV pool: the layout, the dtype and the page size come from it."""
        super().register_mem_pool_host(mem_pool_host)
        layout = layout_of(mem_pool_host, self.config)
        dtype = str(mem_pool_host.dtype).removeprefix("torch.")
        self.pages = Pages(self.kernel, self.identity, layout, dtype)
        self.page_bytes = mem_pool_host.get_dummy_flat_data_page().numel() * mem_pool_host.dtype.itemsize
        log.info("nexuskv storage backend ready", tenant=self.identity.tenant, model=self.pages.model.name,
                 kind=layout.kind, page_size=layout.page_size, page_bytes=self.page_bytes)  # fmt: skip

    def _ready(self) -> Pages:
        if self.pages is None:
            raise RuntimeError("nexuskv: SGLang has not registered its host pool (register_mem_pool_host) yet")
        return self.pages

    def _count(self, **add: int) -> None:
        with self._lock:
            for k, v in add.items():
                self.counts[k] += v

    # ------------------------------------------------------------------------------------------ existence

    def exists(self, key: str) -> bool:
        """Whether one page is held (under this identity), whether or not fetching it would pay."""
        pages = self._ready()
        return self.kernel.index.get(pages.keys([key])[0]) is not None

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` are worth fetching: the pages of the kernel's plan, else 0."""
        if not keys:
            return 0
        plan = self.plan(keys)
        worth = plan.tokens_reused // self._ready().layout.page_size if plan.action == PlanAction.MATERIALIZE else 0
        self._count(exists_pages=len(keys), worth_pages=worth)
        return worth

    def plan(self, keys: Sequence[str]) -> Any:
        """The kernel's plan for a run of pages (its reasons say why pages are or are not worth fetching)."""
        pages = self._ready()
        return self.kernel.plan(pages.request(len(keys)), keys=pages.keys(keys))

    # ------------------------------------------------------------------------------------------ reads

    def _load(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        """Each page's verified payload, or None: SGLang recomputes that page and the rest.

        None means not worth fetching now, refused, missing, or failing its checksum or MAC. A get is planned as
        `batch_exists` is, so a read never bypasses the tenant's policy or the deadline. The plan's pages are
        then read one by one (`Kernel.load`: key, group and MAC verified; a bad page is
        quarantined), stopping at the first that fails: SGLang recomputes from there. Pages are read by key,
        not by position: SGLang's page hashes fix a page's prefix, and a run it reads need not start where the
        run it stored did.
        """
        pages = self._ready()
        block_keys = pages.keys(keys)
        out: list[bytes | memoryview | None] = [None] * len(keys)
        plan = self.kernel.plan(pages.request(len(keys)), keys=block_keys)
        worth = plan.tokens_reused // pages.layout.page_size if plan.action == PlanAction.MATERIALIZE else 0
        for b in range(worth):
            got = self.kernel.load(block_keys[b], 0)
            if got is None or len(got.payload) != self.page_bytes:
                log.warning("nexuskv: a page was not served; SGLang recomputes from it", tenant=self.identity.tenant,
                            page=b, pages=len(keys), why="missing or failed verification" if got is None else
                            f"{len(got.payload)} bytes, a page is {self.page_bytes}")  # fmt: skip
                break
            out[b] = got.payload
        self._count(get_pages=len(keys), got_pages=sum(p is not None for p in out))
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page into `target_location` (a flat host tensor); None when it cannot be served."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:  # fmt: skip
        """Pages into `target_locations` (SGLang's dummy flat pages); None for each page that cannot be served."""
        targets = list(target_locations or [None] * len(keys))
        out: list[torch.Tensor | None] = []
        for payload, target in zip(self._load(keys), targets, strict=True):
            if payload is None:
                out.append(None)
                continue
            src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if target is None:
                dtype = self.mem_pool_host.dtype
                target = torch.empty(self.page_bytes // dtype.itemsize, dtype=dtype)
            target.view(torch.uint8).copy_(src)
            out.append(target)
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:  # fmt: skip
        """Pages straight into SGLang's host pool at `host_indices` (a page per `page_size` indices)."""
        page = self._ready().layout.page_size
        ok: list[bool] = []
        for i, payload in enumerate(self._load(keys)):
            if payload is None:
                ok.append(False)
                continue
            flat = torch.frombuffer(bytearray(payload), dtype=self.mem_pool_host.dtype)
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * page].item()), flat)
            ok.append(True)
        return ok

    # ------------------------------------------------------------------------------------------ writes

    def _commit(self, keys: Sequence[str], payloads: Sequence[bytes]) -> list[bool]:
        """Commit pages through the kernel's bounded writer and the tenant's rules; which were accepted."""
        pages = self._ready()
        request = pages.request(len(keys))
        result = self.kernel.commit(request, {(b, 0): p for b, p in enumerate(payloads)}, keys=pages.keys(keys))
        ok = [b < result.accepted for b in range(len(keys))]  # the writer takes a prefix, refuses the rest
        self._count(set_pages=len(keys), stored_pages=sum(ok), refused_pages=len(keys) - sum(ok))
        return ok

    @staticmethod
    def _bytes(value: torch.Tensor) -> bytes:
        return value.contiguous().view(torch.uint8).numpy().tobytes()

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
        page = self._ready().layout.page_size
        payloads = [self._bytes(self.mem_pool_host.get_data_page(int(host_indices[i * page].item()), flat=True))
                    for i in range(len(keys))]  # fmt: skip
        return self._commit(keys, payloads)

    # ------------------------------------------------------------------------------------------ the rest

    def get_stats(self) -> dict[str, Any]:
        """This backend's page counts and the kernel's decision counts."""
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
        out["decisions"] = self.kernel.decisions
        return out

    def clear(self) -> None:
        """SGLang's "clear the L3 cache": NexusKV's tiers are shared and evict by policy; nothing is dropped here."""
        log.info("nexuskv storage backend: clear() asked; shared tiers are not cleared from one server")

    def close(self) -> None:
        """Close the kernel this backend built (not one it was handed)."""
        if self._own_kernel:
            self.kernel.close()
