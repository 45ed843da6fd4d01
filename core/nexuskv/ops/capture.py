"""What one plan decided on, captured: `DecisionInputs` (written out with prompts redacted) and the `Recorder`.

`DecisionInputs` is what the decision step read besides the policies: the request (token ids redacted to their
count when written out), the index match, the shared scopes' matches, the breakers open and the link estimates in
use, the node's congestion figures. `Recorder` is what a plan reads through to capture them as it reads them.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from attrs import define, field

from nexuskv.contracts import Request, from_dict, to_dict
from nexuskv.planning.cost import CostModel
from nexuskv.planning.links import LinkEstimate
from nexuskv.planning.planner import Planner
from nexuskv.state.holding import Holding, Location
from nexuskv.state.index import Match

__all__ = ["DecisionInputs", "Recorder"]



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
