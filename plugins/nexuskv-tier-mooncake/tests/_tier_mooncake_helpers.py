"""Helpers of the Mooncake tier's tests: slots, descriptors, requests, kernels from a config file, polling."""

from __future__ import annotations

import json
import os
import time

import attrs
import pytest

from nexuskv import (
    Kernel,
    Layout,
    LinkCost,
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
    default_profile,
    to_dict,
)
from nexuskv_tier_mooncake.testing import usable

WHY = usable()
if WHY:  # the wheel cannot run here (not Linux x86_64, libibverbs1 missing): every test module says exactly why
    pytest.skip(f"Mooncake unavailable: {WHY}", allow_module_level=True)

HANG_S = 10.0  # "did not hang": far above every timeout configured here, far below Mooncake's own retry loops

SECRET_HEX = "ab" * 16  # the kernels' secret (`kernel_from_config`)
NAME_KEY = StateSeal(bytes.fromhex(SECRET_HEX)).name_key
"""The name key of the kernels' secret: a store opened on its own with it names objects as those kernels do."""


def keyed(store, key: bytes = NAME_KEY):  # type: ignore[no-untyped-def]
    """`store`, handed the name key as a kernel would hand it (before anything else)."""
    store.use_name_key(key)
    return store


def slot(i: int, group: int = 0) -> bytes:
    return i.to_bytes(16, "big") + bytes((group,))


def describe(s: bytes, payload: bytes, tenant: str = "acme", tier: str = "mc", node: str = "n1") -> StateDescriptor:
    return StateDescriptor(key=s[:-1].hex(), namespace=Namespace(tenant=tenant), model=ModelIdentity(name="tiny"),
                           tokenizer=TokenizerIdentity(name="tok"),
                           layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)]),
                           span=TokenSpan(0, 16), nbytes=len(payload), checksum=checksum(payload),
                           placement=Placement(tier, node), group=s[-1])  # fmt: skip


def make_request(tokens, tenant: str = "acme") -> Request:
    return Request(request_id="r", tenant=tenant, model=ModelIdentity(name="tiny", revision="1"),
                   tokenizer=TokenizerIdentity(name="tok"),
                   layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16),
                   token_ids=list(tokens))  # fmt: skip


def kernel_from_config(tmp_path, master: str, prefix: str, **tier: object) -> Kernel:
    """A kernel built from a TOML file: one `mooncake` tier `mc`, with a cost in the profile (else never planned)."""
    prof = default_profile()
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(to_dict(attrs.evolve(prof, tiers={**prof.tiers, "mc": LinkCost(1e9, 0.3)}))))
    opts = {"capacity_bytes": "64MiB", "local_buffer_bytes": "64MiB", "lease_ttl_s": 0.4, **tier}
    lines = [f"{k} = {json.dumps(v)}" for k, v in opts.items()]
    cfg = tmp_path / "kernel.toml"
    # No prefetch and no promotion on hit: either would copy blocks elsewhere, and plans would stop asking mooncake.
    cfg.write_text(f'node = "n1"\nsecret = "{SECRET_HEX}"\nprofile = "profile.json"\nload_timeout_ms = 3000\n'
                   "breaker_threshold = 2\nbreaker_cooldown_s = 0.5\nprefetch_max_tasks = 0\npromote_on_hit = false\n"
                   f'[tiers.mc]\nstore = "mooncake"\nmaster = "{master}"\nprefix = "{prefix}"\n'
                   + "\n".join(lines) + "\n")  # fmt: skip
    return Kernel.from_config(cfg)


def eventually(fn, timeout_s: float = 20.0, every_s: float = 0.05):
    """Call `fn` until it returns something truthy (then return it), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(every_s)


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def payload(n: int) -> bytes:
    return os.urandom(n)
