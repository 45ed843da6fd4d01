"""Fixtures of the etcd control plane's tests: an etcd started on free 127.0.0.1 ports, key prefixes, planes."""

from __future__ import annotations

import uuid

import pytest

from nexuskv_etcd import EtcdControlPlane
from nexuskv_etcd.testing import EtcdServer, EtcdServerMissing


def _server() -> EtcdServer:
    try:
        return EtcdServer()
    except EtcdServerMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def etcd_server():
    """One etcd for the session (tests keep apart by key prefix)."""
    srv = _server()
    yield srv
    srv.stop()


@pytest.fixture
def own_etcd_server():
    """An etcd of this test alone (it may kill, pause and restart it)."""
    srv = _server()
    yield srv
    srv.stop()


@pytest.fixture
def prefix():
    return f"t{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def planes(etcd_server, prefix):
    """Make planes on the session etcd under this test's prefix; all are closed afterwards."""
    made: list[EtcdControlPlane] = []

    def make(**kw) -> EtcdControlPlane:
        plane = EtcdControlPlane(etcd_server.endpoint, prefix=prefix, **kw)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        plane.close()
