"""Which vLLM fields become which NexusKV identity field.

The model, tokenizer and layout come from the engine; the tenant, scope, cache salt and adapter from a request.

NexusKV keys, not vLLM's block hashes, decide reuse, so every field that changes what a block of KV holds must
reach the key: the weights actually loaded (a content hash of the weight files, not only the name), the dtype and
the KV-cache dtype, the quantization, the LoRA adapter's weights, the tenant and the salt. docs/vllm.md has the
table. Nothing here imports vLLM: the connector passes plain values, so the mapping is testable on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import define

from nexuskv import AdapterIdentity, Layout, ModelIdentity, StateGroup, TokenizerIdentity

__all__ = ["EngineIdentity", "RequestScope", "adapter_identity", "files_digest", "request_scope"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt")  # fmt: skip
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")

_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
_digests_lock = threading.Lock()


def files_digest(root: str | os.PathLike[str], names: tuple[str, ...] | None = None,
                 suffixes: tuple[str, ...] = ()) -> str:  # fmt: skip
    """BLAKE2b-128 over the content of the named files (or those with `suffixes`) in `root`, in name order.

    "" when `root` is not a local directory (a hub name: the caller then needs an explicit hash). Results are
    cached per (path, size, mtime) of every file, so a long-lived process hashes each model once.
    """
    path = Path(root)
    if not path.is_dir():
        return ""
    files = sorted(p for p in path.iterdir() if p.is_file() and (
        (names is not None and p.name in names) or (suffixes and p.name.endswith(suffixes))))  # fmt: skip
    stat = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    cache_key = (str(path.resolve()), stat)
    with _digests_lock:
        if cache_key in _digests:
            return _digests[cache_key]
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            h.update(hashlib.file_digest(f, "blake2b").digest())
    digest = h.hexdigest()
    with _digests_lock:
        _digests[cache_key] = digest
    return digest


@define(frozen=True)
class EngineIdentity:
    """The identity fields one vLLM engine gives every request: model, tokenizer and KV layout."""

    model: ModelIdentity
    tokenizer: TokenizerIdentity
    layout: Layout

    @classmethod
    def build(cls, *, model: str, served_name: str = "", revision: str | None = None, dtype: str,
              quantization: str | None = None, kv_cache_dtype: str = "auto", tokenizer: str | None = None,
              tokenizer_revision: str | None = None, layers: int, kv_heads: int, head_dim: int, block_size: int,
              tp_size: int = 1, tp_rank: int = 0, weights_hash: str = "") -> EngineIdentity:  # fmt: skip
        """From the vLLM config's values (see `from_vllm_config`); `weights_hash` overrides the content hash."""
        weights = weights_hash or files_digest(model, suffixes=WEIGHT_SUFFIXES)
        if not weights:
            raise ValueError(f"model {model!r} is not a local directory: set kv_connector_extra_config "
                             "'weights_hash' to a hash of the weights it loads (the revision alone is a name)")
        quant = quantization or "none"
        if kv_cache_dtype not in ("", "auto"):
            quant = f"{quant}+kv-{kv_cache_dtype}"  # an fp8 KV cache holds other bytes than a bf16 one
        tok_path = tokenizer or model
        return cls(
            model=ModelIdentity(name=served_name or Path(model).name or model, revision=revision or "",
                                weights_hash=weights, dtype=dtype.removeprefix("torch."), quantization=quant),
            tokenizer=TokenizerIdentity(name=Path(tok_path).name or tok_path, revision=tokenizer_revision or "",
                                        hash=files_digest(tok_path, names=TOKENIZER_FILES)),
            layout=Layout(groups=(StateGroup(kind="dense", layers=layers, kv_heads=kv_heads, head_dim=head_dim),),
                          page_size=block_size, tp_rank=tp_rank, tp_size=tp_size),
        )  # fmt: skip

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, extra: Mapping[str, Any]) -> EngineIdentity:
        """Read the fields off a `VllmConfig` (kv_connector_extra_config may override the weights hash)."""
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        return cls.build(
            model=str(mc.model), served_name=str(extra.get("model_name") or ""), revision=mc.revision,
            dtype=str(mc.dtype), quantization=mc.quantization, kv_cache_dtype=str(cc.cache_dtype),
            tokenizer=mc.tokenizer, tokenizer_revision=mc.tokenizer_revision,
            layers=int(mc.get_num_layers(pc)), kv_heads=int(mc.get_num_kv_heads(pc)), head_dim=int(mc.get_head_size()),
            block_size=int(cc.block_size), tp_size=int(pc.tensor_parallel_size),
            weights_hash=str(extra.get("weights_hash") or ""),
        )  # fmt: skip


def adapter_identity(name: str, path: str | None) -> AdapterIdentity:
    """A LoRA adapter's identity: its name *and* a content hash of its files, scale alpha / r.

    Another adapter under the same name is another identity; the scale comes from adapter_config.json.
    """
    scale = 1.0
    weights = files_digest(path, names=ADAPTER_FILES) if path else ""
    if path:
        try:
            cfg = json.loads((Path(path) / "adapter_config.json").read_text())
            scale = float(cfg.get("lora_alpha", 1.0)) / float(cfg.get("r", 1.0) or 1.0)
        except (OSError, ValueError, TypeError):
            pass
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: no adapter files at {path!r} to hash; its state cannot be keyed")
    return AdapterIdentity(name=name, weights_hash=weights, scale=scale)


@define(frozen=True)
class RequestScope:
    """Who a request's state belongs to: tenant, scope inside the tenant, and cache salt."""

    tenant: str
    scope: str = ""
    cache_salt: str = ""


def request_scope(kv_transfer_params: Mapping[str, Any] | None, cache_salt: str | None,
                  default_tenant: str | None) -> RequestScope | None:  # fmt: skip
    """The request's tenant, scope and salt; None when it has no tenant (nothing is reused or stored).

    Tenant and scope come from `kv_transfer_params` ({"tenant": ..., "scope": ...}, set by the trusted front end),
    else the connector's default tenant; the salt is vLLM's `cache_salt`.
    """
    params = kv_transfer_params or {}
    if not isinstance(params, Mapping):
        return None
    tenant = params.get("tenant", default_tenant)
    scope = params.get("scope", "")
    if not isinstance(tenant, str) or not tenant or not isinstance(scope, str):
        return None
    return RequestScope(tenant=tenant, scope=scope, cache_salt=cache_salt or "")
