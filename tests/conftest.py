"""Shared fixtures: small layouts, requests and a kernel with a fixed secret."""

from __future__ import annotations

import time

import pytest
import structlog
from hypothesis import HealthCheck, settings

from nexuskv import Kernel, KernelConfig, Layout, ModelIdentity, Request, StateGroup, TokenizerIdentity

# Shared, noisy machines: no per-example wall-clock deadline (a slow example is not a wrong one), fixed seeds.
settings.register_profile("nexuskv", deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("nexuskv")

SECRET = bytes(range(32))


def with_transport(mover, name: str = "tcp"):  # type: ignore[no-untyped-def]
    """A plugin manager (no entry points) whose transport `name` is the object `mover` (a test's peer transport)."""
    from nexuskv import hookimpl
    from nexuskv.plugins.manager import PluginManager

    class Plugin:
        @hookimpl
        def nexuskv_register_transports(self, register):  # type: ignore[no-untyped-def]
            register(name, lambda: mover)

    pm = PluginManager({}, entry_points=False)
    pm.register(Plugin(), "test-transport")
    return pm


def layout_of(*kinds: str, page_size: int = 16) -> Layout:
    return Layout(groups=[StateGroup(kind=k, layers=2, kv_heads=2, head_dim=8) for k in kinds], page_size=page_size)


def make_request(tokens, tenant: str = "acme", layout: Layout | None = None, **kw) -> Request:
    return Request(
        request_id=kw.pop("request_id", "r"),
        tenant=tenant,
        model=kw.pop("model", ModelIdentity(name="tiny", revision="1")),
        tokenizer=kw.pop("tokenizer", TokenizerIdentity(name="tok")),
        layout=layout or layout_of("dense"),
        token_ids=list(tokens),
        **kw,
    )


@pytest.fixture(autouse=True)
def _logging_restored():
    """A test that reconfigures logging (a CLI run with `--log-level error`) leaves the next test's as it was."""
    from nexuskv import logs

    saved, configured = structlog.get_config(), logs._configured
    yield
    structlog.configure(**saved)
    logs._configured = configured


@pytest.fixture(autouse=True)
def _isolated_secret(tmp_path, monkeypatch):
    """Never touch the real ~/.local/state/nexuskv/secret from tests."""
    monkeypatch.delenv("NEXUSKV_SECRET", raising=False)
    monkeypatch.setenv("NEXUSKV_SECRET_FILE", str(tmp_path / "secret"))
    monkeypatch.delenv("NEXUSKV_PLUGINS", raising=False)
    monkeypatch.delenv("NEXUSKV_DISABLE_PLUGINS", raising=False)
    # Tests assert decisions, not timing: a generous default deadline, so a loaded machine never turns an expected
    # plan into a fallback. The tests of the deadline set their own (`deadline_ms=...`).
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "10000")


@pytest.fixture
def kernel():
    k = Kernel(KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}}), secret=SECRET)
    yield k
    k.close()


def run_threads(worker, n: int, *, switch_interval: float | None = None) -> None:
    """Run `worker(i)` for i in range(n) on n threads started together; re-raise the first exception.

    A tiny `switch_interval` makes CPython switch threads as often as it can, so races show up in a short run.
    """
    import sys
    import threading

    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            worker(i)
        except BaseException as exc:
            errors.append(exc)

    old = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]


def check_concurrent_writers(idx, layout: Layout) -> None:
    """Six threads, each owning one location, insert and remove the same 40 keys while reading; each thread keeps
    a model of its location, and at the end the index must agree with every model (holdings and `keys_at`)."""
    import random

    from nexuskv import Location

    keys = [bytes([i]) * 16 for i in range(40)]
    locations = [Location(t, "n1", 1) for t in ("dram", "disk", "redis", "shm", "far", "archive")]
    models: list[dict[bytes, int]] = [{} for _ in locations]
    snaps: list[int] = []

    def worker(n: int) -> None:
        r, loc, model = random.Random(n), locations[n], models[n]
        for _ in range(3000):
            key, mask = r.choice(keys), r.choice((1, 2, 3))
            op = r.random()
            if op < 0.5:
                idx.insert(key, loc, mask)
                model[key] = model.get(key, 0) | mask
            elif op < 0.6:
                batch = r.sample(keys, 5)
                idx.insert_many(batch, loc, mask)
                for b in batch:
                    model[b] = model.get(b, 0) | mask
            elif op < 0.95:
                idx.remove(key, loc, mask)
                left = model.get(key, 0) & ~mask
                if left:
                    model[key] = left
                else:
                    model.pop(key, None)
            else:
                snaps.append(len(idx.snapshot()))
                idx.match(keys, layout)

    run_threads(worker, len(locations), switch_interval=1e-6)
    for key in keys:
        want = tuple(sorted((loc, m[key]) for loc, m in zip(locations, models, strict=True) if key in m))
        got = idx.get(key)
        assert (got.locations if got is not None else ()) == want, key
    for loc, model in zip(locations, models, strict=True):
        assert idx.keys_at(loc) == frozenset(model)
        assert idx.holdings().get(loc, 0) == len(model)
    assert snaps  # the readers ran alongside


def wait_for(cond, timeout: float = 10.0) -> bool:
    """Poll `cond()` until it holds or `timeout` seconds pass; its last value (tests assert on it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())
