"""Fail-open: faulty plugins (fakes that only inject a fault) never make plan() wait past its deadline, never
restore wrong state, and never stop the kernel from serving."""

import threading
import time

import attrs
import pytest

from nexuskv import Kernel, KernelConfig, PlanAction, PluginManager, hookimpl
from nexuskv.builtins.dram import DramStore
from nexuskv.kernel import LoadReport
from tests.conftest import SECRET, make_request

RELEASE = threading.Event()


class HangingStore(DramStore):
    """Stores fine, then every read hangs (a dead NFS mount, a stuck driver)."""

    def get(self, slot):
        RELEASE.wait(30)
        return super().get(slot)


class RaisingStore(DramStore):
    def get(self, slot):
        raise OSError("EIO: device error")


class CorruptStore(DramStore):
    """Returns payloads with one flipped byte (bit rot, a torn write)."""

    def get(self, slot):
        got = super().get(slot)
        if got is None:
            return None
        data = bytearray(got.payload)
        data[len(data) // 2] ^= 0xFF
        return type(got)(bytes(data), got.descriptor)


class FaultyStores:
    @hookimpl
    def nexuskv_register_tier_stores(self, register):
        register("hang", HangingStore)
        register("raise", RaisingStore)
        register("corrupt", CorruptStore)


def kernel_with(store: str, **cfg) -> Kernel:
    pm = PluginManager(entry_points=False)
    pm.register(FaultyStores(), "faulty")
    config = KernelConfig(node="n1", tiers={"dram": {"store": store, "capacity_bytes": "8MiB"}},
                          load_timeout_ms=100, **cfg)
    return Kernel(config, plugins=pm, secret=SECRET)


def stored(kernel: Kernel, tokens=range(320)):
    req = make_request(tokens)
    keys = kernel.keys(req)
    kernel.commit(req, [bytes([i]) * 4096 for i in range(len(keys))], keys=keys)
    assert kernel.flush(5)
    return req, keys


@pytest.fixture(autouse=True)
def _release():
    RELEASE.clear()
    yield
    RELEASE.set()


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, (time.perf_counter() - t0) * 1e3


def test_hanging_tier_gives_recompute_within_the_timeout_and_the_kernel_keeps_serving():
    k = kernel_with("hang")
    try:
        req, keys = stored(k)
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.MATERIALIZE  # the index says the state is there
        got, ms = timed(k.materialize, plan, req, keys=keys)
        assert got.blocks == 0 and got.tokens == 0 and "timed out" in got.reason
        assert ms < 5_000  # bounded by load_timeout_ms (100 ms), not by the hang (30 s)
        assert k.health.breaker("dram").state == "open"
        again = k.plan(req, keys=keys)
        assert again.action == PlanAction.RECOMPUTE and again.tokens_reused == 0
        other = k.plan(make_request(range(1000, 1100), tenant="globex"))
        assert other.action == PlanAction.RECOMPUTE  # still serving other requests
    finally:
        RELEASE.set()
        k.close()


def test_raising_tier_gives_recompute_and_trips_its_breaker():
    k = kernel_with("raise", breaker_threshold=2)
    try:
        req, keys = stored(k)
        for _ in range(2):
            plan = k.plan(req, keys=keys)
            assert plan.action == PlanAction.MATERIALIZE
            got = k.materialize(plan, req, keys=keys)
            assert got.tokens == 0 and "EIO" in got.reason
        assert k.health.breaker("dram").state == "open"
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.RECOMPUTE
    finally:
        k.close()


def test_corrupt_bytes_are_never_restored_and_are_quarantined():
    k = kernel_with("corrupt")
    try:
        req, keys = stored(k)
        plan = k.plan(req, keys=keys)
        got = k.materialize(plan, req, keys=keys)
        assert got.blocks == 0 and got.states == {}
        assert k.index.get(keys[0]) is None  # quarantined: no later plan will use it
        assert k.plan(req, keys=keys).action == PlanAction.RECOMPUTE
    finally:
        k.close()


def _tamper(kernel, key, payload=b"planted"):
    """What a writer of the tier's store could do: replace a block's bytes behind the kernel's back."""
    from nexuskv import slot_of

    store = kernel.tiers["dram"]
    got = store.get(slot_of(key))
    store.delete(slot_of(key))
    assert store.put(slot_of(key), payload, got.descriptor)


def test_connector_reported_corruption_quarantines_and_says_where_to_recompute_from(kernel):
    req = make_request(range(320))
    keys = kernel.keys(req)
    kernel.commit(req, [bytes([i]) * 4096 for i in range(len(keys))], keys=keys)
    assert kernel.flush(5)
    plan = kernel.plan(req, keys=keys)
    assert plan.tokens_reused == 320
    _tamper(kernel, keys[7])
    frm = kernel.report_load_result(plan, LoadReport(ok=False, failed_block=7, tier="dram", corrupt=True,
                                                     reason="checksum mismatch in engine"), keys=keys)
    assert frm == 7 * 16
    assert kernel.index.get(keys[7]) is None  # re-read, it fails the kernel's check: quarantined
    assert kernel.health.breaker("dram").state == "open"
    assert kernel.report_load_result(plan, LoadReport(ok=True)) == 320
    assert kernel.health.breaker("dram").state == "closed"


def test_a_block_reported_corrupt_that_verifies_is_kept(kernel):
    """Only the kernel's own checks quarantine: a report alone cannot delete good state (issue 29, finding 6)."""
    req = make_request(range(320))
    keys = kernel.keys(req)
    kernel.commit(req, [bytes([i]) * 4096 for i in range(len(keys))], keys=keys)
    assert kernel.flush(5)
    plan = kernel.plan(req, keys=keys)
    frm = kernel.report_load_result(plan, LoadReport(ok=False, failed_block=7, tier="dram", corrupt=True,
                                                     reason="the engine says so"), keys=keys, request=req)
    assert frm == 7 * 16 and kernel.health.breaker("dram").state == "open"  # the path is still suspect
    assert kernel.index.get(keys[7]) is not None and kernel.load(keys[7]) is not None  # the block is kept
    kernel.health.breaker("dram").success()
    other = attrs.evolve(req, tenant="chat")  # another tenant's request: the plan is not its to report on
    refused = kernel.report_load_result(plan, LoadReport(ok=False, failed_block=7, tier="dram", corrupt=True),
                                        request=other)  # fmt: skip
    assert refused == 0 and kernel.health.breaker("dram").state == "closed"  # refused: nothing changed


def test_a_report_cannot_name_blocks_outside_its_plan(kernel):
    owner = make_request(range(256), tenant="rag")
    owner_keys = kernel.keys(owner)
    kernel.commit(owner, [bytes([i]) * 1024 for i in range(len(owner_keys))], keys=owner_keys)
    reader = make_request(range(1000, 1256), tenant="chat")
    reader_keys = kernel.keys(reader)
    kernel.commit(reader, [bytes([i]) * 1024 for i in range(len(reader_keys))], keys=reader_keys)
    assert kernel.flush(5)
    plan = kernel.plan(reader, keys=reader_keys)
    assert plan.tokens_reused == 256
    _tamper(kernel, owner_keys[8])  # even a block that is really bad is not the reader's to report
    kernel.report_load_result(plan, LoadReport(ok=False, failed_block=40, tier="dram", corrupt=True),
                              keys=owner_keys * 4)  # fmt: skip
    assert kernel.index.get(owner_keys[8]) is not None  # block 40 (the owner's 8th) is past the plan's 16 blocks
    kernel.report_load_result(plan, LoadReport(ok=False, failed_block=8, tier="dram", corrupt=True),
                              keys=owner_keys, request=reader)  # with the request, the plan's own keys count
    assert kernel.index.get(owner_keys[8]) is not None and kernel.load(reader_keys[8]) is not None


def test_a_latent_block_reported_by_another_tensor_parallel_rank_is_kept(kernel):
    """MLA latent state is stored once for every TP rank: rank 1's report must not read rank 0's as foreign."""
    from tests.conftest import layout_of

    rank0 = make_request(range(256), layout=attrs.evolve(layout_of("latent"), tp_rank=0, tp_size=2))
    keys = kernel.keys(rank0)
    kernel.commit(rank0, [bytes([i]) * 1024 for i in range(len(keys))], keys=keys)
    assert kernel.flush(5)
    rank1 = attrs.evolve(rank0, layout=attrs.evolve(rank0.layout, tp_rank=1))
    assert kernel.keys(rank1) == keys
    plan = kernel.plan(rank1, keys=keys)
    assert plan.tokens_reused == 256
    kernel.report_load_result(plan, LoadReport(ok=False, failed_block=5, tier="dram", corrupt=True), request=rank1)
    assert kernel.index.get(keys[5]) is not None and kernel.load(keys[5]) is not None  # it verifies: kept
    _tamper(kernel, keys[6])
    kernel.health.breaker("dram").success()
    kernel.report_load_result(plan, LoadReport(ok=False, failed_block=6, tier="dram", corrupt=True), request=rank1)
    assert kernel.index.get(keys[6]) is None  # a block that really is bad still goes


class DownControlPlane:
    def __init__(self, fail_from: int = 0):
        self.calls = 0
        self.fail_from = fail_from
        self._epoch = 0

    def _maybe_fail(self):
        self.calls += 1
        if self.calls > self.fail_from:
            raise ConnectionError("etcd: connection refused")

    def epoch(self):
        return self._epoch

    def bump_epoch(self):
        self._epoch += 1
        return self._epoch

    def grant(self, ttl_s):
        from nexuskv import Lease

        self._maybe_fail()
        return Lease(lease_id=1, ttl_s=ttl_s)

    def keepalive(self, lease_id):
        self._maybe_fail()
        return True

    def revoke(self, lease_id):
        pass

    def alive(self, lease_id):
        return True

    def join(self, node, lease_id):
        self._maybe_fail()
        return self.bump_epoch()

    def members(self):
        return {}

    def close(self):
        pass


def control_plugin(cp):
    class Plugin:
        @hookimpl(tryfirst=True)
        def nexuskv_control_plane(self, config):
            return cp

    pm = PluginManager(entry_points=False)
    pm.register(Plugin(), "down-cp")
    return pm


def test_control_plane_down_at_start_kernel_starts_and_recomputes():
    k = Kernel(KernelConfig(node="n1"), plugins=control_plugin(DownControlPlane()), secret=SECRET)
    try:
        req, keys = stored(k)  # the write path still works: state is kept for when the plane is back
        plan, _ = timed(k.plan, req, keys=keys)
        assert plan.action == PlanAction.RECOMPUTE
        assert any("control plane unavailable" in r and "connection refused" in r for r in plan.reasons)
    finally:
        k.close()


def test_control_plane_dying_later_turns_plans_into_recompute():
    cp = DownControlPlane(fail_from=10**9)  # healthy until the test says otherwise
    k = Kernel(KernelConfig(node="n1", lease_ttl_s=2.0), plugins=control_plugin(cp), secret=SECRET)
    try:
        req, keys = stored(k)
        assert k.plan(req, keys=keys).action == PlanAction.MATERIALIZE
        cp.fail_from = 0  # etcd goes away: the next heartbeat (within ttl / 3) fails
        deadline = time.monotonic() + 10
        while k.control_ok() and time.monotonic() < deadline:
            time.sleep(0.02)
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.RECOMPUTE and "control plane unavailable" in plan.reasons[0]
    finally:
        k.close()


class SlowMatcher:
    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def match(self, keys, layout):
        time.sleep(self.delay)
        return self.inner.match(keys, layout)


def matcher_plugin(make):
    class Plugin:
        @hookimpl(tryfirst=True)
        def nexuskv_matcher(self, config):
            return make()

    pm = PluginManager(entry_points=False)
    pm.register(Plugin(), "matcher")
    return pm


def test_hung_matcher_plugin_costs_the_deadline_not_more():
    from nexuskv import DictIndex

    k = Kernel(KernelConfig(node="n1", deadline_ms=20), plugins=matcher_plugin(lambda: SlowMatcher(DictIndex(), 5)),
               secret=SECRET)
    try:
        plan, ms = timed(k.plan, make_request(range(64)))
        assert plan.action == PlanAction.RECOMPUTE and "matcher" in plan.reasons[0]
        assert ms < 2_000  # the deadline is 20 ms; the hang is 5 s
    finally:
        k.close()


def test_a_requests_deadline_never_exceeds_the_operators_maximum():
    """Issue 29, finding 3: a request's `slo.deadline_ms` replaced the kernel's deadline with no upper bound."""
    from nexuskv import DictIndex, Slo

    k = Kernel(KernelConfig(node="n1", deadline_ms=20, max_deadline_ms=50),
               plugins=matcher_plugin(lambda: SlowMatcher(DictIndex(), 5)), secret=SECRET)  # fmt: skip
    try:
        greedy = make_request(range(64), slo=Slo(deadline_ms=3_600_000))  # an hour, asked by a tenant
        plan = k.plan(greedy)
        assert plan.action == PlanAction.RECOMPUTE and "deadline 50 ms passed" in plan.reasons[0]
        assert "deadline 30 ms passed" in k.plan(make_request(range(64), slo=Slo(deadline_ms=30))).reasons[0]
    finally:
        k.close()


def test_a_hung_matcher_plugin_on_a_shared_scope_leaves_the_own_plan_standing():
    """The shared scope's match is bounded like the own one: the plan answers while the plugin still hangs."""
    from pathlib import Path

    from nexuskv import DictIndex, Location, ModelIdentity

    gate, hanging = threading.Event(), []

    class HangsAfterTheFirst(SlowMatcher):
        calls = 0

        def match(self, keys, layout):
            HangsAfterTheFirst.calls += 1
            if HangsAfterTheFirst.calls > 1:  # the shared scope's match: hang until the test lets go
                hanging.append(True)
                gate.wait(30)
                hanging.append(False)
            return self.inner.match(keys, layout)

    policies = str(Path(__file__).resolve().parents[1] / "policies")
    cfg = KernelConfig(node="n1", deadline_ms=50, policies=policies)
    k = Kernel(cfg, plugins=matcher_plugin(lambda: HangsAfterTheFirst(DictIndex(), 0)), secret=SECRET)
    HangsAfterTheFirst.calls = 0  # the constructor's warm-up matched once: count the plan's matches only
    try:
        docs = make_request(range(16 * 8), tenant="rag", scope="docs", model=ModelIdentity(name="tiny-llama"))
        k.index.insert_many(k.keys(docs), Location("dram", "n1", k.epoch))
        plan = k.plan(make_request(range(16 * 8 + 3), tenant="chat", model=ModelIdentity(name="tiny-llama")))
        assert hanging == [True]  # it answered while the shared scope's match still hung
        assert plan.namespace is None and not plan.reasons[0].startswith("fail-open")  # its own plan stood
    finally:
        gate.set()
        k.close()


def test_a_hung_get_of_a_matcher_plugin_on_a_shared_scope_leaves_the_own_plan_standing():
    """The shared scope's key walk asks the matcher's `get`: a plugin's `get` is bounded like its `match`."""
    from pathlib import Path

    from nexuskv import DictIndex, Location, ModelIdentity

    gate, hanging = threading.Event(), []

    class GetHangs(SlowMatcher):
        def get(self, key):
            hanging.append(True)
            gate.wait(30)
            return self.inner.get(key)

    policies = str(Path(__file__).resolve().parents[1] / "policies")
    k = Kernel(KernelConfig(node="n1", deadline_ms=50, policies=policies),
               plugins=matcher_plugin(lambda: GetHangs(DictIndex(), 0)), secret=SECRET)  # fmt: skip
    try:
        docs = make_request(range(16 * 8), tenant="rag", scope="docs", model=ModelIdentity(name="tiny-llama"))
        k.index.insert_many(k.keys(docs), Location("dram", "n1", k.epoch))
        plan = k.plan(make_request(range(16 * 8 + 3), tenant="chat", model=ModelIdentity(name="tiny-llama")))
        assert hanging and not gate.is_set()  # it answered while `get` still hung
        assert plan.namespace is None and not plan.reasons[0].startswith("fail-open")  # its own plan stood
    finally:
        gate.set()
        k.close()


def test_raising_matcher_plugin_gives_recompute_with_the_reason():
    class Broken:
        def match(self, keys, layout):
            raise RuntimeError("native matcher segfaulted (simulated)")

        def __getattr__(self, name):
            return lambda *a, **k: None

    k = Kernel(KernelConfig(node="n1"), plugins=matcher_plugin(Broken), secret=SECRET)
    try:
        plan = k.plan(make_request(range(64)))
        assert plan.action == PlanAction.RECOMPUTE
        assert "match failed" in plan.reasons[0] and "segfaulted" in plan.reasons[0]
    finally:
        k.close()


def test_hung_decision_observer_never_delays_plans():
    gate = threading.Event()

    class Slow:
        @hookimpl
        def nexuskv_observe_decision(self, decision):
            gate.wait(30)

    pm = PluginManager(entry_points=False)
    pm.register(Slow(), "slow-observer")
    k = Kernel(KernelConfig(node="n1"), plugins=pm, secret=SECRET)
    try:
        for i in range(20):
            plan, _ = timed(k.plan, make_request(range(i, i + 64)))
            assert plan.action == PlanAction.RECOMPUTE
        assert k.decisions == 20
    finally:
        gate.set()
        k.close()


def test_writer_failures_never_reach_the_caller():
    class PutRaises(DramStore):
        def put(self, *a, **k):
            raise OSError("ENOSPC: no space left on device")

    class Plugin:
        @hookimpl
        def nexuskv_register_tier_stores(self, register):
            register("full", PutRaises)

    pm = PluginManager(entry_points=False)
    pm.register(Plugin(), "full")
    k = Kernel(KernelConfig(node="n1", tiers={"dram": {"store": "full"}}), plugins=pm, secret=SECRET)
    try:
        req = make_request(range(64))
        res = k.commit(req, [b"x" * 100] * 4)
        assert res.accepted == 4
        assert k.flush(5)
        assert k.writer.stats["failed"] == 1 and len(k.index) == 0  # block 0 failed ...
        assert k.writes.orphans == 3  # ... and blocks 1-3, whose prefix is held nowhere, were not tried
        assert k.plan(req).action == PlanAction.RECOMPUTE
    finally:
        k.close()


def test_a_failing_transport_trips_its_own_breaker_and_plans_recompute(kernel):
    req = make_request(range(320))
    keys = kernel.keys(req)
    kernel.commit(req, [bytes([i]) * 4096 for i in range(len(keys))], keys=keys)
    assert kernel.flush(5)
    for _ in range(3):  # e.g. an RDMA link that keeps timing out while the tier itself is fine
        kernel.health.breaker("transport:local").failure("link reset")
    plan = kernel.plan(req, keys=keys)
    assert plan.action == PlanAction.RECOMPUTE and "transport:local circuit open" in plan.reasons[0]
    assert kernel.health.breaker("dram").state == "closed"
