"""The etcd control plane against a real etcd on loopback: leases, fencing epochs, the watched view, faults."""

from __future__ import annotations

import threading
import time

import pytest

from nexuskv import ControlPlane
from nexuskv_etcd import EtcdControlPlane

WAIT_S = 10.0  # far above every TTL here: "eventually" without a wall-clock claim


def test_it_is_a_control_plane(planes):
    assert isinstance(planes(), ControlPlane)


def test_leases_live_by_keepalive_and_end_by_revoke_or_expiry(planes):
    p = planes()
    lease = p.grant(0.3)
    assert lease.ttl_s == 1.0  # whole seconds, rounded up
    assert p.alive(lease.lease_id) and p.keepalive(lease.lease_id)
    p.revoke(lease.lease_id)
    assert not p.alive(lease.lease_id) and not p.keepalive(lease.lease_id)
    p.revoke(lease.lease_id)  # revoking twice is no error
    short = p.grant(1)
    deadline = time.monotonic() + WAIT_S
    while p.alive(short.lease_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not p.alive(short.lease_id)
    with pytest.raises(ValueError, match="positive"):
        p.grant(0)


def test_fencing_epochs_only_grow(planes):
    a, b = planes(), planes()
    la, lb = a.grant(5), b.grant(5)
    ea = a.join("a", la.lease_id)
    eb = b.join("b", lb.lease_id)
    assert eb > ea and a.epoch() >= eb
    assert a.bump_epoch() > eb
    la2 = a.grant(5)
    assert a.join("a", la2.lease_id) > a.epoch() - 1 > ea  # a rejoin outranks every earlier token
    a.revoke(la.lease_id)
    with pytest.raises(LookupError, match="not alive"):
        a.join("a", la.lease_id)


def test_the_view_follows_joins_status_and_lease_ends(planes):
    a, b = planes(), planes()
    la, lb = a.grant(1), b.grant(30)
    ea, eb = a.join("a", la.lease_id), b.join("b", lb.lease_id)
    assert b.view.wait_for(lambda v: v.members() == {"a": ea, "b": eb}, WAIT_S)
    assert b.members() == {"a": ea, "b": eb}
    a.publish("a", la.lease_id, {"inflight": 3, "links": {"b": {"bandwidth": 1e9}}})
    assert b.view.wait_for(lambda v: v.status().get("a", {}).get("inflight") == 3, WAIT_S)
    assert b.view.status_of("a") == b.view.status()["a"] and b.view.status_of("nobody") is None
    t0 = time.monotonic()  # a stops renewing: its member and status keys go with its lease
    assert b.view.wait_for(lambda v: "a" not in v.members() and "a" not in v.status(), WAIT_S)
    assert b.view.status_of("a") is None
    assert time.monotonic() - t0 < WAIT_S and b.members() == {"b": eb}
    b.revoke(lb.lease_id)
    assert a.view.wait_for(lambda v: v.members() == {}, WAIT_S)


def test_members_without_a_view_read_etcd(planes):
    a, b = planes(), planes(watch=False)
    e = a.join("a", a.grant(30).lease_id)
    assert b.view is None and b.members() == {"a": e}


def test_etcd_down_keeps_the_last_view_and_fails_calls_fast(own_etcd_server, prefix):
    srv = own_etcd_server
    a = EtcdControlPlane(srv.endpoint, prefix=prefix, timeout_s=0.5)
    try:
        lease = a.grant(30)
        e1 = a.join("a", lease.lease_id)
        assert a.view.wait_for(lambda v: v.members() == {"a": e1} and v.live, WAIT_S)
        srv.kill()
        assert a.view.wait_for(lambda v: not v.live, WAIT_S)
        assert a.members() == {"a": e1}  # the last view, served without etcd
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - any transport error: the caller fails open
            a.keepalive(lease.lease_id)
        assert time.monotonic() - t0 < 5
        srv.start()  # same data: the lease survived the crash
        assert a.view.wait_for(lambda v: v.live, WAIT_S)
        e2 = a.join("a", a.grant(30).lease_id)
        assert e2 > e1 and a.view.wait_for(lambda v: v.members() == {"a": e2}, WAIT_S)
    finally:
        a.close()


def test_concurrent_joins_publishes_and_reads(planes):
    p = planes()
    lease = p.grant(30)
    epochs: dict[str, int] = {}
    errors: list[BaseException] = []

    def node(i: int) -> None:
        try:
            for j in range(5):
                epochs[f"n{i}"] = p.join(f"n{i}", lease.lease_id)
                p.publish(f"n{i}", lease.lease_id, {"j": j})
                p.members()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(epochs.values())) == 8  # every join got its own revision
    assert p.view.wait_for(lambda v: v.members() == epochs and all(s == {"j": 4} for s in v.status().values()),
                           WAIT_S)  # fmt: skip


def test_bad_endpoints_and_prefixes_are_refused():
    with pytest.raises(ValueError, match="host:port"):
        EtcdControlPlane("localhost", watch=False)
    with pytest.raises(ValueError, match="end with '/'"):
        EtcdControlPlane("127.0.0.1:2379", prefix="x", watch=False)


def test_a_frozen_etcd_is_noticed_and_a_join_is_seen_at_once(own_etcd_server, prefix):
    srv = own_etcd_server
    a = EtcdControlPlane(srv.endpoint, prefix=prefix, timeout_s=0.3, watch_idle_s=0.5)
    try:
        e = a.join("a", a.grant(30).lease_id)
        assert a.members() == {"a": e}  # its own join, before the watch brings it
        assert a.view.wait_for(lambda v: v.live, WAIT_S)
        srv.pause()  # SIGSTOP: connections hang instead of failing
        try:
            assert a.view.wait_for(lambda v: not v.live, WAIT_S)
            assert a.members() == {"a": e}
        finally:
            srv.resume()
        assert a.view.wait_for(lambda v: v.live, WAIT_S)
        t0 = time.monotonic()
        a.close()
        assert time.monotonic() - t0 < WAIT_S
    finally:
        a.close()
