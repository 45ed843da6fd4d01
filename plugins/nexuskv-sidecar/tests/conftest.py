"""Fixtures of the sidecar's tests: a real kernel served on a free 127.0.0.1 port."""

from __future__ import annotations

import pytest
from _sidecar_helpers import ROOT, SECRET, TOKENS

from nexuskv import Kernel, KernelConfig
from nexuskv_sidecar import Sidecar, SidecarConfig, digest


@pytest.fixture
def kernel():
    cfg = KernelConfig(node="n1", policies=str(ROOT / "policies"), deadline_ms=1000.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        yield k


@pytest.fixture(params=[1, 2], ids=["one-process", "two-workers"])
def sidecar(kernel, request):
    """The sidecar serving `kernel`: HTTP in this process, and (the same tests again) in two worker processes."""
    cfg = SidecarConfig(port=0, tokens={digest(t): tenant for tenant, t in TOKENS.items()}, max_body_bytes=1 << 20,
                        workers=request.param)  # fmt: skip
    with Sidecar(cfg, kernel=kernel) as sc:
        yield sc
