"""Fixtures of the Mooncake tier's tests: a real mooncake_master on free 127.0.0.1 ports, stores, a raw client."""

from __future__ import annotations

import uuid

import pytest
from _tier_mooncake_helpers import NAME_KEY

from nexuskv_tier_mooncake.testing import MooncakeMaster

LEASE_MS = 400  # the session master's read lease: short, so removals blocked by a lease go through soon


@pytest.fixture(scope="session")
def mooncake_master():
    """One master for the session (tests keep apart by key prefix)."""
    with MooncakeMaster(lease_ttl_ms=LEASE_MS) as m:
        yield m


@pytest.fixture
def own_mooncake_master():
    """A master of this test alone (it may kill and restart it)."""
    with MooncakeMaster(lease_ttl_ms=LEASE_MS) as m:
        yield m


@pytest.fixture
def prefix():
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_store(mooncake_master, prefix):
    from nexuskv_tier_mooncake import MooncakeStore

    made: list[MooncakeStore] = []

    def make(name_key: bytes | None = NAME_KEY, **kw) -> MooncakeStore:
        kw.setdefault("master", mooncake_master.address)
        kw.setdefault("prefix", prefix)
        kw.setdefault("capacity_bytes", 64 << 20)
        kw.setdefault("local_buffer_bytes", 64 << 20)
        kw.setdefault("lease_ttl_s", LEASE_MS / 1e3)
        s = MooncakeStore(**kw)
        made.append(s)
        if name_key is not None:  # as the kernel does, before anything else
            s.use_name_key(name_key)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def store(make_store):
    return make_store()


@pytest.fixture
def raw_client(mooncake_master):
    """A plain Mooncake client of the session master (contributes no memory): to look behind the store's back."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 32 << 20, "tcp", "", mooncake_master.address) == 0
    yield client
    client.close()


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    """Never touch the real secret or plugin settings from tests."""
    monkeypatch.delenv("NEXUSKV_SECRET", raising=False)
    monkeypatch.setenv("NEXUSKV_SECRET_FILE", str(tmp_path / "secret"))
    monkeypatch.delenv("NEXUSKV_PLUGINS", raising=False)
    monkeypatch.delenv("NEXUSKV_DISABLE_PLUGINS", raising=False)


@pytest.fixture(autouse=True)
def _generous_default_deadline(monkeypatch):
    """Tests assert decisions, not timing: a loaded machine must never turn an expected plan into a fallback."""
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "10000")
