"""A cost profile: the calibrated times every term of G is predicted from."""

from __future__ import annotations

from typing import ClassVar

from attrs import define, field

from nexuskv.contracts.fields import NAME, SCHEMA_VERSION
from nexuskv.contracts.schema import doc

__all__ = ["Calibration", "CodecCost", "CostProfile", "LinkCost", "PrefillCost"]


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

    name: str = field(metadata=doc("Profile name.", **NAME))
    model: str = field(metadata=doc("Model the profile was calibrated for.", **NAME))
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
