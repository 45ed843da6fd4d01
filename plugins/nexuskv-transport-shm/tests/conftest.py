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
