"""The language-neutral contracts: state descriptor, request, plan and cost profile as frozen attrs classes.

The JSON Schemas in `schemas/` are generated from these classes (`nexuskv schema export`) and a test keeps the
two equal. `to_dict` / `from_dict` convert to and from JSON-compatible dicts; `from_dict` validates first, so
every error names the field path.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, TypeVar

from attrs import define, field

from nexuskv import _schema
from nexuskv._schema import doc

__all__ = [
    "AdapterIdentity",
    "Calibration",
    "CodecCost",
    "CostProfile",
    "ExtraInput",
    "Layout",
    "LinkCost",
    "ModelIdentity",
    "Namespace",
    "Placement",
    "Plan",
    "PlanAction",
    "PlanSpan",
    "Predicted",
    "PrefillCost",
    "Request",
    "Slo",
    "StateDescriptor",
    "StateGroup",
    "StateKind",
    "TensorSpec",
    "TokenSpan",
    "TokenizerIdentity",
    "Usage",
    "from_dict",
    "from_json",
    "json_schema",
    "to_dict",
]

SCHEMA_VERSION = 1

_NAME = {"pattern": r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$", "maxLength": 256}
_HEX_KEY = {"pattern": "^[0-9a-f]{32}$"}


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


class PlanAction(enum.StrEnum):
    """What the connector is asked to do with a request."""

    MATERIALIZE = "materialize"
    """Load the planned spans from their tiers, then prefill only the rest."""
    PREFETCH = "prefetch"
    """Start moving state into a faster tier now; this request recomputes or reuses what is already close."""
    SKIP = "skip"
    """The request is not worth planning for (too short, reuse disabled): prefill everything, log nothing more."""
    RECOMPUTE = "recompute"
    """Prefill from scratch: reuse would not pay, is not allowed, or something on the path failed."""


# --------------------------------------------------------------------------------------------- identity


@define(frozen=True)
class Namespace:
    """Who may share state: the tenant, the sharing scope inside it, and an optional cache salt."""

    tenant: str = field(metadata=doc("Tenant that produced or requests the state.", **_NAME))
    scope: str = field(default="", metadata=doc("Sharing scope inside the tenant; empty means the tenant."))
    cache_salt: str = field(default="", metadata=doc("Opaque salt; different salts never share state."))


@define(frozen=True)
class AdapterIdentity:
    """A LoRA or other adapter applied on top of the base weights."""

    name: str = field(metadata=doc("Adapter name.", **_NAME))
    weights_hash: str = field(default="", metadata=doc("Hash of the adapter weights."))
    scale: float = field(default=1.0, metadata=doc("Adapter scaling factor (alpha / rank)."))


@define(frozen=True)
class ModelIdentity:
    """Everything about the weights that changes the state they produce."""

    name: str = field(metadata=doc("Model name, e.g. `llama-3-8b`.", **_NAME))
    revision: str = field(default="", metadata=doc("Revision or commit of the weights."))
    weights_hash: str = field(default="", metadata=doc("Hash of the weights actually loaded."))
    dtype: str = field(default="float16", metadata=doc("Dtype the state is produced in.", **_NAME))
    quantization: str = field(default="none", metadata=doc("Weight / KV quantization scheme.", **_NAME))
    adapter: AdapterIdentity | None = field(default=None, metadata=doc("Adapter, if any."))


@define(frozen=True)
class TokenizerIdentity:
    """The tokenizer that produced the token ids (different tokenizers never share state)."""

    name: str = field(metadata=doc("Tokenizer name.", **_NAME))
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

    tier: str = field(metadata=doc("Tier name, e.g. `dram`, `disk`, `redis`.", **_NAME))
    node: str = field(metadata=doc("Node name.", **_NAME))
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

    key: str = field(metadata=doc("Block key: 32 hex digits (keyed BLAKE2b-128).", **_HEX_KEY))
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
        default=None, metadata=doc("Key of the previous block; null at the root.", **_HEX_KEY)
    )
    group: int = field(default=0, metadata=doc("Index of the layout group this payload holds.", minimum=0))
    codec: str = field(default="raw", metadata=doc("Codec of the stored payload, e.g. `raw`, `zstd`.", **_NAME))
    raw_nbytes: int = field(default=0, metadata=doc("Payload size before the codec (0: same as nbytes).", minimum=0))
    tensors: tuple[TensorSpec, ...] = field(
        factory=tuple, converter=tuple, metadata=doc("Raw tensors in the payload.", maxItems=1024)
    )
    usage: Usage = field(factory=Usage, metadata=doc("Usage statistics."))
    schema_version: int = field(default=SCHEMA_VERSION, metadata=doc("Contract version.", const=SCHEMA_VERSION))


# --------------------------------------------------------------------------------------------- request


@define(frozen=True)
class ExtraInput:
    """A non-token input mixed into the block that contains `position` (an image hash, say)."""

    position: int = field(metadata=doc("Token position the input is attached to.", minimum=0))
    digest: str = field(metadata=doc("Content hash of the input.", minLength=1))


@define(frozen=True)
class Slo:
    """Service-level objective of a request."""

    ttft_ms: float | None = field(default=None, metadata=doc("Target time to first token.", minimum=0))
    deadline_ms: float | None = field(default=None, metadata=doc("Planning deadline override.", minimum=0))


@define(frozen=True)
class Request:
    """A request arriving at the scheduler: who asks, with which model, for which tokens, where."""

    CONTRACT: ClassVar[str] = "request"

    request_id: str = field(metadata=doc("Caller's request id.", minLength=1, maxLength=256))
    tenant: str = field(metadata=doc("Tenant making the request.", **_NAME))
    model: ModelIdentity = field(metadata=doc("Model identity."))
    tokenizer: TokenizerIdentity = field(metadata=doc("Tokenizer identity."))
    layout: Layout = field(metadata=doc("State layout of the model."))
    token_ids: tuple[int, ...] = field(
        converter=tuple, metadata=doc("Prompt token ids.", items={"minimum": 0, "maximum": 4294967295})
    )
    scope: str = field(default="", metadata=doc("Sharing scope inside the tenant; empty means the tenant."))
    cache_salt: str = field(default="", metadata=doc("Opaque salt; different salts never share state."))
    extra_inputs: tuple[ExtraInput, ...] = field(
        factory=tuple, converter=tuple, metadata=doc("Non-token inputs.", maxItems=1024)
    )
    node: str = field(default="", metadata=doc("Node the request is (or would be) scheduled on."))
    slo: Slo = field(factory=Slo, metadata=doc("Service-level objective."))
    priority: int = field(default=0, metadata=doc("Scheduling priority; higher is more important."))
    schema_version: int = field(default=SCHEMA_VERSION, metadata=doc("Contract version.", const=SCHEMA_VERSION))

    @property
    def namespace(self) -> Namespace:
        """The namespace this request's state lives in."""
        return Namespace(tenant=self.tenant, scope=self.scope, cache_salt=self.cache_salt)


# --------------------------------------------------------------------------------------------- plan


@define(frozen=True)
class PlanSpan:
    """A span of blocks the connector loads (or prefetches) from one source over one transport."""

    start: int = field(metadata=doc("First token position.", minimum=0))
    end: int = field(metadata=doc("One past the last token position.", minimum=0))
    tier: str = field(metadata=doc("Tier the span is read from.", **_NAME))
    node: str = field(metadata=doc("Node holding the span.", **_NAME))
    transport: str = field(default="local", metadata=doc("Transport that moves the span.", **_NAME))
    target_tier: str = field(default="", metadata=doc("For prefetches: the tier the span moves to."))


@define(frozen=True)
class Predicted:
    """The predicted terms of G = T_recompute - (T_lookup + T_transfer + T_mount), in milliseconds."""

    t_recompute_ms: float = field(default=0.0, metadata=doc("Prefill time the reuse saves."))
    t_lookup_ms: float = field(default=0.0, metadata=doc("Index and policy lookup time."))
    t_transfer_ms: float = field(default=0.0, metadata=doc("Time to move the state (codec included)."))
    t_mount_ms: float = field(default=0.0, metadata=doc("Time to mount the state into the engine."))
    gain_ms: float = field(default=0.0, metadata=doc("G: the predicted gain of the plan."))
    ttft_ms: float = field(default=0.0, metadata=doc("Predicted time to first token under this plan."))


@define(frozen=True)
class Plan:
    """The kernel's decision for one request."""

    CONTRACT: ClassVar[str] = "plan"

    decision_id: str = field(metadata=doc("Unique id of this decision (for the decision log).", minLength=1))
    request_id: str = field(metadata=doc("Request the plan answers.", minLength=1))
    tenant: str = field(metadata=doc("Tenant of the request.", **_NAME))
    action: PlanAction = field(converter=PlanAction, metadata=doc("What the connector does."))
    tokens_total: int = field(metadata=doc("Prompt length in tokens.", minimum=0))
    tokens_reused: int = field(default=0, metadata=doc("Tokens restored instead of recomputed.", minimum=0))
    spans: tuple[PlanSpan, ...] = field(factory=tuple, converter=tuple, metadata=doc("Spans to materialize."))
    prefetch: tuple[PlanSpan, ...] = field(factory=tuple, converter=tuple, metadata=doc("Spans to prefetch."))
    route: str | None = field(default=None, metadata=doc("Node the request would best run on, if not its own."))
    namespace: Namespace | None = field(
        default=None, metadata=doc("Where the reused state lives when another tenant shares it (null: the request's).")
    )
    predicted: Predicted = field(factory=Predicted, metadata=doc("Predicted cost terms."))
    reasons: tuple[str, ...] = field(factory=tuple, converter=tuple, metadata=doc("Why, in words."))
    rules: tuple[str, ...] = field(factory=tuple, converter=tuple, metadata=doc("Policy rules that decided."))
    policy_revision: str = field(default="", metadata=doc("Content hash of the policies used."))
    epoch: int = field(default=0, metadata=doc("Control-plane epoch the plan was made in.", minimum=0))
    mac: str = field(default="", metadata=doc(
        "Keyed BLAKE2b-128 (hex) with the deployment secret over every field that decides what is loaded, from "
        "where and for whom (all but predicted, reasons, rules and mac); materialize refuses a plan whose MAC "
        "does not check."))  # fmt: skip
    schema_version: int = field(default=SCHEMA_VERSION, metadata=doc("Contract version.", const=SCHEMA_VERSION))


# --------------------------------------------------------------------------------------------- cost profile


@define(frozen=True)
class PrefillCost:
    """Prefill time of L tokens: base_ms + per_token_ms * L + per_token_sq_ms * L^2 (attention)."""

    base_ms: float = field(default=0.0, metadata=doc("Fixed cost of a forward pass.", minimum=0))
    per_token_ms: float = field(default=0.0, metadata=doc("Linear term (MLP, projections).", minimum=0))
    per_token_sq_ms: float = field(default=0.0, metadata=doc("Quadratic term (attention).", minimum=0))


@define(frozen=True)
class LinkCost:
    """Latency and bandwidth of a tier read or a transport hop."""

    bandwidth_bytes_per_s: float = field(metadata=doc("Sustained bandwidth.", exclusiveMinimum=0))
    latency_ms: float = field(default=0.0, metadata=doc("Fixed latency per operation.", minimum=0))


@define(frozen=True)
class CodecCost:
    """Throughput and ratio of a payload codec."""

    decode_bytes_per_s: float = field(metadata=doc("Decode throughput in raw bytes per second.", exclusiveMinimum=0))
    encode_bytes_per_s: float = field(metadata=doc("Encode throughput in raw bytes per second.", exclusiveMinimum=0))
    ratio: float = field(default=1.0, metadata=doc("Raw bytes / stored bytes.", exclusiveMinimum=0))


@define(frozen=True)
class Calibration:
    """How a profile was produced and how well it predicts."""

    method: str = field(metadata=doc("`default`, or the calibration command that produced the profile."))
    samples: int = field(default=0, metadata=doc("Measurements fitted.", minimum=0))
    heldout_error_pct: float | None = field(
        default=None, metadata=doc("Mean error on held-out lengths (%).", minimum=0)
    )


@define(frozen=True)
class CostProfile:
    """A model-and-hardware cost profile: the inputs of every term of G."""

    CONTRACT: ClassVar[str] = "cost-profile"

    name: str = field(metadata=doc("Profile name.", **_NAME))
    model: str = field(metadata=doc("Model the profile was calibrated for.", **_NAME))
    hardware: str = field(metadata=doc("Hardware the profile was calibrated on."))
    bytes_per_token: int = field(metadata=doc("State bytes per token (all layers, all groups).", minimum=1))
    prefill: PrefillCost = field(metadata=doc("Prefill time model."))
    tiers: dict[str, LinkCost] = field(metadata=doc("Read cost per tier name."))
    transports: dict[str, LinkCost] = field(factory=dict, metadata=doc("Cost per transport name."))
    codecs: dict[str, CodecCost] = field(factory=dict, metadata=doc("Cost per codec name."))
    lookup_ms: float = field(default=0.05, metadata=doc("Measured index + policy lookup time.", minimum=0))
    mount_ms_per_block: float = field(default=0.0, metadata=doc("Engine mount cost per block.", minimum=0))
    calibration: Calibration = field(factory=lambda: Calibration(method="default"), metadata=doc("Provenance."))
    schema_version: int = field(default=SCHEMA_VERSION, metadata=doc("Contract version.", const=SCHEMA_VERSION))


# --------------------------------------------------------------------------------------------- (de)serialisation

CONTRACTS: dict[str, type] = {
    cls.CONTRACT: cls for cls in (StateDescriptor, Request, Plan, CostProfile)
}

T = TypeVar("T")


def from_json(cls: type[T], text: bytes | str) -> T:
    """`from_dict(cls, json.loads(text))`, faster: what a server reading contracts off the wire calls.

    JSON that does not parse is a `ContractError` at `<root>` with the parser's position; orjson parses when it is
    installed (the sidecar brings it).
    """
    return _schema.from_json(cls, text)


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a contract class, as `schemas/<contract>.v1.json` holds it."""
    return _schema.schema_for(cls)


def to_dict(obj: Any) -> dict[str, Any]:
    """Turn a contract object into a JSON-compatible dict (tuples become lists, enums their values)."""
    return _schema.unstructure(obj)


def from_dict(cls: type[T], data: Any) -> T:
    """Validate `data` against `cls`'s schema and build the object.

    Raises `SchemaVersionError` for an unknown `schema_version` and `ContractError` listing every problem with
    its field path otherwise.
    """
    return _schema.structure(cls, data)
