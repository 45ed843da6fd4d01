"""Fixtures of the disk tier tests: descriptors, payloads and stores on temporary directories."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from nexuskv import (
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    StateDescriptor,
    StateGroup,
    StateSeal,
    TokenizerIdentity,
    TokenSpan,
    checksum,
    slot_of,
)
from nexuskv_tier_disk import DiskStore

SECRET = bytes(32)
NAME_KEY = StateSeal(SECRET).name_key
"""The name key of the secret the tests' kernels run under: a store opened on its own with it finds their files."""


def make_desc(key: bytes, payload: bytes, tier: str = "disk", **kw: object) -> StateDescriptor:
    return StateDescriptor(
        key=key.hex(),
        namespace=Namespace("acme"),
        model=ModelIdentity("tiny-llama"),
        tokenizer=TokenizerIdentity("tok"),
        layout=Layout((StateGroup("dense", 2, 2, 8),)),
        span=TokenSpan(0, 16),
        nbytes=len(payload),
        checksum=checksum(payload),
        placement=Placement(tier, "local"),
        **kw,
    )


def kv_payload(seed: int, nbytes: int = 4096) -> bytes:
    """fp16-like KV bytes (normal values cast to float16), deterministic in `seed`."""
    return np.random.default_rng(seed).standard_normal(nbytes // 2).astype(np.float16).tobytes()


def key_of(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


class Item:
    """A slot, payload and descriptor made from a number."""

    def __init__(self, i: int, nbytes: int = 4096, **kw: object) -> None:
        self.key = key_of(i)
        self.slot = slot_of(self.key)
        self.payload = kv_payload(i, nbytes)
        self.desc = make_desc(self.key, self.payload, **kw)


@pytest.fixture
def item() -> Callable[..., Item]:
    return Item


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., DiskStore]]:
    """Open stores on tmp_path (closed at the end); `events` of each collect its eviction callbacks."""
    stores: list[DiskStore] = []

    def make(capacity_bytes: int = 64 << 20, name_key: bytes | None = NAME_KEY, **kw: object) -> DiskStore:
        kw.setdefault("path", str(tmp_path))
        kw.setdefault("fsync", False)
        store = DiskStore(capacity_bytes, **kw)  # type: ignore[arg-type]
        stores.append(store)
        if name_key is not None:  # as the kernel does, before anything else
            store.use_name_key(name_key)
        store.events = []  # type: ignore[attr-defined]
        store.set_eviction_callback(lambda s, d, p: store.events.append((s, d, None if p is None else bytes(p))))  # type: ignore[attr-defined]
        return store

    yield make
    for s in stores:
        s.close()


@pytest.fixture(autouse=True)
def _generous_default_deadline(monkeypatch):
    """Tests assert decisions, not timing: a loaded machine must never turn an expected plan into a fallback."""
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "10000")
