"""Test helpers for plugin authors: real descriptors, and the prefix property every tier store must keep.

`sample_state()` is a complete state descriptor dict to merge test inputs over; `chain` builds real descriptor
chains.

A tier store must never hold a paged block whose prefix it has dropped when it could hold the prefix instead,
whatever the priorities it is given. `prefix_problems(make_store)` drives a store the way the kernel's writer
does (a request's blocks in order; a chain stops at its first refused block) under equal, rising and falling
priorities and with two requests competing, and lists every violation (an empty list means the store is right).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from nexuskv.contracts import (
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    StateDescriptor,
    StateGroup,
    TokenizerIdentity,
    TokenSpan,
)
from nexuskv.contracts.checksums import checksum
from nexuskv.plugins.interfaces import slot_of
from nexuskv.policy.authoring.testing import sample_state

__all__ = ["Block", "PRIORITY_SCHEMES", "chain", "fill_in_order", "prefix_problems", "sample_state"]

Block = tuple[bytes, bytes, StateDescriptor]
"""(slot, payload, descriptor) of one block of a chain."""

PRIORITY_SCHEMES: dict[str, Callable[[int], float]] = {
    "equal (lru)": lambda b: 0.0,
    "deeper is worth more": lambda b: float(b),
    "deeper is worth less": lambda b: -float(b),
}


def chain(n: int, *, size: int = 1024, tenant: str = "acme", tier: str = "t", page: int = 16, seed: str = "",
          kind: str = "dense") -> list[Block]:  # fmt: skip
    """`n` chained blocks of one request: keys chain like the kernel's, descriptors name their parents."""
    layout = Layout(groups=[StateGroup(kind=kind, layers=1, kv_heads=1, head_dim=8)], page_size=page)
    out: list[Block] = []
    parent: bytes | None = None
    for b in range(n):
        key = hashlib.blake2b((parent or f"root:{tenant}:{seed}".encode()) + b.to_bytes(4, "little"),
                              digest_size=16).digest()  # fmt: skip
        payload = hashlib.shake_256(key).digest(size)
        start = 0 if layout.groups[0].kind.checkpointed else b * page
        desc = StateDescriptor(key=key.hex(), parent_key=parent.hex() if parent else None,
                               namespace=Namespace(tenant), model=ModelIdentity("tiny"),
                               tokenizer=TokenizerIdentity("tok"), layout=layout, span=TokenSpan(start, (b + 1) * page),
                               nbytes=size, checksum=checksum(payload), placement=Placement(tier, "local"))  # fmt: skip
        out.append((slot_of(key), payload, desc))
        parent = key
    return out


def fill_in_order(store: Any, blocks: list[Block], priority: Callable[[int], float] = lambda b: 0.0) -> int:
    """Put blocks in order, as the kernel's writer does (a chain stops at its first refused block): how many stored."""
    for b, (slot, payload, desc) in enumerate(blocks):
        if not store.put(slot, payload, desc, priority(b)):
            return b
    return len(blocks)


def _held_prefix_problems(store: Any, blocks: list[Block], label: str) -> list[str]:
    held = [slot in store for slot, _, _ in blocks]
    return [f"{label}: holds block {b} but dropped block {b - 1}" for b in range(1, len(held))
            if held[b] and not held[b - 1]]  # fmt: skip


def prefix_problems(make_store: Callable[[int], Any], *, size: int = 1024, flush: bool = False) -> list[str]:
    """Every way `make_store(capacity_bytes)` breaks the prefix property (empty: none).

    Stores are made with room for about 16 blocks of `size` bytes and closed afterwards; `flush` waits for
    stores that write behind between steps.
    """
    problems: list[str] = []
    for name, prio in PRIORITY_SCHEMES.items():
        store = make_store(16 * size)
        try:
            long = chain(62, size=size, seed=name)
            stored = fill_in_order(store, long, prio)
            if flush:
                store.flush()
            if stored < 4:
                problems.append(f"{name}: only {stored} of 62 blocks stored in a store with room for about 16")
            problems += _held_prefix_problems(store, long, f"{name}, one long request")
            other = chain(24, size=size, seed=name + "/2", tenant="globex")
            for _, (slot, _p, _d) in zip(range(4), long, strict=False):
                store.get(slot)  # the first request's prefix is read again: recently used
            fill_in_order(store, other, prio)
            if flush:
                store.flush()
            problems += _held_prefix_problems(store, long, f"{name}, first of two requests")
            problems += _held_prefix_problems(store, other, f"{name}, second of two requests")
        finally:
            store.close()
    return problems
