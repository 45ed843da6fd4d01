"""Helpers of the Redis tier's tests: slots, descriptors, requests, polling."""

from __future__ import annotations

import os
import time

from nexuskv import (
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    Request,
    StateDescriptor,
    StateGroup,
    StateSeal,
    TokenizerIdentity,
    TokenSpan,
    checksum,
)

SECRET = bytes(32)
NAME_KEY = StateSeal(SECRET).name_key
"""The name key of `SECRET`: a store opened on its own with it names keys as the tests' kernels do."""


def keyed(store, key: bytes = NAME_KEY):  # type: ignore[no-untyped-def]
    """`store`, handed the name key as a kernel would hand it (before anything else)."""
    store.use_name_key(key)
    return store


def slot(i: int, group: int = 0) -> bytes:
    return i.to_bytes(16, "big") + bytes((group,))


def describe(s: bytes, payload: bytes, tenant: str = "acme", tier: str = "redis") -> StateDescriptor:
    return StateDescriptor(key=s[:-1].hex(), namespace=Namespace(tenant=tenant), model=ModelIdentity(name="tiny"),
                           tokenizer=TokenizerIdentity(name="tok"),
                           layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)]),
                           span=TokenSpan(0, 16), nbytes=len(payload), checksum=checksum(payload),
                           placement=Placement(tier, "n1"), group=s[-1])  # fmt: skip


def make_request(tokens, tenant: str = "acme") -> Request:
    return Request(request_id="r", tenant=tenant, model=ModelIdentity(name="tiny", revision="1"),
                   tokenizer=TokenizerIdentity(name="tok"),
                   layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16),
                   token_ids=list(tokens))  # fmt: skip


def eventually(fn, timeout_s: float = 10.0, every_s: float = 0.05):
    """Call `fn` until it returns something truthy (then return it), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(every_s)


def payload(n: int) -> bytes:
    return os.urandom(n)
