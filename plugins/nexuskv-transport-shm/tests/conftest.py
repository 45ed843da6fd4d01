"""Fixtures of the shm tests: a fresh segment namespace per test, cleaned up afterwards."""

from __future__ import annotations

import os
import secrets

import pytest
from _shm_testing import SHM, ours


@pytest.fixture
def ns():
    name = f"t{os.getpid()}_{secrets.token_hex(4)}"
    yield name
    for n in ours(name):  # clean up after a failed test, then complain
        (SHM / n).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _generous_default_deadline(monkeypatch):
    """Tests assert decisions, not timing: a loaded machine must never turn an expected plan into a fallback."""
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "10000")
