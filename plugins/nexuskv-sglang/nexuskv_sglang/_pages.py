"""Private: SGLang's pages as NexusKV requests and block keys, with the full identity SGLang's hashes lack.

SGLang names an L3 page by a hash of its tokens chained over the prefix (so a page hash already fixes the page's
position and everything before it), but not by model, tokenizer, tenant, cache salt or rank. `Pages` turns a run
of page hashes into a NexusKV `Request` (placeholder token ids, one block per page, the backend's identity and
the host pool's layout) and block keys: `blake2b(rank tag + page hash, key=request root)`, where the root is
the kernel's keyed root of (namespace, model, tokenizer, layout) under the deployment secret. Two backends whose
identity differs in anything never share a key; nobody without the secret can compute one. MLA latent state is
identical on every tensor-parallel rank and is keyed once (the kernel's `keyed_layout`); other state carries its
rank in the layout (a hybrid layout always does: Mamba state differs by rank), pipeline and context-parallel ranks
in the tag.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import Any

import attrs

from nexuskv import AdapterIdentity, Layout, ModelIdentity, Request, TokenizerIdentity

__all__ = ["Identity", "Pages"]

_PERSON = b"nexuskv.sglang"
_ids = itertools.count(1)


class Identity:
    """Who the backend's pages belong to, from SGLang's storage config and its `extra_config`."""

    __slots__ = ("cache_salt", "model", "rank_tag", "scope", "tenant", "tokenizer")

    def __init__(self, storage_config: Any) -> None:
        extra = dict(storage_config.extra_config or {})
        model_name = str(extra.get("model") or storage_config.model_name or "")
        if not model_name:
            raise ValueError("nexuskv: the model has no name (SGLang's model_name is empty and extra_config has no "
                             "'model')")  # fmt: skip
        tenant = extra.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("nexuskv: extra_config needs 'tenant' (the tenant every page of this server belongs to)")
        self.tenant = tenant
        self.scope = str(extra.get("scope", ""))
        self.cache_salt = str(extra.get("cache_salt", ""))
        adapter = extra.get("adapter")
        self.model = ModelIdentity(name=model_name, revision=str(extra.get("model_revision", "")),
                                   adapter=AdapterIdentity(name=str(adapter)) if adapter else None)  # fmt: skip
        self.tokenizer = TokenizerIdentity(name=str(extra.get("tokenizer") or model_name))
        cfg = storage_config
        self.rank_tag = (f"pp{cfg.pp_rank}/{cfg.pp_size}|cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}|"
                         f"dcp{getattr(cfg, 'dcp_rank', 0)}/{getattr(cfg, 'dcp_size', 1)}|").encode()  # fmt: skip


class Pages:
    """Requests and block keys for runs of SGLang page hashes (one identity, one layout)."""

    def __init__(self, kernel: Any, identity: Identity, layout: Layout, dtype: str) -> None:
        """`dtype`: the host pool's element type, part of the model's identity (pages of another dtype differ)."""
        if layout.page_size != kernel.keyer.page_size:
            raise ValueError(f"nexuskv: SGLang's page size {layout.page_size} is not the kernel's page_size "
                             f"{kernel.keyer.page_size} (set page_size = {layout.page_size} in the kernel "
                             "config)")  # fmt: skip
        self.kernel, self.identity, self.layout = kernel, identity, layout
        self.model = attrs.evolve(identity.model, dtype=dtype)
        probe = self.request(0)
        self._root = kernel.keyer.request_root(probe)

    def request(self, pages: int, request_id: str = "") -> Request:
        """A request of `pages` pages under this identity (token ids are placeholders: keys come from hashes)."""
        ident = self.identity
        return Request(request_id=request_id or f"sglang-{next(_ids)}", tenant=ident.tenant, model=self.model,
                       tokenizer=ident.tokenizer, layout=self.layout, token_ids=(0,) * (pages * self.layout.page_size),
                       scope=ident.scope, cache_salt=ident.cache_salt)  # fmt: skip

    def keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        """The block key of each page hash under this identity."""
        tag = self.identity.rank_tag
        return [hashlib.blake2b(tag + str(h).encode(), key=self._root, digest_size=16, person=_PERSON).digest()
                for h in page_hashes]  # fmt: skip
