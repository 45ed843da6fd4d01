"""A kernel whose control plane is etcd: it joins, fails open while etcd is away, and rejoins with a new epoch."""

from __future__ import annotations

import time

import pytest

from nexuskv import Kernel, KernelConfig, Layout, ModelIdentity, PlanAction, Request, StateGroup, TokenizerIdentity
from nexuskv_etcd import EtcdControlPlane
from nexuskv_etcd.plugin import nexuskv_control_plane

SECRET = bytes(32)
WAIT_S = 15.0
HANG_S = 5.0  # "did not hang": far above the 0.3 s request timeout, far below a hung socket


def wait_for(cond, timeout=WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def request() -> Request:
    return Request(request_id="r", tenant="acme", model=ModelIdentity(name="tiny", revision="1"),
                   tokenizer=TokenizerIdentity(name="tok"),
                   layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16),
                   token_ids=list(range(64)))  # fmt: skip


def kernel_on(endpoint: str, prefix: str, node: str = "n1") -> Kernel:
    cfg = KernelConfig(node=node, lease_ttl_s=1.0, tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}},
                       control_plane={"name": "etcd", "endpoint": endpoint, "prefix": prefix, "timeout_s": 0.3})
    return Kernel(cfg, secret=SECRET)


def test_two_kernels_see_each_other(etcd_server, prefix):
    with kernel_on(etcd_server.endpoint, prefix, "n1") as a, kernel_on(etcd_server.endpoint, prefix, "n2") as b:
        assert isinstance(a.control, EtcdControlPlane) and a.control_ok() and b.control_ok()
        assert a.epoch != b.epoch and min(a.epoch, b.epoch) > 0
        assert a.control.view.wait_for(lambda v: v.members() == {"n1": a.epoch, "n2": b.epoch}, WAIT_S)
    # closing revokes the leases: the members leave at once, not after a TTL
    watcher = EtcdControlPlane(etcd_server.endpoint, prefix=prefix)
    try:
        assert watcher.view.wait_for(lambda v: v.synced and v.members() == {}, WAIT_S)
    finally:
        watcher.close()


def test_etcd_down_means_recompute_never_a_hang_then_a_new_epoch(own_etcd_server, prefix):
    srv = own_etcd_server
    req = request()
    with kernel_on(srv.endpoint, prefix) as k:
        first = k.epoch
        assert k.control_ok() and not any("control plane" in r for r in k.plan(req).reasons)
        srv.kill()
        assert wait_for(lambda: not k.control_ok())
        t0 = time.monotonic()
        plan = k.plan(req)
        assert time.monotonic() - t0 < HANG_S
        assert plan.action == PlanAction.RECOMPUTE and any("control plane unavailable" in r for r in plan.reasons)
        time.sleep(k.membership.lease_ttl_s + 0.2)  # down for more than a lease: the old token is not trusted
        srv.start()  # etcd keeps the old lease across its restart; the node still takes a new token
        assert wait_for(lambda: k.control_ok() and k.epoch > first)
        assert k.control.view.wait_for(lambda v: v.members().get("n1") == k.epoch, WAIT_S)
        assert not any("control plane" in r for r in k.plan(req).reasons)


def test_unknown_settings_are_refused_and_said(etcd_server):
    settings = {"name": "etcd", "endpoint": etcd_server.endpoint, "prefx": "x/"}
    with pytest.raises(ValueError, match=r"unknown keys \['prefx'\] \(known: endpoint, prefix, timeout_s\)"):
        nexuskv_control_plane(settings)
    with pytest.raises(Exception, match="no plugin answered nexuskv_control_plane"):
        Kernel(KernelConfig(node="n1", control_plane=settings), secret=SECRET)
    assert nexuskv_control_plane({"name": "embedded"}) is None


def test_a_kernel_publishes_what_it_measures(etcd_server, prefix):
    cfg = KernelConfig(node="n1", lease_ttl_s=1.0, tiers={"dram": {"store": "dram", "capacity_bytes": "8MiB"}},
                       links={"measure": True, "min_samples": 1}, promote_on_hit=False, prefetch_max_tasks=0,
                       control_plane={"name": "etcd", "endpoint": etcd_server.endpoint, "prefix": prefix})  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        req = request()
        keys = k.keys(req)
        for b in range(len(keys)):
            data = bytes([b]) * 4096
            assert k.put(k.describe(req, b, data, tier="dram", keys=keys), data)
        plan = k.plan(req)
        assert plan.action == PlanAction.MATERIALIZE and k.materialize(plan, req).complete
        other = EtcdControlPlane(etcd_server.endpoint, prefix=prefix)
        try:
            seen = other.view.wait_for(lambda v: v.status().get("n1", {}).get("links", {}).get("dram"), WAIT_S)
            status = other.view.status()["n1"]
            assert seen and status["links"]["dram"]["samples"] >= 1
            assert status["backpressure"]["writer_fill"] >= 0 and status["breakers"] == {}  # backpressure, health
            assert "policy_revision" not in status  # this node has no policies
        finally:
            other.close()
