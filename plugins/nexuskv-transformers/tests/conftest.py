"""Shared fixtures of the reference-engine tests: models are cached per (kind, seed, dtype, adapter)."""

from __future__ import annotations

import functools

import pytest
import torch

from nexuskv import Kernel, KernelConfig
from nexuskv_transformers.connector import TransformersConnector
from nexuskv_transformers.models import build_model

SECRET = bytes(range(32))
torch.set_grad_enabled(False)


@functools.cache
def model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, adapter: str | None = None):
    return build_model(kind, seed=seed, dtype=dtype, adapter=adapter)


def tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


@pytest.fixture
def kernel():
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as k:
        yield k


def connector(kernel, ref, **kw) -> TransformersConnector:
    return TransformersConnector(kernel, ref, **kw)


@pytest.fixture(autouse=True)
def _generous_default_deadline(monkeypatch):
    """Tests assert decisions, not timing: a loaded machine must never turn an expected plan into a fallback."""
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "10000")
