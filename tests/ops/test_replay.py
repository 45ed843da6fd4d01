"""Replay: a plan's captured inputs decided again under the same policies give the same plan (also via JSON)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from nexuskv import Kernel, KernelConfig, ModelIdentity, PlanAction
from nexuskv.ops.capture import DecisionInputs
from nexuskv.ops.replay import Outcome, Replayer
from nexuskv.state.holding import Holding, Location
from nexuskv.state.index import Match
from tests.conftest import SECRET, layout_of, make_request

POLICIES = str(Path(__file__).resolve().parents[2] / "policies")
MODEL = ModelIdentity(name="tiny-llama", revision="1")  # the rag tenant shares its docs for this model


def summary(plan):
    """What a replay must reproduce: the decision (not the live plan's budget, which is how long it could take)."""
    ns = (plan.namespace.tenant, plan.namespace.scope) if plan.namespace is not None else None
    reasons = tuple(r for r in plan.reasons if not r.startswith("budget "))
    return (plan.action, plan.tokens_reused, tuple((s.start, s.end, s.tier, s.node, s.transport) for s in plan.spans),
            tuple((s.start, s.end, s.tier, s.target_tier) for s in plan.prefetch), ns, plan.rules, reasons,
            plan.policy_revision, plan.epoch, plan.predicted)  # fmt: skip


class Captured:
    """A decision file stand-in that keeps the in-memory inputs of every plan (the shadow's view)."""

    def __init__(self):
        self.items = []

    def offer(self, inputs, policies, decision_id):
        self.items.append((inputs, policies, decision_id))

    def close(self):
        pass


@pytest.fixture
def world(tmp_path):
    """Two tiers (DRAM small, disk large), the shipped policies, rag's shared docs, a chat history."""
    cfg = KernelConfig(node="n1", policies=POLICIES, deadline_ms=60_000.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "256KiB"},
                              "disk": {"store": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": "64MiB"}})
    rng = random.Random(5)
    with Kernel(cfg, secret=SECRET) as k:
        docs = [rng.randrange(30_000) for _ in range(16 * 40)]
        chat = [rng.randrange(30_000) for _ in range(16 * 24)]
        for req in (make_request(docs, tenant="rag", scope="docs", model=MODEL),
                    make_request(chat, tenant="chat", model=MODEL)):  # fmt: skip
            keys = k.keys(req)
            k.commit(req, [bytes([b % 256]) * 4096 for b in range(len(keys))], keys=keys)
        assert k.flush(10)
        requests = []
        for tenant in ("chat", "partner-a", "strict", "rag", "globex"):
            for prefix in (docs, chat, docs[:160]):
                for extra in (0, 37):
                    requests.append(make_request(prefix + [rng.randrange(30_000) for _ in range(extra)],
                                                 tenant=tenant, model=MODEL, request_id=f"{tenant}-{len(requests)}"))
        yield k, requests


def test_replaying_captured_inputs_gives_the_plan_that_was_made(world):
    k, requests = world
    captured = Captured()
    k.decision_log.shadow = captured  # every plan hands its inputs over
    plans = [k.plan(r) for r in requests]
    k.decision_log.shadow = None
    assert len(captured.items) == len(plans)
    assert {p.action for p in plans} >= {PlanAction.MATERIALIZE, PlanAction.RECOMPUTE}
    assert any(p.namespace is not None for p in plans), "some plan reads rag's shared docs"
    assert any(p.prefetch for p in plans) and any(s.tier == "disk" for p in plans for s in p.spans)
    replayer = Replayer.of(k.planner)
    for plan, (inputs, policies, decision_id) in zip(plans, captured.items, strict=True):
        assert decision_id == plan.decision_id
        again, missing = replayer.decide(inputs, policies)
        assert missing == []
        assert summary(again) == summary(plan)
        # written out and read back (token ids redacted to their count): the same decision
        data = json.loads(json.dumps(inputs.to_json()))
        assert data["request"]["token_ids"] == [] and data["token_count"] == len(inputs.request.token_ids)
        back, _ = Replayer.from_json(json.loads(json.dumps(replayer.to_json()))).decide(
            DecisionInputs.from_json(data), policies)
        assert summary(back)[:-1] == summary(plan)[:-1] and Outcome.of(back) == Outcome.of(plan)


def test_open_breakers_and_measured_links_are_part_of_the_inputs(world):
    k, requests = world
    req = requests[2]  # chat's own history: priced from DRAM (and disk)
    assert req.tenant == "chat"
    captured = Captured()
    k.decision_log.shadow = captured
    for _ in range(k.config.breaker_threshold):
        k.health.breaker("disk").failure("test: disk unreadable")
    for _ in range(10):  # enough samples for the measured link to price plans: a slow DRAM
        k.links.observe("dram", 1 << 20, 0.5)
    plan = k.plan(req)
    k.health.breaker("disk").success()
    k.decision_log.shadow = None
    (inputs, policies, _), = captured.items
    assert "disk" in inputs.open_paths and all(s.tier != "disk" for s in plan.spans)
    assert inputs.links["dram"][1] < 1e7  # the measured bandwidth it priced by (about 2 MB/s), not the profile's
    assert set(inputs.links) <= {"dram", "disk"} and inputs.at is not None
    again, _ = Replayer.of(k.planner).decide(inputs, policies)
    assert summary(again) == summary(plan)  # replayed with the breaker as it was, not as it is now


def test_match_round_trip_keeps_gaps_and_group_masks():
    layout = layout_of("dense", "dense")
    a = Holding(((Location("dram", "n1", 3), 3),))
    b = Holding(((Location("disk", "n2", 1), 1), (Location("dram", "n1", 3), 2)))
    match = Match((), [a, a, b, None, b, a], layout)
    inputs = DecisionInputs(make_request(range(96), layout=layout), match, "n1", 3)
    back = DecisionInputs.from_json(json.loads(json.dumps(inputs.to_json())))
    assert [h.locations if h else None for h in back.match.entries] == [h.locations if h else None
                                                                          for h in match.entries]  # fmt: skip
    assert back.request.token_ids == (0,) * 96 and back.token_count == 96


def test_outcome_names_what_changed():
    old = Outcome("materialize", 512, "dram", ("a",))
    assert old.changes(Outcome("materialize", 512, "dram", ("a",))) == []
    assert old.changes(Outcome("recompute", 0, "", ("b",))) == ["action", "tokens_reused", "tier", "rules"]
    assert str(old) == "materialize 512 tokens from dram [rules: a]"
