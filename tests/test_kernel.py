import os
import threading
import time

import attrs
import pytest

from nexuskv import ChecksumError, ConfigError, Kernel, KernelConfig, Location, ModelIdentity
from nexuskv.policy.bundle import PolicyBundle
from tests.conftest import SECRET, layout_of, make_request


def commit_all(kernel, req, size=100, group=0):
    keys = kernel.keys(req)
    for b in range(len(keys)):
        payload = bytes([b % 256]) * size
        assert kernel.put(kernel.describe(req, b, payload, tier="dram", group=group, keys=keys), payload)
    return keys


def test_put_match_load_roundtrip(kernel):
    req = make_request(range(100))
    keys = commit_all(kernel, req)
    m = kernel.match(req)
    assert m.longest() == 6 and m.tokens() == 96 and m.by_node() == {"n1": 6}
    got = kernel.load(keys[2])
    assert bytes(got.payload) == bytes([2]) * 100
    assert got.descriptor.span.start == 32 and got.descriptor.parent_key == keys[1].hex()
    assert got.descriptor.placement == attrs.evolve(got.descriptor.placement, tier="dram", node="n1")


def test_other_tenant_sees_nothing(kernel):
    commit_all(kernel, make_request(range(64)))
    assert kernel.match(make_request(range(64), tenant="globex")).longest() == 0


def test_eviction_keeps_index_exact():
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": 1000}})
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(16 * 30))
        keys = k.keys(req)
        stored = [k.put(k.describe(req, b, bytes([b]) * 100, tier="dram", keys=keys), bytes([b]) * 100)
                  for b in range(30)]  # fmt: skip
        assert stored == [True] * 10 + [False] * 20  # a full tier refuses the tail rather than drop the head
        other = make_request(range(1000, 1000 + 16 * 4), tenant="globex")
        commit_all(k, other, size=100)  # another request evicts the first one's leaves, deepest first
        store = k.tiers["dram"]
        assert len(k.index) == len(store) == 10
        held = {slot[:-1] for slot in store.slots()}
        assert held == set(k.index.keys_at(Location("dram", "n1", k.epoch)))
        assert k.match(req).longest() == 6 and k.match(other).longest() == 4  # both keep their prefixes


def test_corrupt_payload_is_quarantined_never_returned(kernel):
    req = make_request(range(64))
    keys = commit_all(kernel, req)
    store = kernel.tiers["dram"]
    slot = keys[1] + b"\x00"
    good = store.get(slot)
    store.put(slot, b"\xff" * 100, good.descriptor)  # bit rot behind the kernel's back
    assert kernel.load(keys[1]) is None
    assert slot not in store
    assert kernel.index.get(keys[1]) is None
    assert kernel.match(req).longest() == 1


def test_put_refuses_payload_that_does_not_match_its_checksum(kernel):
    req = make_request(range(32))
    desc = kernel.describe(req, 0, b"abc", tier="dram")
    with pytest.raises(ChecksumError):
        kernel.put(desc, b"abd")
    assert len(kernel.index) == 0


def test_put_to_unknown_tier(kernel):
    req = make_request(range(32))
    desc = kernel.describe(req, 0, b"abc", tier="ssd")
    with pytest.raises(ConfigError, match="no tier named 'ssd'"):
        kernel.put(desc, b"abc")


def test_describe_checkpoint_spans_and_bounds(kernel):
    req = make_request(range(64), layout=layout_of("dense", "recurrent"))
    d = kernel.describe(req, 2, b"x", tier="dram", group=1)
    assert (d.span.start, d.span.end, d.group) == (0, 48, 1)
    with pytest.raises(IndexError):
        kernel.describe(req, 4, b"x", tier="dram")
    with pytest.raises(IndexError):
        kernel.describe(req, 0, b"x", tier="dram", group=2)


def test_hybrid_groups_are_separate_slots(kernel):
    req = make_request(range(64), layout=layout_of("dense", "recurrent"))
    keys = commit_all(kernel, req)
    assert kernel.match(req).longest() == 0  # pages only: no recurrent checkpoint yet
    p = b"state"
    kernel.put(kernel.describe(req, 2, p, tier="dram", group=1, keys=keys), p)
    assert kernel.match(req).longest() == 3
    assert bytes(kernel.load(keys[2], group=1).payload) == p


def test_session_chain_matches_request_keys(kernel):
    req = make_request(range(50))
    chain = kernel.session(req)
    assert chain.keys == kernel.keys(req)
    chain.extend(range(50, 70))
    assert chain.keys == kernel.keys(make_request(range(70)))


def test_from_config_toml(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text('node = "edge-1"\npage_size = 32\nsecret = "' + "ab" * 16 + '"\n'
                 '[tiers.disk]\nstore = "dram"\ncapacity_bytes = "2MiB"\n')  # a tier named by the profile
    with Kernel.from_config(p) as k:
        assert k.node == "edge-1" and k.keyer.page_size == 32
        assert k.tiers["disk"].capacity_bytes == 2 << 20 and k.tiers["disk"].name == "disk"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("node = 'a'\nbogus = 1\n", "bogus"),
        ("page_size = 'big'\n", "page_size"),
        ("node = \n", "k.toml"),
        ("[tiers.hot]\nstore = 'nvme'\n", "no tier store plugin named 'nvme'"),
        ("[tiers.hot]\nstore = 'dram'\ncapacity_bytes = 'lots'\n", "tiers.hot.capacity_bytes"),
        ("[tiers.hot]\nstore = 'dram'\nspeed = 3\n", "tiers.hot"),
        ("transports = ['rdma']\n", "no transport plugin named ['rdma']"),
        ("[tiers.hot]\nstore = 'dram'\n", "k.toml: tiers.hot: the cost profile 'default-cpu-tiny-llama' (the built-in "
                                          "default: `profile` is not set) has no cost for this tier"),
    ],
)
def test_bad_config_is_a_precise_error(tmp_path, text, fragment):
    p = tmp_path / "k.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        Kernel.from_config(p, secret=SECRET)
    assert fragment in str(info.value)


def test_close_revokes_lease(kernel):
    lease = kernel.lease
    kernel.close()
    assert not kernel.control.alive(lease.lease_id)


# ------------------------------------------------------------------------------------------ plan / commit

import asyncio  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from nexuskv import PlanAction, hookimpl, slot_of, to_dict  # noqa: E402
from nexuskv.plugins.manager import PluginManager  # noqa: E402

POLICIES = str(Path(__file__).resolve().parents[1] / "policies")


def policy_kernel(**cfg):
    base = dict(node="n1", policies=POLICIES, tiers={"dram": {"store": "dram", "capacity_bytes": "8MiB"},
                                                     "disk": {"store": "dram", "capacity_bytes": "64MiB"}})
    base.update(cfg)
    return Kernel(KernelConfig(**base), secret=SECRET)


def commit_and_flush(k, req, size=4096):
    keys = k.keys(req)
    res = k.commit(req, [bytes([b % 256]) * size for b in range(len(keys))], keys=keys)
    assert k.flush(5)
    return res, keys


def test_plan_recomputes_cold_and_materializes_after_commit():
    with policy_kernel() as k:
        req = make_request(range(1000), tenant="chat")
        cold = k.plan(req)
        assert cold.action == PlanAction.RECOMPUTE and cold.tokens_reused == 0
        res, keys = commit_and_flush(k, req)
        assert (res.accepted, res.refused, res.backpressure) == (62, 0, False)
        warm = k.plan(req, keys=keys)
        assert warm.action == PlanAction.MATERIALIZE and warm.tokens_reused == 992
        assert warm.spans[0].tier == "dram" and warm.policy_revision == k.policies.revision == k.policy_revision
        assert warm.predicted.gain_ms > 0 and warm.predicted.ttft_ms < cold.predicted.ttft_ms
        got = k.materialize(warm, req, keys=keys)
        assert got.complete and len(got.states) == 62
        assert bytes(got.states[(5, 0)].payload) == bytes([5]) * 4096


def test_plans_are_deterministic_for_the_same_inputs():
    with policy_kernel() as k:
        req = make_request(range(500), tenant="chat")
        _, keys = commit_and_flush(k, req)
        a, b = k.plan(req, keys=keys), k.plan(req, keys=keys)
        assert a.decision_id != b.decision_id
        strip = lambda p: {**to_dict(p), "decision_id": None, "mac": None}  # noqa: E731 (the MAC covers the id)
        assert strip(a) == strip(b)


def test_admit_rules_refuse_state_off_the_callers_thread():
    with policy_kernel() as k:
        req = make_request(range(160), tenant="chat", scope="tmp-1")  # chat's no-tmp-sessions rule
        res, _ = commit_and_flush(k, req)
        assert res.accepted == 10  # accepted into the queue...
        assert len(k.index) == 0  # ...and refused by the admit rule in the writer


def test_place_rules_choose_the_tier():
    with policy_kernel() as k:
        req = make_request(range(160), tenant="rag", scope="docs")  # rag: documents go to disk
        _, keys = commit_and_flush(k, req)
        assert set(k.index.get(keys[0]).tiers()) == {"disk"}


def test_reuse_rules_cap_and_refuse():
    with policy_kernel() as k:
        req = make_request(range(160), tenant="strict")
        _, keys = commit_and_flush(k, req)
        for key in keys:  # move the state to disk behind the planner's back: strict reads DRAM only
            k.index.drop_location(Location("dram", "n1", k.epoch))
            k.index.insert(key, Location("disk", "n1", k.epoch))
        plan = k.plan(req, keys=keys)
        assert plan.tokens_reused == 0 and "dram-only" in plan.rules
        assert plan.action == PlanAction.PREFETCH  # not from disk now, but moved to DRAM where it is allowed
        assert plan.prefetch[0].target_tier == "dram"


def test_min_gain_turns_a_tiny_gain_into_recompute(tmp_path):
    pol = tmp_path / "policies"
    pol.mkdir()
    (pol / "default.toml").write_text('name = "default"\nmin_gain_ms = 1e9\n')
    with policy_kernel(policies=str(pol)) as k:
        req = make_request(range(320))
        _, keys = commit_and_flush(k, req)
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.RECOMPUTE and "does not beat min gain" in plan.reasons[-1]


def test_backpressure_refuses_what_the_writer_cannot_hold():
    with Kernel(KernelConfig(node="n1", writer_max_items=3), secret=SECRET) as k:
        gate = threading.Event()
        k.writer._sink = lambda item: gate.wait(5)  # a stuck tier: the queue fills
        res = k.commit(make_request(range(160)), [b"x"] * 10)
        assert res.backpressure and res.accepted + res.refused == 10 and res.accepted <= 4
        gate.set()


def test_session_keys_are_reused_and_checked():
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as k:
        first = make_request(range(100))
        k1 = k.keys_for(first, session="s1")
        longer = make_request(range(130))
        assert k.keys_for(longer, session="s1") == k.keys(longer)
        other = make_request([7, *range(1, 130)])  # not a continuation: recomputed, not trusted
        assert k.keys_for(other, session="s1") == k.keys(other)
        assert k1 == k.keys(first)


def test_decision_log_and_observers_get_one_record_per_decision():
    seen = []

    class Observer:
        @hookimpl
        def nexuskv_observe_decision(self, decision):
            seen.append(decision)

    pm = PluginManager(entry_points=False)
    pm.register(Observer(), "obs")
    with Kernel(KernelConfig(node="n1"), plugins=pm, secret=SECRET) as k:
        plan = k.plan(make_request(range(64), tenant="acme"))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    rec = seen[0]
    assert rec["decision_id"] == plan.decision_id and rec["tenant"] == "acme"
    assert rec["action"] == "recompute" and "predicted" in rec and "policy_revision" in rec
    json.dumps(rec)  # JSON-compatible


def test_async_variants():
    async def go():
        with policy_kernel() as k:
            req = make_request(range(320), tenant="chat")
            res = await k.acommit(req, [b"y" * 1024] * 20)
            assert res.accepted == 20 and k.flush(5)
            plan = await k.aplan(req)
            got = await k.amaterialize(plan, req)
            return plan, got

    plan, got = asyncio.run(go())
    assert plan.action == PlanAction.MATERIALIZE and got.complete


def test_page_size_mismatch_is_refused_by_plan():
    with Kernel(KernelConfig(node="n1", page_size=32), secret=SECRET) as k:
        plan = k.plan(make_request(range(64)))
        assert plan.action == PlanAction.RECOMPUTE and "page_size" in plan.reasons[0]


def test_lru_eviction_option():
    with Kernel(KernelConfig(node="n1", eviction="lru"), secret=SECRET) as k:
        d = k.describe(make_request(range(64)), 1, b"x", tier="dram")
        assert k.default_priority(d) == 0.0
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as k:
        d1 = k.describe(make_request(range(64)), 0, b"x", tier="dram")
        assert k.default_priority(d1) > 0.0  # cost-aware: the recompute time it saves per byte


def test_demotion_moves_evicted_state_one_tier_down():
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": 4096 * 4},
                                         "disk": {"store": "dram", "capacity_bytes": "1MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(160))
        _, keys = commit_and_flush(k, req)
        tiers = [k.index.get(key).tiers() for key in keys]
        assert all(t for t in tiers)  # nothing lost
        assert sum("disk" in t for t in tiers) == 6 and sum("dram" in t for t in tiers) == 4
        plan = k.plan(req, keys=keys)
        assert plan.tokens_reused == 160 and {s.tier for s in plan.spans} == {"dram", "disk"}


def test_config_allow_and_block_lists_reach_the_plugin_manager(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text('plugins = ["not-installed"]\ndisable_plugins = ["embedded"]\n[control_plane]\nname = "x"\n')
    with pytest.raises(Exception, match="no plugin answered nexuskv_control_plane"):
        Kernel.from_config(p, secret=SECRET)
    p.write_text('plugins = ["not-installed"]\n')
    with Kernel.from_config(p, secret=SECRET) as k:
        assert [(q.plugin, q.stage) for q in k.plugins.problems] == [("not-installed", "allow-list")]


def test_shared_documents_are_reused_only_by_granted_tenants():
    with policy_kernel() as k:
        model = ModelIdentity(name="tiny-llama", revision="1")  # rag shares docs for this model only
        docs = list(range(5000, 5000 + 320))
        owner = make_request(docs, tenant="rag", scope="docs", model=model)  # shared with chat and partner-a
        commit_and_flush(k, owner)
        question = docs + list(range(90000, 90040))
        plan = k.plan(make_request(question, tenant="chat", model=model))
        assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 320
        assert plan.namespace is not None and (plan.namespace.tenant, plan.namespace.scope) == ("rag", "docs")
        assert plan.reasons[0].startswith("budget ") and plan.reasons[1] == "shared by tenant rag (scope docs)"
        reader = make_request(question, tenant="chat", model=model)
        got = k.materialize(plan, reader, keys=k.keys(reader))  # the caller's own keys are not the owner's
        assert got.complete and bytes(got.states[(3, 0)].payload) == bytes([3]) * 4096
        # not granted: another tenant sees nothing
        assert k.plan(make_request(question, tenant="globex", model=model)).tokens_reused == 0
        # the strict tenant is not granted, and its own policy refuses shared state anyway
        assert k.plan(make_request(question, tenant="strict", model=model)).tokens_reused == 0
        # partner-a is granted too
        assert k.plan(make_request(question, tenant="partner-a", model=model)).tokens_reused == 320


def test_shipped_example_config_loads():
    cfg_path = Path(__file__).resolve().parents[1] / "examples" / "kernel.toml"
    with Kernel.from_config(cfg_path, secret=SECRET) as k:
        assert k.node == "gpu-0" and k.tier_order == ("dram", "disk")
        assert k.policies is not None and "chat" in k.policies.tenants()
        assert k.cost.profile.name == "replay-llama-8b-gpu"
        assert k.plan(make_request(range(64), tenant="chat")).action == PlanAction.RECOMPUTE


# ------------------------------------------------------------------------------------------ TTL and persistent tiers


class _RecordingStore:
    """A DRAM store that records the TTL it was given and lists its descriptors (a persistent tier's hook)."""

    def __init__(self, name="dram", capacity_bytes=1 << 20, seed=()):
        from nexuskv.builtins.dram import DramStore

        self.inner = DramStore(capacity_bytes, name)
        self.name, self.capacity_bytes, self.ttls = name, capacity_bytes, []
        for slot, payload, desc in seed:
            self.inner.put(slot, payload, desc)

    def put(self, slot, payload, descriptor, priority=0.0, ttl_s=None):
        self.ttls.append(ttl_s)
        return self.inner.put(slot, payload, descriptor, priority, ttl_s)

    def descriptors(self):
        return [(slot, self.inner.get(slot).descriptor) for slot in self.inner.slots()]

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __contains__(self, slot):
        return slot in self.inner


def _kernel_with_store(factory, **cfg):
    class Plugin:
        @hookimpl
        def nexuskv_register_tier_stores(self, register):
            register("recording", factory)

    pm = PluginManager({}, entry_points=False)
    pm.register(Plugin(), "recording")
    base = dict(node="n1", tiers={"dram": {"store": "recording"}})
    base.update(cfg)
    return Kernel(KernelConfig(**base), plugins=pm, secret=SECRET)


def test_place_rule_ttl_reaches_the_store():
    stores = []

    def factory(**kw):
        stores.append(_RecordingStore(**kw))
        return stores[-1]

    with _kernel_with_store(factory, policies=POLICIES) as k:
        commit_and_flush(k, make_request(range(64), tenant="chat"))
        assert stores[0].ttls and all(t == 3600.0 for t in stores[0].ttls)  # default.toml: hot-in-dram, 1h


def test_persistent_tier_is_reindexed_at_start():
    from nexuskv.plugins.interfaces import slot_of

    req = make_request(range(64))
    with policy_kernel() as k:  # produce real descriptors and payloads
        _, keys = commit_and_flush(k, req, size=64)
        seed = [(slot_of(key), k.tiers["dram"].get(slot_of(key)).payload, k.tiers["dram"].get(slot_of(key)).descriptor)
                for key in keys]  # fmt: skip
    with _kernel_with_store(lambda **kw: _RecordingStore(seed=seed, **kw)) as k2:
        plan_keys = k2.keys(req)
        assert plan_keys == keys and k2.match(req, keys).tokens() == 64
        assert bytes(k2.load(keys[2]).payload) == bytes([2]) * 64


# ------------------------------------------------------------------------------------------ hierarchy


def _tiered(**cfg):
    base = dict(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"},
                                  "disk": {"store": "dram", "capacity_bytes": "64MiB"}},
                prefetch_max_tasks=0)  # promotion on its own: no prefetch copying the same blocks  # fmt: skip
    base.update(cfg)
    return Kernel(KernelConfig(**base), secret=SECRET)


def _spill_to_disk(k, req, size=4096):
    """Commit `req`'s blocks straight into the slower tier."""
    keys = k.keys(req)
    for b in range(len(keys)):
        payload = bytes([b % 256]) * size
        k.put(k.describe(req, b, payload, tier="disk", keys=keys), payload)
    return keys


def test_a_hit_in_a_slower_tier_is_promoted_off_the_callers_thread():
    from nexuskv import slot_of

    with _tiered() as k:
        req = make_request(range(160))
        keys = _spill_to_disk(k, req)
        plan = k.plan(req, keys=keys)
        assert plan.action == PlanAction.MATERIALIZE and {s.tier for s in plan.spans} == {"disk"}
        assert k.materialize(plan, req, keys=keys).complete
        assert k.flush(5)
        assert all(slot_of(key) in k.tiers["dram"] for key in keys)
        promoted = k.tiers["dram"].get(slot_of(keys[3]))
        assert promoted.descriptor.placement.tier == "dram" and promoted.descriptor.usage.hits == 1
        assert bytes(promoted.payload) == bytes([3]) * 4096
        assert {s.tier for s in k.plan(req, keys=keys).spans} == {"dram"}  # the index knows both copies


def test_promotion_follows_the_place_rules_and_can_be_turned_off(tmp_path):
    from nexuskv import slot_of

    (tmp_path / "default.toml").write_text(
        'name = "default"\nmin_gain_ms = 0.0\n\n[[place]]\nname = "stay-on-disk"\nwhen = \'request.tenant == "cold"\'\n'
        'tier = "disk"\n\n[[place]]\nname = "hot"\ntier = "dram"\n')  # fmt: skip
    for tenant, flag, expect in (("cold", True, False), ("hot", False, False), ("hot", True, True)):
        with _tiered(policies=str(tmp_path), promote_on_hit=flag) as k:
            req = make_request(range(64), tenant=tenant)
            keys = _spill_to_disk(k, req)
            assert k.materialize(k.plan(req, keys=keys), req, keys=keys).complete
            assert k.flush(5)
            assert (slot_of(keys[0]) in k.tiers["dram"]) is expect, (tenant, flag)


def test_demotion_then_promotion_keeps_the_index_exact():
    with _tiered(tiers={"dram": {"store": "dram", "capacity_bytes": 3 * 4096},
                        "disk": {"store": "dram", "capacity_bytes": "64MiB"}}) as k:  # fmt: skip
        req = make_request(range(160))
        _, keys = commit_and_flush(k, req)  # 10 blocks, 3 fit in DRAM: the rest demoted to disk
        for key in keys:
            h = k.index.get(key)
            held = {loc.tier for loc, _ in h.locations}
            assert held == {t for t in ("dram", "disk") if slot_of(key) in k.tiers[t]}
        assert len([key for key in keys if slot_of(key) in k.tiers["disk"]]) >= 7


def test_tier_size_options_and_relative_paths_from_toml(tmp_path):
    seen = {}

    def factory(**kw):
        seen.update(kw)
        return _RecordingStore(name=kw["name"], capacity_bytes=kw["capacity_bytes"])

    (tmp_path / "k.toml").write_text('[tiers.dram]\nstore = "recording"\ncapacity_bytes = "2MiB"\n'
                                     'queue_bytes = "1KiB"\npath = "cache/disk"\n')  # fmt: skip
    cfg = KernelConfig.from_toml(tmp_path / "k.toml")
    assert cfg.tiers["dram"]["path"] == str(tmp_path / "cache/disk")

    class Plugin:
        @hookimpl
        def nexuskv_register_tier_stores(self, register):
            register("recording", lambda queue_bytes, path, **kw: factory(queue_bytes=queue_bytes, path=path, **kw))

    pm = PluginManager({}, entry_points=False)
    pm.register(Plugin(), "recording")
    with Kernel(cfg, plugins=pm, secret=SECRET):
        assert seen["capacity_bytes"] == 2 << 20 and seen["queue_bytes"] == 1024
    bad = KernelConfig(tiers={"dram": {"store": "recording", "queue_bytes": "lots"}})
    with pytest.raises(ConfigError, match=r"tiers.dram.queue_bytes"):
        Kernel(bad, plugins=pm, secret=SECRET)


def test_flush_waits_for_tiers_that_write_behind_and_reindex_is_public():
    flushed = []

    def factory(**kw):
        store = _RecordingStore(**kw)
        store.flush = lambda timeout=None: flushed.append(timeout) or True
        return store

    with _kernel_with_store(factory) as k:
        assert k.flush(2.0) and len(flushed) == 1 and 0 < flushed[0] <= 2.0
        assert k.reindex("dram") == 0
        with pytest.raises(ConfigError, match="not a persistent tier"):
            k.reindex("nope")


def test_a_kernel_that_fails_to_start_leaves_no_heartbeat_and_no_lease():
    import threading

    from nexuskv import ConfigError

    def beating() -> int:
        return sum(t.name == "nexuskv-heartbeat" and t.is_alive() for t in threading.enumerate())

    before = beating()
    with pytest.raises(ConfigError, match="transport_options"):
        Kernel(KernelConfig(node="n1", transport_options={"local": {"speed": 1}}), secret=SECRET)
    assert beating() == before  # a failed start renews no lease for ever (a ghost member of the cluster)


# ---------------------------------------------------------------------------------------------- policy reload


def tagged_policies(root, tag: str, broken: bool = False):
    """A default policy whose reuse evaluations leave `policy warning: <tag>` in a plan's reasons."""
    when = 'match.tokens > "x"' if broken else "match.tokens > 0"
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    tmp = root / ".default.toml"
    tmp.write_text(f'name = "default"\n[[reuse]]\nname = "{tag}"\neffect = "warn"\nwhen = \'{when}\'\n')
    os.replace(tmp, root / "default.toml")  # atomic, as a deploy tool saves
    return root


def tags_of(plan) -> set[str]:
    return {r.removeprefix("policy warning: ") for r in plan.reasons if r.startswith("policy warning: ")}


def test_reload_policies_swaps_revisions_and_refuses_broken_ones(tmp_path):
    root = tagged_policies(tmp_path / "p", "gen-a")
    cfg = KernelConfig(node="n1", policies=str(root), tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(64))
        commit_all(k, req)
        first = k.plan(req)
        assert tags_of(first) == {"gen-a"} and first.policy_revision == k.policy_revision
        tagged_policies(root, "gen-b")
        got = k.reload_policies()
        assert got.applied and got.previous == first.policy_revision
        second = k.plan(req)
        assert tags_of(second) == {"gen-b"} and second.policy_revision == got.revision != first.policy_revision
        tagged_policies(root, "gen-c", broken=True)
        refused = k.reload_policies()
        assert not refused.ok and refused.problems[0].rule == "gen-c" and refused.problems[0].line == 5
        third = k.plan(req)  # the serving revision keeps planning
        assert tags_of(third) == {"gen-b"} and third.policy_revision == got.revision
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as k, pytest.raises(ValueError, match="no policy directory"):
        k.reload_policies()


def test_a_plan_sees_one_revision_even_when_a_reload_lands_in_the_middle(tmp_path):
    root = tagged_policies(tmp_path / "p", "old")
    cfg = KernelConfig(node="n1", policies=str(root), tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(64))
        commit_all(k, req)
        old = k.policy_revision
        real = k.index.match

        def match_then_reload(*a, **kw):  # the reload lands after the plan took its revision, before it decides
            got = real(*a, **kw)
            tagged_policies(root, "new")
            assert k.reload_policies().applied
            return got

        k.index.match = match_then_reload
        plan = k.plan(req)
        assert plan.policy_revision == old and tags_of(plan) == {"old"}
        k.index.match = real
        after = k.plan(req)
        assert after.policy_revision == k.policy_revision != old and tags_of(after) == {"new"}


def test_plans_from_many_threads_across_reloads_each_see_one_revision(tmp_path):
    """8 threads plan while a thread reloads between two revisions 40 times; the reference: revision -> tag."""
    root = tagged_policies(tmp_path / "p", "gen-a")
    cfg = KernelConfig(node="n1", policies=str(root), deadline_ms=1000.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}})  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        reqs = [make_request(range(i, i + 64), request_id=f"r{i}") for i in range(8)]
        for req in reqs:
            commit_all(k, req)
        tag_of = {k.policy_revision: "gen-a"}
        stop = threading.Event()
        bad: list[str] = []

        def reloader():
            for n in range(40):
                tag = "gen-b" if n % 2 == 0 else "gen-a"
                tagged_policies(root, tag)
                tag_of[PolicyBundle.from_directory(root).revision] = tag  # known before any plan can name it
                assert k.reload_policies().applied
            stop.set()

        def planner(i: int) -> None:
            while not stop.is_set():
                plan = k.plan(reqs[i])
                want = tag_of.get(plan.policy_revision)
                if tags_of(plan) != {want} or any(r.startswith("fail-open") for r in plan.reasons):
                    bad.append(f"{plan.policy_revision}: {plan.reasons}")

        threads = [threading.Thread(target=planner, args=(i,)) for i in range(8)] + [threading.Thread(target=reloader)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert bad == [] and len(tag_of) == 2


def test_one_commit_is_admitted_and_placed_by_one_revision_even_when_a_reload_lands_midway(tmp_path):
    root = tmp_path / "p"
    (root / "tenants").mkdir(parents=True)

    def place_in(tier):
        (root / "default.toml").write_text(f'name = "default"\n[[place]]\nname = "to-{tier}"\nwhen = "true"\n'
                                           f'tier = "{tier}"\n')  # fmt: skip

    place_in("dram")
    cfg = KernelConfig(node="n1", policies=str(root), tiers={"dram": {"store": "dram", "capacity_bytes": "4MiB"},
                                                              "disk": {"store": "dram", "capacity_bytes": "4MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        real, stored = k.hierarchy.store, []

        def store(desc, *a, **kw):
            stored.append(desc.placement.tier)
            if len(stored) == 2:  # a deploy lands while the writer is in the middle of this commit
                place_in("disk")
                assert k.reload_policies().applied
            return real(desc, *a, **kw)

        k.hierarchy.store = store
        first = make_request(range(16 * 6))
        k.commit(first, [bytes(256)] * 6)
        assert k.flush(5)
        second = make_request(range(1000, 1000 + 16 * 3))
        k.commit(second, [bytes(256)] * 3)
        assert k.flush(5)
        assert stored == ["dram"] * 6 + ["disk"] * 3  # the commit made before the reload is placed by its revision
