"""Shared fixtures: small layouts, requests and a kernel with a fixed secret."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    ModelIdentity,
    Request,
    StateGroup,
    TokenizerIdentity,
)

# Shared, noisy machines: no per-example wall-clock deadline (a slow example is not a wrong one), fixed seeds.
settings.register_profile("nexuskv", deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("nexuskv")

SECRET = bytes(range(32))


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
