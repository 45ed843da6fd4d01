"""Membership: the lease, the epoch as a fencing token, the heartbeat, and failing open when the plane is down."""

from __future__ import annotations

import time

from nexuskv.builtins.embedded import EmbeddedControlPlane
from nexuskv.cluster.membership import Membership
from tests.conftest import wait_for


class FlakyPlane(EmbeddedControlPlane):
    """The embedded plane with an outage switch (fault injection only)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("control plane: connection refused")

    def grant(self, ttl_s):
        self._check()
        return super().grant(ttl_s)

    def keepalive(self, lease_id):
        self._check()
        return super().keepalive(lease_id)

    def join(self, node, lease_id):
        self._check()
        return super().join(node, lease_id)


def test_joining_gives_a_lease_and_an_epoch_and_close_revokes_it():
    plane = EmbeddedControlPlane()
    m = Membership(plane, "n1", lease_ttl_s=5.0)
    try:
        assert m.ok() and m.epoch == 1 and m.lease is not None
        assert plane.members() == {"n1": 1}
    finally:
        m.close()
    assert not plane.alive(m.lease.lease_id) and plane.members() == {}


def test_a_plane_down_at_start_is_not_fatal_and_says_why():
    plane = FlakyPlane()
    plane.down = True
    m = Membership(plane, "n1", lease_ttl_s=0.3)
    try:
        assert not m.ok() and m.lease is None and m.epoch == 0
        assert "connection refused" in m.problem
        plane.down = False
        assert wait_for(m.ok, timeout=5.0)  # the heartbeat joins as soon as the plane answers
        assert m.epoch == 1 and m.lease is not None
    finally:
        m.close()


def test_a_lost_lease_rejoins_with_a_higher_fencing_epoch():
    plane = EmbeddedControlPlane()
    m = Membership(plane, "n1", lease_ttl_s=0.3)
    try:
        first, lease = m.epoch, m.lease
        plane.revoke(lease.lease_id)  # the lease is gone (expired, or the plane restarted)
        assert wait_for(lambda: m.lease is not None and m.lease.lease_id != lease.lease_id, timeout=5.0)
        assert m.epoch > first and m.ok()
        assert plane.members() == {"n1": m.epoch}
    finally:
        m.close()


def test_an_outage_later_turns_ok_off_until_the_plane_answers_again():
    plane = FlakyPlane()
    m = Membership(plane, "n1", lease_ttl_s=0.3)
    try:
        assert m.ok()
        plane.down = True
        assert wait_for(lambda: not m.ok(), timeout=5.0)
        assert "connection refused" in m.problem
        plane.down = False
        assert wait_for(m.ok, timeout=5.0)
    finally:
        m.close()


def test_a_lease_not_renewed_in_time_is_not_ok(monkeypatch):
    plane = EmbeddedControlPlane()
    m = Membership(plane, "n1", lease_ttl_s=60.0)
    try:
        m.stop()  # no heartbeat: the last renewal ages
        monkeypatch.setattr(m, "_seen", time.monotonic() - 61.0)
        assert not m.ok() and m.problem == "lease not renewed"
    finally:
        m.close()


def test_a_whole_ttl_without_renewal_rejoins_even_if_the_old_lease_still_renews(monkeypatch):
    plane = EmbeddedControlPlane()
    m = Membership(plane, "n1", lease_ttl_s=60.0)
    try:
        m.stop()
        first, lease = m.epoch, m.lease
        m._tick()  # renewed in time: same lease, same token
        assert (m.epoch, m.lease) == (first, lease)
        monkeypatch.setattr(m, "_seen", time.monotonic() - 61.0)  # the plane was away, or we were frozen
        assert plane.alive(lease.lease_id)
        m._tick()
        assert m.epoch > first and m.lease != lease and m.ok()
        assert not plane.alive(lease.lease_id)  # the old lease was given up
        assert plane.members() == {"n1": m.epoch}
    finally:
        m.close()


def test_a_blip_shorter_than_the_lease_keeps_the_token():
    plane = FlakyPlane()
    m = Membership(plane, "n1", lease_ttl_s=60.0)
    try:
        m.stop()
        first = m.epoch
        plane.down = True
        m._tick()
        assert not m.ok() and "connection refused" in m.problem
        plane.down = False
        m._tick()
        assert m.ok() and m.epoch == first
    finally:
        m.close()


def test_a_failed_publish_is_not_a_lost_lease():
    class PublishFails(EmbeddedControlPlane):
        def publish(self, *args):
            raise ValueError("status too large")

    m = Membership(PublishFails(), "n1", lease_ttl_s=60.0, status=lambda: {"x": 1})
    try:
        m.stop()
        m._tick()
        assert m.ok()
    finally:
        m.close()


def test_close_waits_for_a_beat_that_is_joining():
    class SlowGrant(EmbeddedControlPlane):
        slow = False

        def grant(self, ttl_s):
            if self.slow:
                time.sleep(0.3)
            return super().grant(ttl_s)

        def close(self):  # keep the members readable after the node left
            pass

    plane = SlowGrant()
    m = Membership(plane, "n1", lease_ttl_s=0.3)
    plane.slow = True
    plane.revoke(m.lease.lease_id)  # the next beat joins again, slowly
    time.sleep(0.15)
    m.close()
    assert plane.members() == {}  # no ghost registered after leaving


def test_a_renewal_that_answers_a_whole_ttl_late_rejoins():
    class HangingKeepalive(EmbeddedControlPlane):  # fault injection: the call hangs while the plane is away
        hang_s = 0.0

        def keepalive(self, lease_id):
            time.sleep(self.hang_s)
            return super().keepalive(lease_id)

    plane = HangingKeepalive()
    m = Membership(plane, "n1", lease_ttl_s=0.2)
    try:
        m.stop()
        first = m.epoch
        m._seen = time.monotonic()
        plane.hang_s = 0.3  # longer than the lease: the renewal cannot vouch for the time between
        m._tick()
        assert m.epoch > first and m.ok()
    finally:
        m.close()


def test_listeners_hear_every_renewal_and_rejoin_gives_a_new_epoch():
    plane = EmbeddedControlPlane()
    m = Membership(plane, "n1", lease_ttl_s=60.0)
    heard: list[int] = []
    try:
        m.stop()
        m.listen(lambda epoch, renewed_at: heard.append(epoch))
        assert heard == [m.epoch]  # told at once: the node is already in
        m.listen(lambda epoch, renewed_at: 1 / 0)  # a listener that raises is logged, never fatal
        m._tick()
        assert heard == [m.epoch, m.epoch]
        first = m.epoch
        m.rejoin()
        m._tick()
        assert m.epoch > first and heard[-1] == m.epoch and m.ok()
        m._tick()
        assert m.epoch == heard[-1]  # one rejoin per request, not on every beat
        assert m.peer_status("n2") is None  # the embedded plane has no cluster view
    finally:
        m.close()


def test_a_rejoin_asked_for_is_tried_again_until_a_join_succeeds():
    plane = FlakyPlane()
    m = Membership(plane, "n1", lease_ttl_s=60.0)
    try:
        m.stop()
        first = m.epoch
        m.rejoin()
        plane.down = True  # the join fails...
        m._tick()
        plane.down = False
        m._tick()  # ...so the next beat joins, rather than renewing the old lease
        assert m.epoch > first and m.ok()
    finally:
        m.close()
