"""Fixtures of the tcp tests: a DRAM tier served on 127.0.0.1, and a client transport, closed afterwards."""

from __future__ import annotations

import pytest
from _tcp_peer import TIER, tcp

from nexuskv.builtins.dram import DramStore


@pytest.fixture
def store():
    s = DramStore(1 << 28, name=TIER)
    yield s
    s.close()


@pytest.fixture
def server(store):
    t = tcp()
    t.serve({TIER: store})
    yield t
    t.close()


@pytest.fixture
def client():
    t = tcp(timeout_s=10.0)  # generous: a loaded machine must not turn a correct answer into a timeout
    yield t
    t.close()


@pytest.fixture(autouse=True)
def _generous_default_deadline(monkeypatch):
    """Tests assert behaviour, not timing: a loaded machine must never turn an expected plan into a fallback."""
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "10000")
