"""ReadPath: plans made from many threads at once are the plans one thread makes, shared scopes included."""

from __future__ import annotations

import random
from pathlib import Path

from nexuskv import Kernel, KernelConfig, ModelIdentity, PlanAction
from tests.conftest import SECRET, make_request, run_threads

POLICIES = str(Path(__file__).resolve().parents[2] / "policies")
MODEL = ModelIdentity(name="tiny-llama", revision="1")  # the rag tenant shares its docs for this model


def summary(plan):
    ns = (plan.namespace.tenant, plan.namespace.scope) if plan.namespace is not None else None
    return plan.action, plan.tokens_reused, tuple((s.start, s.end, s.tier) for s in plan.spans), ns


def test_plans_from_many_threads_equal_the_plans_of_one_thread():
    cfg = KernelConfig(node="n1", policies=POLICIES, deadline_ms=60_000.0,  # no fallback: every plan is decided
                       tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})  # one tier: no prefetch
    rng = random.Random(3)
    with Kernel(cfg, secret=SECRET) as k:
        docs = [rng.randrange(30_000) for _ in range(16 * 20)]
        chat_history = [rng.randrange(30_000) for _ in range(16 * 12)]
        for req in (make_request(docs, tenant="rag", scope="docs", model=MODEL),
                    make_request(chat_history, tenant="chat", model=MODEL)):  # fmt: skip
            keys = k.keys(req)
            assert k.commit(req, [bytes([b % 256]) * 4096 for b in range(len(keys))], keys=keys).refused == 0
        assert k.flush(10)
        requests = []
        for tenant in ("chat", "globex", "partner-a", "strict", "rag"):
            for prefix in (docs, chat_history, []):
                for extra in (0, 16 * 3, 16 * 9 + 5):
                    toks = prefix + [rng.randrange(30_000) for _ in range(extra)]
                    if toks:
                        requests.append(make_request(toks, tenant=tenant, model=MODEL))
        reference = [summary(k.plan(r)) for r in requests]
        assert {a for a, *_ in reference} == {PlanAction.MATERIALIZE, PlanAction.RECOMPUTE}
        assert any(ns == ("rag", "docs") for *_, ns in reference)  # shared scopes are part of the mix
        wrong: list[str] = []

        def worker(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(120):
                i = r.randrange(len(requests))
                sess = f"s{i}" if r.random() < 0.5 else None  # session chains and plain keys mixed
                got = summary(k.plan(requests[i], session=sess))
                if got != reference[i]:
                    wrong.append(f"request {i}: {got} != {reference[i]}")

        run_threads(worker, 8, switch_interval=1e-5)
        assert wrong == []
        assert k.decisions == len(requests) + 8 * 120


def test_link_conditions_are_owned_by_the_read_path_and_set_through_the_kernel():
    with Kernel(KernelConfig(node="n1", bandwidth_scale={"disk": 0.5}), secret=SECRET) as k:
        assert k.bandwidth_scale == {"disk": 0.5} and k.reads.bandwidth_scale is k.bandwidth_scale
        k.bandwidth_scale = {"disk": 1e-4}
        k.link_load = {"dram": 1e6}
        assert k.reads.bandwidth_scale == {"disk": 1e-4} and k.reads.link_load == {"dram": 1e6}
        assert k.reads._inflight() == {"dram": 1e6}


def test_a_session_plan_for_an_image_turn_never_restores_the_text_only_state():
    from nexuskv import ExtraInput

    cfg = KernelConfig(node="n1", deadline_ms=60_000.0, tiers={"dram": {"store": "dram", "capacity_bytes": "8MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        text = make_request(range(16 * 8), request_id="t1")
        k.plan(text, session="chat-1")
        k.commit(text, [bytes([b]) * 512 for b in range(8)])
        assert k.flush(5)
        image = make_request(range(16 * 8), request_id="t2",
                             extra_inputs=[ExtraInput(position=40, digest="sha256:cat")])  # block 2  # fmt: skip
        plan = k.plan(image, session="chat-1")
        assert plan.tokens_reused == 32  # blocks 0 and 1: the same tokens and no image yet
        got = k.materialize(plan, image)
        assert got.complete and sorted(got.states) == [(0, 0), (1, 0)]


# ------------------------------------------------------------------------------------------ the deadline is checked
# A fake clock moves 0.1 ms on every reading, so "time" is the number of readings: deterministic on any machine.


class TickClock:
    def __init__(self, tick_s: float = 1e-4) -> None:
        self.now = 1000.0
        self.tick = tick_s

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _big(n_blocks: int, kind: str = "dense", tenant: str = "acme"):
    from tests.conftest import layout_of

    return make_request([(i * 7919) % 30_000 for i in range(16 * n_blocks)], tenant=tenant, layout=layout_of(kind))


def test_a_cold_long_request_stops_hashing_when_its_deadline_passes(monkeypatch):
    import time

    with Kernel(KernelConfig(node="n1", keyer={"name": "python"}), secret=SECRET) as k:  # native: in its tests
        req = _big(2048)
        chunks = []
        keyer = type(k.keyer)
        real = keyer._blocks
        monkeypatch.setattr(keyer, "_blocks", lambda *a: chunks.append(1) or real(*a))
        monkeypatch.setattr(time, "perf_counter", TickClock())
        plan = k.plan(req, deadline_ms=0.35)
        monkeypatch.undo()
        assert plan.action == PlanAction.RECOMPUTE and plan.reasons == ("fail-open: deadline 0.35 ms passed in keys",)
        assert 1 <= len(chunks) <= 3 < 2048 // k.keyer.deadline_chunk  # checks run between chunks, not after
        assert k.reads.deadline_fallbacks == 1


def test_the_match_and_the_checkpoint_scan_stop_when_the_deadline_passes(monkeypatch):
    import time

    reference = dict(keyer={"name": "python"}, matcher={"name": "dict"})  # the clock is Python's: C reads its own
    with Kernel(KernelConfig(node="n1", **reference), secret=SECRET) as k:
        dense, rec = _big(2048), _big(2048, kind="recurrent")
        k.index.insert_many(k.keys(dense), __import__("nexuskv").Location("dram", "n1", k.epoch))
        k.index.insert_many(k.keys(rec), __import__("nexuskv").Location("dram", "n1", k.epoch))
        keys_d, keys_r = k.keys(dense), k.keys(rec)
        monkeypatch.setattr(time, "perf_counter", TickClock())
        p1 = k.plan(dense, keys=keys_d, deadline_ms=0.25)
        from nexuskv.state.index import _MATCH_CHUNK

        reads = -(-2048 // _MATCH_CHUNK)  # readings of the match; then one check, three in candidates, 8 in the scan
        late = round((reads + 5.5) * 0.1, 2)  # passes at the second reading of the checkpoint scan
        p2 = k.plan(rec, keys=keys_r, deadline_ms=late)
        monkeypatch.undo()
    assert p1.reasons == ("fail-open: deadline 0.25 ms passed in match",)
    assert p2.reasons == (f"fail-open: deadline {late:g} ms passed in plan (checkpoints)",)


def test_shared_scopes_stop_when_the_deadline_passes_and_the_own_plan_stands(monkeypatch):
    import time

    cfg = KernelConfig(node="n1", policies=POLICIES, tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}},
                       keyer={"name": "python"}, matcher={"name": "dict"})  # the clock is Python's (TickClock)
    with Kernel(cfg, secret=SECRET) as k:
        docs = make_request(range(16 * 600), tenant="rag", scope="docs", model=MODEL)
        k.index.insert_many(k.keys(docs), __import__("nexuskv").Location("dram", "n1", k.epoch))
        question = make_request(range(16 * 600), tenant="chat", model=MODEL)
        keys = k.keys(question)
        from nexuskv import BlockKeyer

        held = []  # the own keys are given: only the shared scope hashes
        orig = BlockKeyer.extend
        monkeypatch.setattr(BlockKeyer, "extend", lambda *a, **kw: held.append(1) or orig(*a, **kw))
        monkeypatch.setattr(time, "perf_counter", TickClock())
        plan = k.plan(question, keys=keys, deadline_ms=0.6)
        monkeypatch.undo()
    assert plan.action == PlanAction.RECOMPUTE and plan.namespace is None  # its own (empty) plan, not a fallback
    assert not plan.reasons[0].startswith("fail-open")
    assert len(held) < 600 // 64  # the shared scope's keys were not all hashed
