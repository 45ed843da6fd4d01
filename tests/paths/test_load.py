"""LoadPath: materialize from many threads returns exactly what was stored, and stops at the first gap."""

from __future__ import annotations

import json
import random
import threading

import attrs

from nexuskv import Kernel, KernelConfig, LoadReport, Location, PlanAction, slot_of
from tests.conftest import SECRET, make_request, with_transport


def stored_kernel():
    cfg = KernelConfig(node="n1", deadline_ms=60_000.0, tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})
    return Kernel(cfg, secret=SECRET)


def test_materialize_from_many_threads_returns_exactly_what_was_stored():
    with stored_kernel() as k:
        rng = random.Random(11)
        reqs, expected = [], {}
        for i in range(6):
            req = make_request([rng.randrange(40_000) for _ in range(16 * 16)], tenant=f"t{i % 3}")
            keys = k.keys(req)
            payloads = [rng.randbytes(1024) for _ in keys]
            k.commit(req, payloads, keys=keys)
            reqs.append(req)
            expected[i] = payloads
        assert k.flush(10)
        wrong: list[str] = []

        def worker(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(40):
                i = r.randrange(len(reqs))
                follow = make_request([*reqs[i].token_ids, 1, 2, 3], tenant=reqs[i].tenant)
                plan = k.plan(follow)
                got = k.materialize(plan, follow)
                if plan.action != PlanAction.MATERIALIZE or not got.complete:
                    wrong.append(f"{i}: {plan.action} {got.reason}")
                    continue
                for (b, _g), st in got.states.items():
                    if bytes(st.payload) != expected[i][b]:
                        wrong.append(f"{i}: block {b} differs")

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrong == []


def test_a_block_gone_behind_the_kernels_back_stops_the_load_there():
    with stored_kernel() as k:
        req = make_request(range(16 * 8))
        keys = k.keys(req)
        k.commit(req, [bytes([b]) * 64 for b in range(8)], keys=keys)
        assert k.flush(5)
        plan = k.plan(req)
        assert plan.tokens_reused == 128
        k.tiers["dram"].delete(slot_of(keys[5]))  # gone without an eviction callback
        got = k.materialize(plan, req)
        assert not got.complete and (got.blocks, got.tokens) == (5, 80)
        assert sorted(got.states) == [(b, 0) for b in range(5)] and "block 5" in got.reason
        assert k.index.get(keys[5]) is None  # the load said so, and the entry went
        assert k.plan(req).tokens_reused == 80  # the next plan reuses what is really held


def test_a_reported_timeout_opens_the_tiers_breaker_and_says_where_to_recompute_from():
    with stored_kernel() as k:
        req = make_request(range(16 * 4))
        k.commit(req, [b"x" * 64] * 4)
        assert k.flush(5)
        plan = k.plan(req)
        start = k.report_load_result(plan, LoadReport(ok=False, failed_block=2, tier="dram", timeout=True))
        assert start == 32 and k.health.breaker("dram").state == "open"
        assert k.report_load_result(plan, LoadReport(ok=True)) == 64 and k.health.breaker("dram").state == "closed"


# ------------------------------------------------------------------------------------------ plans are checked

from pathlib import Path  # noqa: E402

from nexuskv import ModelIdentity, Namespace, Plan, from_dict, to_dict  # noqa: E402

POLICIES = str(Path(__file__).resolve().parents[2] / "policies")
MODEL = ModelIdentity(name="tiny-llama", revision="1")  # rag shares its docs with chat for this model


def policy_kernel(secret=SECRET):
    cfg = KernelConfig(node="n1", policies=POLICIES, deadline_ms=60_000.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "16MiB"}})  # fmt: skip
    return Kernel(cfg, secret=secret)


def stored(k, req, size=512):
    keys = k.keys(req)
    k.commit(req, [bytes([b]) * size for b in range(len(keys))], keys=keys)
    assert k.flush(5)
    return keys


def test_a_plan_naming_another_tenants_namespace_loads_nothing():
    with policy_kernel() as k:
        private = make_request(range(16 * 8), tenant="strict", model=MODEL)  # strict shares nothing
        stored(k, private)
        thief = make_request(range(16 * 8), tenant="globex", model=MODEL)
        own = k.plan(thief)
        assert own.tokens_reused == 0
        forged = attrs.evolve(k.plan(private), tenant="globex", request_id=thief.request_id,
                              namespace=private.namespace)  # the old MAC: it does not check  # fmt: skip
        got = k.materialize(forged, thief)
        assert got.tokens == 0 and got.states == {} and "MAC does not check" in got.reason
        resealed = k.seal(forged)  # even a plan sealed in-process needs the owner's share grant, now
        got = k.materialize(resealed, thief)
        assert got.tokens == 0 and got.states == {} and "no share rule names it" in got.reason
        other_tenant = k.materialize(k.plan(private), thief)  # a real plan, for another tenant's request
        assert other_tenant.tokens == 0 and "is for tenant 'strict'" in other_tenant.reason


def test_a_shared_plan_is_reauthorised_for_the_request_that_loads_it():
    with policy_kernel() as k:
        docs = list(range(5000, 5000 + 16 * 10))
        stored(k, make_request(docs, tenant="rag", scope="docs", model=MODEL))
        question = make_request([*docs, 1, 2, 3], tenant="chat", model=MODEL)
        plan = k.plan(question)
        assert plan.namespace == Namespace("rag", "docs") and plan.tokens_reused == 160
        assert k.materialize(plan, question).complete
        salted = attrs.evolve(question, cache_salt="other-salt")  # a request that must not see the shared state
        got = k.materialize(plan, salted)
        assert got.tokens == 0 and "cache salt differs" in got.reason
        globex = make_request([*docs, 1, 2, 3], tenant="globex", model=MODEL)
        got = k.materialize(k.seal(attrs.evolve(plan, tenant="globex")), globex)
        assert got.tokens == 0 and "no share rule names it" in got.reason


def test_a_plan_survives_json_but_not_another_deployment():
    with policy_kernel() as k, policy_kernel(secret=bytes(range(1, 33))) as other:
        req = make_request(range(16 * 6), tenant="chat", model=MODEL)
        stored(k, req)
        plan = k.plan(req)
        wire = from_dict(Plan, json.loads(json.dumps(to_dict(plan))))
        assert wire == plan and k.materialize(wire, req).complete
        stored(other, req)
        got = other.materialize(plan, req)
        assert got.tokens == 0 and "MAC does not check" in got.reason
        assert not k.materialize(attrs.evolve(plan, tokens_reused=32), req).states  # any change breaks the MAC


# ------------------------------------------------------------------------------------------------ a peer's state


class InProcessPeers:
    """A remote transport to kernels of this process (address = node name); `fault` injects what a network does."""

    name = "tcp"
    remote = True

    def __init__(self) -> None:
        self.peers: dict[str, Kernel] = {}
        self.fault = ""  # "", "down" (the peer cannot be reached) or "corrupt" (a payload changed on the way)
        self.namespaces: list = []  # the namespace each fetch named

    def fetch(self, store, slot):
        return store.get(slot)

    def authenticate(self, key):  # in-process: every peer holds this process's key
        self.key = key

    def fetch_remote(self, address, tier, slots, timeout_s=None, *, namespace):
        if self.fault == "down":
            raise ConnectionError(f"{address}: connection refused")
        self.namespaces.append(namespace)
        got = [self.peers[address].tiers[tier].get(s) for s in slots]
        got = [g if g is None or g.descriptor.namespace == namespace else None for g in got]  # as tcp's server does
        if self.fault == "corrupt" and got and got[-1] is not None:
            got[-1] = attrs.evolve(got[-1], payload=b"x" + bytes(got[-1].payload)[1:])
        return got

    def close(self) -> None:
        pass


def two_nodes(monkeypatch, req=None, policies=None):
    """Node n2 holds a request's state; node n1 knows it (its index) and reaches n2 through `InProcessPeers`."""
    mover = InProcessPeers()
    pm = with_transport(mover)
    tiers = {"dram": {"store": "dram", "capacity_bytes": "64MiB"}}
    a = Kernel(KernelConfig(node="n1", deadline_ms=60_000.0, tiers=tiers, transports=("local", "tcp"),
                            policies=policies), plugins=pm, secret=SECRET)  # fmt: skip
    b = Kernel(KernelConfig(node="n2", tiers=tiers, policies=policies), secret=SECRET)
    mover.peers["n2"] = b
    monkeypatch.setattr(a.membership, "peer_status", lambda node: {"addresses": {"tcp": node}})
    req = req or make_request(range(16 * 8))
    keys = b.keys(req)
    payloads = [random.Random(i).randbytes(512) for i in range(len(keys))]
    b.commit(req, payloads, keys=keys)
    assert b.flush(10)
    for key in keys:  # what n1's cluster index would have learnt
        a.index.insert(key, Location("dram", "n2", b.epoch), 1)
    return a, b, mover, req, keys, payloads


def test_a_peers_state_is_fetched_verified_measured_and_kept_here(monkeypatch):
    a, b, mover, req, keys, payloads = two_nodes(monkeypatch)
    with a, b:
        plan = a.plan(req, keys=keys)
        assert [(s.node, s.transport) for s in plan.spans] == [("n2", "tcp")]
        got = a.materialize(plan, req, keys=keys)
        assert got.complete and [bytes(got.states[(i, 0)].payload) for i in range(len(keys))] == payloads
        assert mover.namespaces == [req.namespace]  # the fetch named the request's namespace (issue 29, build 1)
        assert a.links.snapshot()["peer:n2"]["samples"] == 1
        assert a.flush(10)
        assert all(a.index.get(k).mask_at("dram", "n1") for k in keys)  # promoted: the next plan reads here
        assert a.plan(req, keys=keys).spans[0].node == "n1"


def test_an_unreachable_peer_means_recompute_and_counts_on_its_own_breaker(monkeypatch):
    a, b, mover, req, keys, _ = two_nodes(monkeypatch)
    with a, b:
        mover.fault = "down"
        plan = a.plan(req, keys=keys)
        got = a.materialize(plan, req, keys=keys)  # never raises
        assert got.blocks == 0 and got.states == {} and "peer:n2 failed" in got.reason
        assert a.health.breaker("peer:n2").failures >= 1
        assert a.health.breaker("dram").failures == 0  # this node's tier did nothing wrong


def test_a_payload_changed_on_the_way_is_refused_and_forgotten(monkeypatch):
    a, b, mover, req, keys, payloads = two_nodes(monkeypatch)
    with a, b:
        mover.fault = "corrupt"
        plan = a.plan(req, keys=keys)
        got = a.materialize(plan, req, keys=keys)
        last = len(keys) - 1
        assert got.blocks == last and (last, 0) not in got.states  # stops at the bad block, never returns it
        assert [bytes(got.states[(i, 0)].payload) for i in range(last)] == payloads[:last]
        assert a.index.get(keys[last]) is None or not a.index.get(keys[last]).mask_at("dram", "n2")
        assert b.tiers["dram"].get(slot_of(keys[last])) is not None  # nothing is deleted on the peer


def test_a_connector_reporting_a_peers_block_corrupt_blames_the_peer_link_not_a_tier_here(monkeypatch):
    a, b, _, req, keys, _ = two_nodes(monkeypatch)
    with a, b:
        plan = a.plan(req, keys=keys)
        start = a.report_load_result(plan, LoadReport(ok=False, failed_block=3, reason="bad tensor", corrupt=True),
                                     keys=keys)  # fmt: skip
        assert start == 3 * 16
        assert a.health.breaker("peer:n2").failures >= 1 and a.health.breaker("dram").failures == 0
        held = a.index.get(keys[3])
        assert held is None or not held.mask_at("dram", "n2")  # n2's entry left this node's index
        assert b.tiers["dram"].get(slot_of(keys[3])) is not None  # and nothing was deleted on n2


def test_a_peer_fetch_of_shared_state_names_the_owners_namespace_and_loads_it(monkeypatch):
    docs = make_request(range(5000, 5000 + 16 * 8), tenant="rag", scope="docs", model=MODEL)
    a, b, mover, _, _, payloads = two_nodes(monkeypatch, req=docs, policies=POLICIES)
    with a, b:
        question = make_request([*docs.token_ids, 1, 2, 3], tenant="chat", model=MODEL)
        plan = a.plan(question)
        got = a.materialize(plan, question)
        assert got.complete and [bytes(got.states[(i, 0)].payload) for i in range(8)] == payloads
        assert mover.namespaces == [Namespace("rag", "docs")]


def test_a_reader_of_shared_state_cannot_make_this_node_forget_the_owners_state(monkeypatch):
    docs = make_request(range(5000, 5000 + 16 * 8), tenant="rag", scope="docs", model=MODEL)
    a, b, _, _, keys, _ = two_nodes(monkeypatch, req=docs, policies=POLICIES)
    with a, b:
        question = make_request([*docs.token_ids, 1, 2, 3], tenant="chat", model=MODEL)
        plan = a.plan(question)
        assert plan.namespace == Namespace("rag", "docs") and plan.spans[0].node == "n2"
        a.report_load_result(plan, LoadReport(ok=False, failed_block=3, reason="bad tensor", corrupt=True),
                             request=question)  # fmt: skip
        assert a.index.get(keys[3]).mask_at("dram", "n2")  # the owner's entry stays: a reader's word is not enough
        assert a.health.breaker("peer:n2").failures >= 1  # the link is still suspect


def test_a_reader_of_shared_state_quarantines_only_what_the_kernels_checks_reject():
    with policy_kernel() as k:
        docs = make_request(range(5000, 5000 + 16 * 8), tenant="rag", scope="docs", model=MODEL)
        keys = stored(k, docs)
        question = make_request([*docs.token_ids, 1, 2, 3], tenant="chat", model=MODEL)
        plan = k.plan(question)
        assert plan.namespace == Namespace("rag", "docs") and plan.tokens_reused == 128
        k.report_load_result(plan, LoadReport(ok=False, failed_block=2, tier="dram", corrupt=True), request=question)
        assert k.index.get(keys[2]) is not None and k.load(keys[2]) is not None  # the owner's block is kept
        k.health.breaker("dram").success()  # the report left the tier's breaker open; the state itself is whole
        assert k.plan(question).tokens_reused == 128
