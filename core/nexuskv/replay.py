"""Decisions replayed under another policy revision: the inputs a plan decided on, and the same decision again.

`decide_with_shares` is the decision step of `plan` (the tenant's own state, then every scope another tenant
shares with it; the larger gain wins), used by the read path itself, by shadow evaluation and by
`nexuskv policy diff`, so a replay is the plan's own logic and not a model of it. `DecisionInputs` is what that
step read besides the policies: the request (token ids redacted to their count when written out), the index
match, the shared scopes' matches, the breakers open and the link estimates in use, the node's congestion
figures. `Replayer` rebuilds a planner over those frozen inputs and decides again under any `Policies`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import define, field

from nexuskv.contracts import CostProfile, Namespace, Plan, PlanAction, Request, from_dict, to_dict
from nexuskv.cost import CostModel
from nexuskv.errors import DeadlinePassed
from nexuskv.errors import check_deadline as check
from nexuskv.holding import Holding, Location
from nexuskv.index import Match
from nexuskv.links import LinkEstimate
from nexuskv.planner import Decision, Planner, decide
from nexuskv.policy.loader import Policies
from nexuskv.sharing import granted

__all__ = ["DecisionInputs", "Outcome", "Recorder", "Replayer", "decide_with_shares"]

Lookup = Callable[[str, str], "tuple[Match, Sequence[bytes]] | None"]


def _gain(plan: Plan) -> float:
    return plan.predicted.gain_ms if plan.action == PlanAction.MATERIALIZE else 0.0


def decide_with_shares(planner: Planner, request: Request, match: Match, policies: Policies | None,
                       args: Mapping[str, Any], lookup: Lookup,
                       end: float | None) -> tuple[Decision, Sequence[bytes] | None]:  # fmt: skip
    """The plan's decision: its own state, then each shared scope `lookup(owner, scope)` finds; the best gain wins.

    Returns the decision and the keys of the shared scope it chose (None: the tenant's own). The own decision
    stands when the deadline passes during the shared scopes (they are an optimisation on top).
    """
    policy = policies.for_tenant(request.tenant) if policies is not None else None
    now = args.get("now")
    decision = decide(planner, request, match, policy, deadline=end, **args)
    chosen_keys: Sequence[bytes] | None = None
    check(end, "plan")
    for owner, scope in policies.readable_by(request.tenant) if policies is not None else ():
        try:
            check(end, "shared state")
            found = lookup(owner, scope)
            if found is None:
                continue
            shared, keys = found
            blocks = shared.longest()
            if not blocks or not granted(policies, request, owner, scope, blocks, now):  # type: ignore[arg-type]
                continue
            ns = Namespace(tenant=owner, scope=scope, cache_salt=request.cache_salt)
            got = decide(planner, request, shared, policy, shared_from=ns, deadline=end, **args)
        except DeadlinePassed:
            break
        if _gain(got.plan) > _gain(decision.plan):
            decision, chosen_keys = got, keys
    return decision, chosen_keys


# ---------------------------------------------------------------------------------------------- the inputs


@define(frozen=True)
class DecisionInputs:
    """What one plan's decision read besides the policies (captured in memory; `to_json` writes it out)."""

    request: Request
    match: Match
    node: str
    epoch: int
    inflight: Mapping[str, float] = field(factory=dict)
    bandwidth_scale: Mapping[str, float] = field(factory=dict)
    prefetch_target: str = ""
    open_paths: frozenset[str] = frozenset()  # breakers open when it was planned: those paths were not used
    links: Mapping[str, tuple[float, float]] = field(factory=dict)  # link -> (latency ms, bytes/s) in use
    shared: dict[tuple[str, str], Match] = field(factory=dict)  # (owner, scope) -> what the index held there
    token_count: int = -1  # the request's token count when its token ids were redacted (-1: not redacted)
    at: datetime.datetime | None = None  # the time rules saw (`now`): a replay evaluates them at that time

    def args(self, decision_id: str = "replay", revision: str = "") -> dict[str, Any]:
        """Keyword arguments of `decide` (besides the request, match and policy)."""
        return dict(node=self.node, decision_id=decision_id, epoch=self.epoch, inflight=dict(self.inflight),
                    bandwidth_scale=dict(self.bandwidth_scale), prefetch_target=self.prefetch_target,
                    revision=revision, now=self.at)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """Plain data; the request's token ids are replaced by their count (prompts do not go into logs)."""
        req = to_dict(self.request)
        req["token_ids"] = []
        return {"request": req, "token_count": len(self.request.token_ids), "match": _match_out(self.match),
                "node": self.node, "epoch": self.epoch, "inflight": dict(self.inflight),
                "bandwidth_scale": dict(self.bandwidth_scale), "prefetch_target": self.prefetch_target,
                "open_paths": sorted(self.open_paths), "links": {k: list(v) for k, v in self.links.items()},
                "shared": [[o, s, _match_out(m)] for (o, s), m in sorted(self.shared.items())],
                "at": self.at.isoformat() if self.at is not None else None}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DecisionInputs:
        """Read inputs written by `to_json` (token ids come back as zeros: rules that read their values see 0)."""
        req = dict(data["request"])
        count = int(data["token_count"])
        req["token_ids"] = [0] * count
        request = from_dict(Request, req)
        layout = request.layout
        return cls(request, _match_in(data["match"], layout), str(data["node"]), int(data["epoch"]),
                   {k: float(v) for k, v in data.get("inflight", {}).items()},
                   {k: float(v) for k, v in data.get("bandwidth_scale", {}).items()},
                   str(data.get("prefetch_target", "")), frozenset(data.get("open_paths", ())),
                   {k: (float(v[0]), float(v[1])) for k, v in data.get("links", {}).items()},
                   {(o, s): _match_in(m, layout) for o, s, m in data.get("shared", ())}, count,
                   datetime.datetime.fromisoformat(data["at"]) if data.get("at") else None)  # fmt: skip


def _match_out(match: Match) -> dict[str, Any]:
    """Distinct holdings, and per block the index of its holding (run-length: [index or -1, count], ...)."""
    distinct: dict[Holding | None, int] = {}
    runs: list[list[int]] = []
    for h in match.entries:
        i = -1 if h is None else distinct.setdefault(h, len(distinct))
        if runs and runs[-1][0] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    holdings = [[[loc.tier, loc.node, loc.epoch, mask] for loc, mask in h.locations] for h in distinct if h]
    return {"holdings": holdings, "blocks": runs}


def _match_in(data: Mapping[str, Any], layout: Any) -> Match:
    holdings = [Holding(tuple((Location(str(t), str(n), int(e)), int(m)) for t, n, e, m in h))
                for h in data["holdings"]]  # fmt: skip
    entries: list[Holding | None] = []
    for i, count in data["blocks"]:
        entries.extend([holdings[i] if i >= 0 else None] * int(count))
    return Match((), entries, layout)


# ---------------------------------------------------------------------------------------------- replaying


class Recorder:
    """What one plan's pricing read from the breakers and the link estimates, recorded as it reads it.

    `planner(p)` is a copy of planner `p` that reads through the recorder; a plan made with it is the plan `p`
    makes, and `denied` / `links` are then exactly the paths it could not use and the estimates it priced by.
    Each breaker is asked once per plan (a half-open breaker grants its one trial to the first ask: later asks in
    the same plan get the same answer). `complete()` then adds what the plan did not read, for a replay under
    another revision that reads more: every other link estimate in use, and every other open breaker.
    """

    def __init__(self, health: Any, links: Any) -> None:
        self._health, self._links = health, links
        self._asked: dict[str, bool] = {}
        self.denied: set[str] = set()
        self.links: dict[str, tuple[float, float]] = {}

    def allow(self, name: str) -> bool:
        ok = self._asked.get(name)
        if ok is None:
            ok = self._asked[name] = bool(self._health.allow(name))
            if not ok:
                self.denied.add(name)
        return ok

    def complete(self) -> None:
        """Add the links and breakers this plan did not read (read without side effects: no breaker trial)."""
        for name, b in self._health.snapshot().items():
            if name not in self._asked and b["state"] != "closed":
                self.denied.add(name)
        if self._links is not None:
            for name in self._links.snapshot():
                if name not in self.links:
                    est = self._links.get(name)
                    if est is not None:
                        self.links[name] = (est.latency_ms, est.bandwidth_bytes_per_s)

    def get(self, name: str) -> LinkEstimate | None:
        est: LinkEstimate | None = self._links.get(name) if self._links is not None else None
        if est is not None:
            self.links[name] = (est.latency_ms, est.bandwidth_bytes_per_s)
        return est

    def planner(self, p: Planner) -> Planner:
        """`p`, reading breakers and links through this recorder."""
        cost = CostModel(p.cost.profile, links=self)  # type: ignore[arg-type]
        return Planner(cost, self, p.tier_order, transport=p.transport,  # type: ignore[arg-type]
                       remote_transport=p.remote_transport, shared_tiers=tuple(p.shared_tiers))  # fmt: skip


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

        revision = policies.revision if policies is not None else ""
        decision, _ = decide_with_shares(planner, inputs.request, inputs.match, policies,
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
