"""A request the kernel plans for: its identity, token ids, extra inputs and service level."""

from __future__ import annotations

from typing import ClassVar

from attrs import define, field

from nexuskv.contracts.fields import NAME, SCHEMA_VERSION
from nexuskv.contracts.schema import doc
from nexuskv.contracts.state import Layout, ModelIdentity, Namespace, TokenizerIdentity

__all__ = ["ExtraInput", "Request", "Slo"]


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
    tenant: str = field(metadata=doc("Tenant making the request.", **NAME))
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
