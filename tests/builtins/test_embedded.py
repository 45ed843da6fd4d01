import pytest

from nexuskv import ControlPlane
from nexuskv.builtins.embedded import EmbeddedControlPlane


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_is_a_control_plane():
    assert isinstance(EmbeddedControlPlane(), ControlPlane)


def test_epochs_are_monotonic_and_joins_fence():
    cp = EmbeddedControlPlane()
    lease = cp.grant(5)
    e1 = cp.join("a", lease.lease_id)
    e2 = cp.join("b", lease.lease_id)
    e3 = cp.join("a", lease.lease_id)  # rejoin: a fencing token above every earlier one
    assert e1 < e2 < e3 == cp.epoch()
    assert cp.bump_epoch() == e3 + 1
    assert cp.members() == {"a": e3, "b": e2}


def test_leases_expire_and_take_members_with_them():
    clock = Clock()
    cp = EmbeddedControlPlane(clock=clock)
    lease = cp.grant(2.0)
    cp.join("a", lease.lease_id)
    clock.t += 1.5
    assert cp.keepalive(lease.lease_id)
    clock.t += 1.5
    assert cp.alive(lease.lease_id) and "a" in cp.members()
    clock.t += 2.0
    assert not cp.alive(lease.lease_id)
    assert cp.members() == {}
    assert not cp.keepalive(lease.lease_id)
    with pytest.raises(LookupError):
        cp.join("a", lease.lease_id)


def test_revoke_ends_membership_now():
    cp = EmbeddedControlPlane()
    l1, l2 = cp.grant(10), cp.grant(10)
    cp.join("a", l1.lease_id)
    cp.join("b", l2.lease_id)
    cp.revoke(l1.lease_id)
    assert list(cp.members()) == ["b"]


def test_bad_ttl():
    with pytest.raises(ValueError):
        EmbeddedControlPlane().grant(0)
