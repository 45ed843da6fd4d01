"""Fixtures of the Redis tier's tests: a redis-server started on a free 127.0.0.1 port, stores, descriptors."""

from __future__ import annotations

import uuid

import pytest
from _tier_redis_helpers import NAME_KEY

from nexuskv_tier_redis import RedisStore
from nexuskv_tier_redis.testing import RedisServer, RedisServerMissing


def _server() -> RedisServer:
    try:
        return RedisServer()
    except RedisServerMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def redis_server():
    """One server for the session (tests keep apart by key prefix)."""
    srv = _server()
    yield srv
    srv.stop()


@pytest.fixture
def own_redis_server():
    """A server of this test alone (it may kill and restart it)."""
    srv = _server()
    yield srv
    srv.stop()


@pytest.fixture
def prefix():
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_store(redis_server, prefix):
    made: list[RedisStore] = []

    def make(name_key: bytes | None = NAME_KEY, **kw) -> RedisStore:
        kw.setdefault("url", redis_server.url)
        kw.setdefault("prefix", prefix)
        kw.setdefault("capacity_bytes", 64 << 20)
        s = RedisStore(**kw)
        made.append(s)
        if name_key is not None:  # as the kernel does, before anything else
            s.use_name_key(name_key)
        return s

    yield make
    for s in made:
        s.close()
    client = redis_server.client()
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def store(make_store):
    return make_store()


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
