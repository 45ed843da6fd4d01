"""The reference models: tiny random-weight transformers models of every state kind, built from configs.

Nothing is downloaded: each model is built from a config with a fixed seed, and its identity (weights hash,
dtype, adapter) is computed from the weights actually built, so two models share state only when their weights
are the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from attrs import define, field

from nexuskv import AdapterIdentity, Layout, ModelIdentity, StateGroup, StateKind, TokenizerIdentity

__all__ = ["KINDS", "SIZES", "ReferenceModel", "build_model", "layer_groups"]

VOCAB = 2048

SIZES: dict[str, dict[str, int]] = {
    # Unit tests: fast, still every code path (2 layers so hybrids have one layer of each type).
    "test": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128},
    # Demo, benchmarks and calibration: prefill costs that dominate Python overheads, 2 KiB of KV per token.
    "demo": {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 2, "head_dim": 32, "ffn": 1024},
}


def _common(s: dict[str, int]) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                initializer_range=0.2)  # fmt: skip


def _attn(s: dict[str, int]) -> dict[str, Any]:
    return dict(num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"])


def _dense(s: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(s), **_attn(s))


def _latent(s: dict[str, int]) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_common(s), num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                            kv_lora_rank=s["head_dim"], q_lora_rank=2 * s["head_dim"], qk_rope_head_dim=8,
                            qk_nope_head_dim=s["head_dim"], v_head_dim=s["head_dim"],
                            moe_intermediate_size=s["ffn"] // 4, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                            num_mtp_layers=0)  # fmt: skip


def _windowed(s: dict[str, int]) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_common(s), **_attn(s), sliding_window=32)


def _recurrent(s: dict[str, int]) -> Any:
    from transformers import Mamba2Config

    return Mamba2Config(vocab_size=VOCAB, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                        num_heads=2 * s["hidden"] // s["head_dim"], head_dim=s["head_dim"], expand=2, n_groups=1,
                        state_size=16, conv_kernel=4, chunk_size=16, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, initializer_range=0.2)  # fmt: skip


def _hybrid(s: dict[str, int]) -> Any:
    from transformers import Gemma3TextConfig

    layers = ["sliding_attention", "full_attention"] * (s["layers"] // 2)
    return Gemma3TextConfig(**_common(s), **_attn(s), sliding_window=32, layer_types=layers)


KINDS: dict[str, Callable[[dict[str, int]], Any]] = {
    "dense": _dense,  # Llama-style GQA
    "latent": _latent,  # DeepseekV3 multi-head latent attention
    "windowed": _windowed,  # Mistral, every layer sliding-window
    "recurrent": _recurrent,  # Mamba2
    "hybrid": _hybrid,  # Gemma3: sliding-window and full-attention layers
}

_FAMILY = {"dense": "llama", "latent": "deepseek-v3", "windowed": "mistral", "recurrent": "mamba2", "hybrid": "gemma3"}


def layer_groups(model: Any, kind: str) -> list[tuple[StateGroup, tuple[int, ...]]]:
    """The model's state groups and the cache layer indices of each, read off an empty cache for its config.

    Full-attention layers are one paged group (latent for MLA models), sliding-window layers one windowed group,
    linear-attention / SSM layers one recurrent group; paged groups come first.
    """
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    cfg = model.config
    cache = DynamicCache(config=cfg)
    by_kind: dict[StateKind, list[int]] = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            k = StateKind.RECURRENT
        elif isinstance(layer, DynamicSlidingWindowLayer):
            k = StateKind.WINDOWED
        else:
            k = StateKind.LATENT if kind == "latent" else StateKind.DENSE
        by_kind.setdefault(k, []).append(i)
    out = []
    for k in (StateKind.DENSE, StateKind.LATENT, StateKind.WINDOWED, StateKind.RECURRENT):
        layers = tuple(by_kind.get(k, ()))
        if not layers:
            continue
        if k == StateKind.RECURRENT:
            group = StateGroup(kind=k, layers=len(layers), latent_dim=int(getattr(cfg, "state_size", 0)))
        elif k == StateKind.LATENT:
            group = StateGroup(kind=k, layers=len(layers), latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        else:
            group = StateGroup(kind=k, layers=len(layers), kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               window=int(cfg.sliding_window or 0) if k == StateKind.WINDOWED else 0)  # fmt: skip
        out.append((group, layers))
    return out


def _weights_hash(model: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@define
class ReferenceModel:
    """A built model with everything the kernel needs to know about it."""

    kind: str
    size: str
    model: Any
    identity: ModelIdentity
    tokenizer: TokenizerIdentity
    groups: list[tuple[StateGroup, tuple[int, ...]]]
    page_size: int
    seed: int
    dtype: torch.dtype = field(default=torch.float32)

    @property
    def config(self) -> Any:
        """The transformers config."""
        return self.model.config

    @property
    def layout(self) -> Layout:
        """The kernel layout: one group per state kind, paged groups first."""
        return Layout(groups=tuple(g for g, _ in self.groups), page_size=self.page_size)

    def kv_bytes_per_token(self) -> int:
        """Bytes of paged state (dense / latent pages) per token, all layers."""
        item = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for g, _ in self.groups:
            if g.kind == StateKind.DENSE:
                total += g.layers * 2 * g.kv_heads * g.head_dim * item
            elif g.kind == StateKind.LATENT:
                total += g.layers * g.latent_dim * item
        return total


def _apply_adapter(model: Any, name: str, rank: int, seed: int) -> AdapterIdentity:
    """Merge a seeded low-rank (LoRA-style) delta into every attention query / value projection."""
    gen = torch.Generator().manual_seed(seed)
    h = hashlib.blake2b(digest_size=16)
    scale = 1.0
    for pname, param in sorted(model.named_parameters()):
        if param.dim() != 2 or not any(t in pname for t in ("q_proj", "v_proj", "q_b_proj", "in_proj")):
            continue
        out_f, in_f = param.shape
        a = torch.randn(rank, in_f, generator=gen) * 0.2
        b = torch.randn(out_f, rank, generator=gen) * 0.2
        with torch.no_grad():
            param += (scale * (b @ a)).to(param.dtype)
        h.update(pname.encode() + a.numpy().tobytes() + b.numpy().tobytes())
    return AdapterIdentity(name=name, weights_hash=h.hexdigest(), scale=scale)


def build_model(
    kind: str,
    *,
    size: str = "test",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    adapter: str | None = None,
    page_size: int = 16,
) -> ReferenceModel:
    """Build a tiny random-weight model of `kind` (`dense`, `latent`, `windowed`, `recurrent`, `hybrid`).

    `seed` fixes the weights; `adapter` merges a seeded low-rank adapter of that name. The identity's
    `weights_hash` covers every weight tensor, so another seed, dtype or adapter is another identity.
    """
    from transformers import AutoModelForCausalLM

    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r} (have: {sorted(KINDS)})")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r} (have: {sorted(SIZES)})")
    torch.manual_seed(seed)
    cfg = KINDS[kind](SIZES[size])
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    adapter_id = _apply_adapter(model, adapter, rank=4, seed=seed + 1000) if adapter else None
    dtype_name = str(dtype).removeprefix("torch.")
    identity = ModelIdentity(name=f"tiny-{_FAMILY[kind]}-{size}", revision=f"seed{seed}",
                             weights_hash=_weights_hash(model), dtype=dtype_name, adapter=adapter_id)  # fmt: skip
    tokenizer = TokenizerIdentity(name="byte-ids", revision=str(VOCAB))
    return ReferenceModel(kind=kind, size=size, model=model, identity=identity, tokenizer=tokenizer,
                          groups=layer_groups(model, kind), page_size=page_size, seed=seed, dtype=dtype)  # fmt: skip
