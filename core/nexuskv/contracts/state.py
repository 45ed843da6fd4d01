"""The state descriptor and what it names: namespace, model, adapter and tokenizer identity, layout, spans."""

from __future__ import annotations

import enum
from typing import ClassVar

from attrs import define, field

from nexuskv.contracts.fields import HEX_KEY, NAME, SCHEMA_VERSION
from nexuskv.contracts.schema import doc

__all__ = [
    "AdapterIdentity",
    "Layout",
    "ModelIdentity",
    "Namespace",
    "Placement",
    "StateDescriptor",
    "StateGroup",
    "StateKind",
    "TensorSpec",
    "TokenSpan",
    "TokenizerIdentity",
    "Usage",
]


class StateKind(enum.StrEnum):
    """How a group of model state may be cut and restored (see DESIGN.md, "Identity and semantic safety")."""

    DENSE = "dense"
    """MHA / GQA / MQA key-value pages: any page-aligned prefix is a valid restore point."""
    LATENT = "latent"
    """MLA compressed latent pages: any page-aligned prefix is valid; replicated across TP ranks."""
    WINDOWED = "windowed"
    """Sliding-window state: valid only at saved window checkpoints, with the absolute position restored."""
    RECURRENT = "recurrent"
    """SSM / linear-attention O(1) snapshot: valid only at exact checkpoint positions."""

    @property
    def checkpointed(self) -> bool:
        """True for kinds restorable only where a checkpoint was saved (not at every page)."""
        return self in (StateKind.WINDOWED, StateKind.RECURRENT)


@define(frozen=True)
class Namespace:
    """Who may share state: the tenant, the sharing scope inside it, and an optional cache salt."""

    tenant: str = field(metadata=doc("Tenant that produced or requests the state.", **NAME))
    scope: str = field(default="", metadata=doc("Sharing scope inside the tenant; empty means the tenant."))
    cache_salt: str = field(default="", metadata=doc("Opaque salt; different salts never share state."))


@define(frozen=True)
class AdapterIdentity:
    """A LoRA or other adapter applied on top of the base weights."""

    name: str = field(metadata=doc("Adapter name.", **NAME))
    weights_hash: str = field(default="", metadata=doc("Hash of the adapter weights."))
    scale: float = field(default=1.0, metadata=doc("Adapter scaling factor (alpha / rank)."))


@define(frozen=True)
class ModelIdentity:
    """Everything about the weights that changes the state they produce."""

    name: str = field(metadata=doc("Model name, e.g. `llama-3-8b`.", **NAME))
    revision: str = field(default="", metadata=doc("Revision or commit of the weights."))
    weights_hash: str = field(default="", metadata=doc("Hash of the weights actually loaded."))
    dtype: str = field(default="float16", metadata=doc("Dtype the state is produced in.", **NAME))
    quantization: str = field(default="none", metadata=doc("Weight / KV quantization scheme.", **NAME))
    adapter: AdapterIdentity | None = field(default=None, metadata=doc("Adapter, if any."))


@define(frozen=True)
class TokenizerIdentity:
    """The tokenizer that produced the token ids (different tokenizers never share state)."""

    name: str = field(metadata=doc("Tokenizer name.", **NAME))
    revision: str = field(default="", metadata=doc("Tokenizer revision."))
    hash: str = field(default="", metadata=doc("Hash of the tokenizer files."))


@define(frozen=True)
class StateGroup:
    """One group of layers whose state shares a kind (a hybrid model has several groups)."""

    kind: StateKind = field(converter=StateKind, metadata=doc("State kind of this group."))
    layers: int = field(metadata=doc("Number of layers in the group.", minimum=1))
    kv_heads: int = field(default=0, metadata=doc("KV heads per layer (0 for latent / recurrent).", minimum=0))
    head_dim: int = field(default=0, metadata=doc("Head dimension (0 where not applicable).", minimum=0))
    latent_dim: int = field(default=0, metadata=doc("Latent (MLA) or state dimension.", minimum=0))
    window: int = field(default=0, metadata=doc("Sliding-window length in tokens (windowed only).", minimum=0))


@define(frozen=True)
class Layout:
    """Shape of the model state: its groups, the page size and the tensor-parallel placement."""

    groups: tuple[StateGroup, ...] = field(
        converter=tuple, metadata=doc("State groups; a hybrid model has more than one.", minItems=1, maxItems=16)
    )
    page_size: int = field(default=16, metadata=doc("Tokens per block (page).", minimum=1))
    tp_rank: int = field(default=0, metadata=doc("Tensor-parallel rank of this shard.", minimum=0))
    tp_size: int = field(default=1, metadata=doc("Tensor-parallel world size.", minimum=1))

    @property
    def kind(self) -> str:
        """The single group's kind, or `hybrid` when the model has several groups."""
        return self.groups[0].kind.value if len(self.groups) == 1 else "hybrid"

    @property
    def group_mask(self) -> int:
        """Bit mask with one bit set per group (bit i = group i)."""
        return (1 << len(self.groups)) - 1


@define(frozen=True)
class TokenSpan:
    """A half-open range [start, end) of token positions."""

    start: int = field(metadata=doc("First token position.", minimum=0))
    end: int = field(metadata=doc("One past the last token position.", minimum=0))


@define(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one raw tensor inside a payload, in payload order."""

    name: str = field(metadata=doc("Tensor name, e.g. `layer3.k`."))
    dtype: str = field(metadata=doc("Element dtype, e.g. `float32`."))
    shape: tuple[int, ...] = field(
        converter=tuple, metadata=doc("Tensor shape.", items={"minimum": 0}, maxItems=8)
    )


@define(frozen=True)
class Placement:
    """Where a payload lives: tier, node, and the node's epoch (fencing token) when it was written."""

    tier: str = field(metadata=doc("Tier name, e.g. `dram`, `disk`, `redis`.", **NAME))
    node: str = field(metadata=doc("Node name.", **NAME))
    epoch: int = field(default=0, metadata=doc("Node epoch at write time (fencing token).", minimum=0))


@define(frozen=True)
class Usage:
    """Usage statistics the eviction and placement policies read."""

    created_s: float = field(default=0.0, metadata=doc("Creation time, seconds since the epoch."))
    last_access_s: float = field(default=0.0, metadata=doc("Last access time, seconds since the epoch."))
    hits: int = field(default=0, metadata=doc("Times the state was reused.", minimum=0))


@define(frozen=True)
class StateDescriptor:
    """Everything the kernel knows about one stored block (or checkpoint) of model state."""

    CONTRACT: ClassVar[str] = "state-descriptor"

    key: str = field(metadata=doc("Block key: 32 hex digits (keyed BLAKE2b-128).", **HEX_KEY))
    namespace: Namespace = field(metadata=doc("Tenant scope and cache salt."))
    model: ModelIdentity = field(metadata=doc("Model identity."))
    tokenizer: TokenizerIdentity = field(metadata=doc("Tokenizer identity."))
    layout: Layout = field(metadata=doc("State layout."))
    span: TokenSpan = field(metadata=doc("Token span this state covers (checkpoints: [0, position))."))
    nbytes: int = field(metadata=doc("Payload size in bytes, after the codec.", minimum=0))
    checksum: str = field(
        metadata=doc("`algorithm:hexdigest` of the stored payload.", pattern="^[a-z0-9-]+:[0-9a-f]+$")
    )
    placement: Placement = field(metadata=doc("Where the payload lives."))
    parent_key: str | None = field(
        default=None, metadata=doc("Key of the previous block; null at the root.", **HEX_KEY)
    )
    group: int = field(default=0, metadata=doc("Index of the layout group this payload holds.", minimum=0))
    codec: str = field(default="raw", metadata=doc("Codec of the stored payload, e.g. `raw`, `zstd`.", **NAME))
    raw_nbytes: int = field(default=0, metadata=doc("Payload size before the codec (0: same as nbytes).", minimum=0))
    tensors: tuple[TensorSpec, ...] = field(
        factory=tuple, converter=tuple, metadata=doc("Raw tensors in the payload.", maxItems=1024)
    )
    usage: Usage = field(factory=Usage, metadata=doc("Usage statistics."))
    mac: str = field(
        default="",
        metadata=doc("Keyed MAC (BLAKE3, 128 bits, keyed by the deployment secret) over the payload and everything but "
                     "`placement` and `usage`, "
                     "set by the kernel when it stores the payload; empty before. A load refuses any other.",
                     pattern="^([0-9a-f]{32})?$"),
    )  # fmt: skip
    schema_version: int = field(default=SCHEMA_VERSION, metadata=doc("Contract version.", const=SCHEMA_VERSION))
