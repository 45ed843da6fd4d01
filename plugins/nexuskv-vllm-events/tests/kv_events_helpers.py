"""Shared pieces of the KV-event tests: a router kernel, one engine's identity, its requests."""

from __future__ import annotations

import hashlib

from nexuskv_vllm_events import EngineResidency

from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    ModelIdentity,
    Namespace,
    NodeState,
    Request,
    StateGroup,
    TokenizerIdentity,
)

PAGE = 16
MODEL = ModelIdentity(name="tiny", revision="1", weights_hash="w" * 32)
TOKENIZER = TokenizerIdentity(name="tok")
LAYOUT = Layout(groups=(StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8),), page_size=PAGE)
NAMESPACES = {"salt-a": Namespace(tenant="a"), "salt-b": Namespace(tenant="b"), "": Namespace(tenant="anon")}


def router(node: str = "router") -> Kernel:
    cfg = KernelConfig(node=node, page_size=PAGE, tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}})
    return Kernel(cfg, secret=bytes(range(32)))


def residency(kernel: Kernel, node: str = "e1", **kw) -> EngineResidency:
    return EngineResidency(kernel, node=node, model=MODEL, tokenizer=TOKENIZER, layout=LAYOUT,
                           namespaces=kw.pop("namespaces", NAMESPACES), **kw)  # fmt: skip


def request(tokens, tenant: str = "a") -> Request:
    return Request(request_id="r", tenant=tenant, cache_salt="", model=MODEL, tokenizer=TOKENIZER, layout=LAYOUT,
                   token_ids=list(tokens))  # fmt: skip


def vhash(*parts: object) -> bytes:
    """A stand-in for vLLM's block hash (its value is opaque to the subscriber)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def resident_tokens(kernel: Kernel, req: Request, node: str = "e1") -> int:
    """Tokens of `req` a route prices as held in `node`'s engine cache."""
    decision = kernel.route(req, [NodeState(node)], deadline_ms=10_000)  # a busy machine: no tight budget here
    assert not decision.fail_open, decision.reasons
    return decision.options[0].reuse_tokens
