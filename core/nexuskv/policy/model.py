"""The policy file format (`schemas/policy.v1.json`) as frozen attrs classes, and the values rules see.

A policy file is TOML: settings, ordered `variables`, and arrays of `admit`, `reuse`, `place`, `share` and
`route` rules. The JSON Schema is generated from these classes like the other contracts; every field is documented in
`docs/policies.md`.
"""

from __future__ import annotations

import enum
from typing import ClassVar

from attrs import define, field

from nexuskv.contracts.schema import doc

__all__ = [
    "AdmitRule",
    "Candidate",
    "Effect",
    "Failure",
    "PlaceEffect",
    "PlaceRule",
    "PolicyFile",
    "ReuseRule",
    "RouteEffect",
    "RouteRule",
    "RouteTarget",
    "ShareEffect",
    "ShareRule",
]

_RULE_NAME = {"pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*$", "maxLength": 128}


class Effect(enum.StrEnum):
    """What an `admit` or `reuse` rule does when it fires."""

    DENY = "deny"
    """Enforced: the state is not stored (admit) or not reused beyond `max_tokens` (reuse)."""
    WARN = "warn"
    """Not enforced; the verdict carries the message as a warning."""
    AUDIT = "audit"
    """Dry run: logged in the decision, not enforced and not warned."""


class PlaceEffect(enum.StrEnum):
    """What a `place` rule does when it fires."""

    APPLY = "apply"
    """The first firing rule decides tier, ttl and priority."""
    AUDIT = "audit"
    """Dry run: recorded in the verdict, the placement is not applied."""


class ShareEffect(enum.StrEnum):
    """What a `share` rule does when it fires."""

    ALLOW = "allow"
    """The listed tenants may reuse state of this scope."""
    AUDIT = "audit"
    """Dry run: recorded, no access granted."""


class RouteEffect(enum.StrEnum):
    """What a `route` rule does to the candidate node it fires on."""

    EXCLUDE = "exclude"
    """The node is not a candidate for this request."""
    WEIGHT = "weight"
    """The node's predicted TTFT is multiplied by the rule's `weight` (several firing rules multiply)."""
    AUDIT = "audit"
    """Dry run: recorded in the route decision, nothing changes."""


class Failure(enum.StrEnum):
    """What an error while evaluating a rule means."""

    DENY = "deny"
    """Safe side: the rule counts as fired with an enforced deny (no store, no reuse, so recompute)."""
    IGNORE = "ignore"
    """The rule is skipped (Cedar's skip-on-error); the error is still logged and in the verdict."""


@define(frozen=True)
class AdmitRule:
    """May produced state be stored? The rule fires when every `match` holds and `when` is true."""

    name: str = field(metadata=doc("Rule name, unique in its file and kind.", **_RULE_NAME))
    when: str = field(metadata=doc("CEL bool: the rule fires when true."))
    match: tuple[str, ...] = field(factory=tuple, converter=tuple, metadata=doc("CEL bool preconditions."))
    effect: Effect = field(default=Effect.DENY, converter=Effect, metadata=doc("deny, warn or audit."))
    message: str = field(default="", metadata=doc("Static message when the rule fires."))
    message_expr: str = field(default="", metadata=doc("CEL string message; wins over `message`."))
    failure: Failure | None = field(default=None, metadata=doc("Override of the file's `failure`."))
    description: str = field(default="", metadata=doc("What the rule is for."))


@define(frozen=True)
class ReuseRule:
    """May this request reuse this match, and up to how many tokens?"""

    name: str = field(metadata=doc("Rule name, unique in its file and kind.", **_RULE_NAME))
    when: str = field(metadata=doc("CEL bool: the rule fires when true."))
    match: tuple[str, ...] = field(factory=tuple, converter=tuple, metadata=doc("CEL bool preconditions."))
    effect: Effect = field(default=Effect.DENY, converter=Effect, metadata=doc("deny, warn or audit."))
    max_tokens: str = field(
        default="",
        metadata=doc("CEL int: when set, a firing rule caps reuse at this many tokens instead of 0."),
    )
    message: str = field(default="", metadata=doc("Static message when the rule fires."))
    message_expr: str = field(default="", metadata=doc("CEL string message; wins over `message`."))
    failure: Failure | None = field(default=None, metadata=doc("Override of the file's `failure`."))
    description: str = field(default="", metadata=doc("What the rule is for."))


@define(frozen=True)
class PlaceRule:
    """Where stored state goes, for how long, and how hard it is to evict. The first firing rule wins."""

    name: str = field(metadata=doc("Rule name, unique in its file and kind.", **_RULE_NAME))
    when: str = field(default="true", metadata=doc("CEL bool: the rule fires when true."))
    match: tuple[str, ...] = field(factory=tuple, converter=tuple, metadata=doc("CEL bool preconditions."))
    tier: str = field(default="", metadata=doc("Tier name to place the state in."))
    tier_expr: str = field(default="", metadata=doc("CEL string tier name; wins over `tier`."))
    ttl: str = field(
        default="", metadata=doc("Time to live as a CEL duration literal text, e.g. `30m`, `2h`.")
    )
    ttl_expr: str = field(default="", metadata=doc("CEL duration; wins over `ttl`."))
    priority: float | None = field(default=None, metadata=doc("Eviction priority (higher is kept longer)."))
    priority_expr: str = field(default="", metadata=doc("CEL double or int; wins over `priority`."))
    effect: PlaceEffect = field(
        default=PlaceEffect.APPLY, converter=PlaceEffect, metadata=doc("apply or audit.")
    )
    message: str = field(default="", metadata=doc("Static message recorded when the rule fires."))
    failure: Failure | None = field(default=None, metadata=doc("Override of the file's `failure`."))
    description: str = field(default="", metadata=doc("What the rule is for."))


@define(frozen=True)
class ShareRule:
    """Opt-in sharing: which other tenants may reuse this tenant's state of one scope. Default: none."""

    name: str = field(metadata=doc("Rule name, unique in its file and kind.", **_RULE_NAME))
    scope: str = field(metadata=doc("Sharing scope of the owner's namespace that is shared.", minLength=1))
    tenants: tuple[str, ...] = field(
        converter=tuple, metadata=doc("Tenants granted access; `*` means every tenant.", minItems=1)
    )
    when: str = field(
        default="true", metadata=doc("CEL bool over the reader's request: grant only when true.")
    )
    match: tuple[str, ...] = field(factory=tuple, converter=tuple, metadata=doc("CEL bool preconditions."))
    effect: ShareEffect = field(
        default=ShareEffect.ALLOW, converter=ShareEffect, metadata=doc("allow or audit.")
    )
    message: str = field(default="", metadata=doc("Static message recorded when the rule fires."))
    failure: Failure | None = field(default=None, metadata=doc("Override of the file's `failure`."))
    description: str = field(default="", metadata=doc("What the rule is for."))


@define(frozen=True)
class RouteRule:
    """Which nodes a tenant's requests may run on, and which it prefers: evaluated once per candidate node."""

    name: str = field(metadata=doc("Rule name, unique in its file and kind.", **_RULE_NAME))
    when: str = field(metadata=doc("CEL bool over `request` and `target` (the candidate node): fires when true."))
    match: tuple[str, ...] = field(factory=tuple, converter=tuple, metadata=doc("CEL bool preconditions."))
    effect: RouteEffect = field(
        default=RouteEffect.EXCLUDE, converter=RouteEffect, metadata=doc("exclude, weight or audit.")
    )
    weight: float | None = field(
        default=None, metadata=doc("Multiplier of the node's predicted TTFT (`weight` effect).", exclusiveMinimum=0)
    )
    weight_expr: str = field(default="", metadata=doc("CEL double or int multiplier; wins over `weight`."))
    message: str = field(default="", metadata=doc("Static message recorded when the rule fires."))
    failure: Failure | None = field(default=None, metadata=doc("Override of the file's `failure`."))
    description: str = field(default="", metadata=doc("What the rule is for."))


@define(frozen=True)
class PolicyFile:
    """One policy file: a tenant's rules (or the default), extending a parent."""

    CONTRACT: ClassVar[str] = "policy"

    name: str = field(default="", metadata=doc("Policy name; defaults to the file name without `.toml`."))
    extends: str = field(
        default="", metadata=doc("Parent policy name; tenants extend `default` unless set.")
    )
    description: str = field(default="", metadata=doc("What the policy is for."))
    failure: Failure = field(
        default=Failure.DENY, converter=Failure, metadata=doc("Meaning of evaluation errors.")
    )
    min_gain_ms: float | None = field(
        default=None, metadata=doc("Minimum predicted gain for reuse (ms).", minimum=0)
    )
    max_cost: int | None = field(default=None, metadata=doc("Static cost budget per expression.", minimum=1))
    default_tier: str = field(default="", metadata=doc("Tier when no place rule fires."))
    variables: dict[str, str] = field(
        factory=dict, metadata=doc("Named CEL sub-expressions, in order; each may use earlier ones.")
    )
    admit: tuple[AdmitRule, ...] = field(factory=tuple, converter=tuple, metadata=doc("Admission rules."))
    reuse: tuple[ReuseRule, ...] = field(factory=tuple, converter=tuple, metadata=doc("Reuse rules."))
    place: tuple[PlaceRule, ...] = field(factory=tuple, converter=tuple, metadata=doc("Placement rules."))
    share: tuple[ShareRule, ...] = field(factory=tuple, converter=tuple, metadata=doc("Sharing grants."))
    route: tuple[RouteRule, ...] = field(factory=tuple, converter=tuple, metadata=doc("Routing rules."))
    schema_version: int = field(default=1, metadata=doc("Policy file format version.", const=1))


@define(frozen=True)
class Candidate:
    """What a `reuse` or `share` rule sees as `match`: one candidate reuse of stored state."""

    tokens: int = field(metadata=doc("Tokens the candidate would restore."))
    blocks: int = field(default=0, metadata=doc("Blocks the candidate would restore."))
    tier: str = field(default="", metadata=doc("Tier the state is read from."))
    node: str = field(default="", metadata=doc("Node holding the state."))
    owner: str = field(default="", metadata=doc("Tenant whose namespace holds the state."))
    scope: str = field(default="", metadata=doc("Sharing scope of that namespace."))
    shared: bool = field(default=False, metadata=doc("True when the owner is another tenant."))
    kind: str = field(default="", metadata=doc("Layout kind: dense, latent, windowed, recurrent, hybrid."))


@define(frozen=True)
class RouteTarget:
    """What a `route` rule sees as `target`: one candidate node, as the scheduler reported it and as priced."""

    node: str = field(metadata=doc("The candidate node."))
    labels: dict[str, str] = field(factory=dict, metadata=doc("Labels the scheduler gave the node (zone, gpu...)."))
    queued_prefill_tokens: int = field(default=0, metadata=doc("Prompt tokens waiting for prefill there."))
    running_decodes: int = field(default=0, metadata=doc("Requests decoding there."))
    queue_ms: float = field(default=0.0, metadata=doc("Predicted wait before this request's prefill starts (ms)."))
    reuse_tokens: int = field(default=0, metadata=doc("Tokens the plan for that node would restore."))
    tier: str = field(default="", metadata=doc("Slowest tier that plan reads from (empty: recompute)."))
    source: str = field(default="", metadata=doc("Node holding that state (the node itself or a peer)."))
    predicted_ttft_ms: float = field(default=0.0, metadata=doc("Predicted TTFT there, before weights (ms)."))
