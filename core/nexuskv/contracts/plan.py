"""A plan: what the connector is asked to do with a request, from where, and why."""

from __future__ import annotations

import enum
from typing import ClassVar

from attrs import define, field

from nexuskv.contracts.fields import NAME, SCHEMA_VERSION
from nexuskv.contracts.schema import doc
from nexuskv.contracts.state import Namespace

__all__ = ["Plan", "PlanAction", "PlanSpan", "Predicted"]


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


@define(frozen=True)
class PlanSpan:
    """A span of blocks the connector loads (or prefetches) from one source over one transport."""

    start: int = field(metadata=doc("First token position.", minimum=0))
    end: int = field(metadata=doc("One past the last token position.", minimum=0))
    tier: str = field(metadata=doc("Tier the span is read from.", **NAME))
    node: str = field(metadata=doc("Node holding the span.", **NAME))
    transport: str = field(default="local", metadata=doc("Transport that moves the span.", **NAME))
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
    tenant: str = field(metadata=doc("Tenant of the request.", **NAME))
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
