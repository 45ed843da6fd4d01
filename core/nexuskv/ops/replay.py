"""Decisions replayed under another policy revision: the same decision step again, over recorded inputs.

`Replayer` rebuilds a planner over the frozen inputs a plan captured (`ops.capture.DecisionInputs`) and decides
again under any `Policies` with the live plan's own decision step (`planning.decision.decide_with_shares`), so a
replay is the plan's logic and not a model of it. `Outcome` is what a decision does, in the terms shadow
evaluation and `nexuskv policy diff` count disagreements in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from attrs import define

from nexuskv.contracts import CostProfile, Plan, from_dict, to_dict
from nexuskv.ops.capture import DecisionInputs
from nexuskv.planning.cost import CostModel
from nexuskv.planning.decision import decide_with_shares
from nexuskv.planning.links import LinkEstimate
from nexuskv.planning.planner import Planner
from nexuskv.policy.loader import Policies
from nexuskv.state.index import Match

__all__ = ["Outcome", "Replayer"]

# ---------------------------------------------------------------------------------------------- replaying


class _FrozenHealth:
    """The breakers as they were: a path open then is not used now."""

    def __init__(self, open_paths: frozenset[str]) -> None:
        self.open_paths = open_paths

    def allow(self, name: str) -> bool:
        return name not in self.open_paths


class _FrozenLinks:
    """The link estimates a plan used, as they were."""

    def __init__(self, links: Mapping[str, tuple[float, float]]) -> None:
        self._links = {k: LinkEstimate(latency_ms=v[0], bandwidth_bytes_per_s=v[1], samples=1 << 30)
                       for k, v in links.items()}  # fmt: skip

    def get(self, name: str) -> LinkEstimate | None:
        return self._links.get(name)


@define(frozen=True)
class Replayer:
    """A kernel's planner settings: decides recorded inputs again, under any policies."""

    profile: CostProfile
    tier_order: tuple[str, ...]
    transport: str = "local"
    remote_transport: str = ""
    shared_tiers: tuple[str, ...] = ()

    @classmethod
    def of(cls, planner: Planner) -> Replayer:
        """The settings of a running kernel's planner."""
        return cls(planner.cost.profile, planner.tier_order, planner.transport, planner.remote_transport,
                   tuple(sorted(planner.shared_tiers)))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """Plain data (the context line of a decision file)."""
        return {"profile": to_dict(self.profile), "tier_order": list(self.tier_order), "transport": self.transport,
                "remote_transport": self.remote_transport, "shared_tiers": list(self.shared_tiers)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Replayer:
        """Read what `to_json` wrote."""
        return cls(from_dict(CostProfile, data["profile"]), tuple(data["tier_order"]), str(data["transport"]),
                   str(data["remote_transport"]), tuple(data["shared_tiers"]))  # fmt: skip

    def decide(self, inputs: DecisionInputs, policies: Policies | None) -> tuple[Plan, list[tuple[str, str]]]:
        """The plan `inputs` give under `policies`, and the shared scopes it would read that were not recorded.

        A scope missing from the inputs (the revision shares a scope the recorded one did not) is planned as
        holding nothing; the caller reports those decisions as not fully replayable.
        """
        cost = CostModel(self.profile, links=_FrozenLinks(inputs.links))  # type: ignore[arg-type]
        planner = Planner(cost, _FrozenHealth(inputs.open_paths), self.tier_order, transport=self.transport,  # type: ignore[arg-type]
                          remote_transport=self.remote_transport, shared_tiers=self.shared_tiers)  # fmt: skip
        missing: list[tuple[str, str]] = []

        def lookup(owner: str, scope: str) -> tuple[Match, Sequence[bytes]] | None:
            got = inputs.shared.get((owner, scope))
            if got is None:
                missing.append((owner, scope))
                return None
            return got, ()

        tenant = inputs.request.tenant
        revision, policy, shares = ("", None, ()) if policies is None else (
            policies.revision, policies.for_tenant(tenant), policies.shared_with(tenant))  # fmt: skip
        decision, _ = decide_with_shares(planner, inputs.request, inputs.match, policy, shares,
                                         inputs.args(revision=revision), lookup, None)  # fmt: skip
        return decision.plan, missing


# ---------------------------------------------------------------------------------------------- comparing


@define(frozen=True)
class Outcome:
    """What a decision does, in the terms a disagreement is counted in."""

    action: str
    tokens_reused: int
    tier: str  # the slowest tier read ("" when nothing is)
    rules: tuple[str, ...]  # the rules that decided
    shared_from: str = ""  # "owner/scope" when another tenant's state is read

    @classmethod
    def of(cls, plan: Plan, tier_order: Sequence[str] = ()) -> Outcome:
        """The outcome of a plan (`tier_order` ranks tiers, fastest first, to name the slowest one read)."""
        rank = {t: i for i, t in enumerate(tier_order)}
        tiers = {s.tier for s in plan.spans}
        slowest = max(tiers, key=lambda t: (rank.get(t, len(rank)), t), default="")
        ns = plan.namespace
        return cls(plan.action.value, plan.tokens_reused, slowest, tuple(plan.rules),
                   f"{ns.tenant}/{ns.scope}" if ns is not None else "")  # fmt: skip

    def changes(self, other: Outcome) -> list[str]:
        """Which of action, tokens reused, tier, deciding rules and shared source differ."""
        names = ("action", "tokens_reused", "tier", "rules", "shared_from")
        return [n for n in names if getattr(self, n) != getattr(other, n)]

    def __str__(self) -> str:
        where = f" from {self.tier}" if self.tier else ""
        shared = f" (shared by {self.shared_from})" if self.shared_from else ""
        rules = f" [rules: {', '.join(self.rules)}]" if self.rules else ""
        return f"{self.action} {self.tokens_reused} tokens{where}{shared}{rules}"
