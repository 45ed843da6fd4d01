"""Bench helper for the shm tier: put, and read through the shm transport from a second process, vs memcpy.

`run()` publishes each payload from this process and times `put` against a memcpy of the same bytes; a reader
process then times `ShmTransport.fetch` (map + zero-copy view, lease and header checked) against a memcpy
there. Interleaved medians, in seconds. Imported by `bench/tiers.py`; run directly for a JSON dump.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from typing import Any

try:
    from _common import interleaved, named, quick
except ImportError:  # imported as bench._tier_shm
    from bench._common import interleaved, named, quick

__all__ = ["run"]

RESULTS = ()  # run on its own, it prints one run's rows as JSON (`bench/tiers.py` turns them into RESULT lines)


def _descriptor(slot: bytes, payload: bytes) -> Any:
    from nexuskv import (
        Layout,
        ModelIdentity,
        Namespace,
        Placement,
        StateDescriptor,
        StateGroup,
        TokenizerIdentity,
        TokenSpan,  # fmt: skip
        checksum,
    )

    return StateDescriptor(
        key=slot[:-1].hex(), namespace=Namespace("bench"), model=ModelIdentity(name="m"),
        tokenizer=TokenizerIdentity(name="t"), layout=Layout(groups=[StateGroup(kind="dense", layers=1)]),
        span=TokenSpan(0, 16), nbytes=len(payload), checksum=checksum(payload), placement=Placement("shm", "bench"),
    )  # fmt: skip


def _reader(ns: str, slot_hex: str, repeats: int, secret: bytes) -> dict[str, float]:
    """In the reader process: fetch through the transport vs memcpy of the same bytes (interleaved medians)."""
    from nexuskv_transport_shm import ShmStore, ShmTransport

    store = named(ShmStore(1 << 20, namespace=ns, lease_ttl_s=30.0, reap_interval_s=3600.0), secret)
    transport = ShmTransport()
    slot = bytes.fromhex(slot_hex)
    first = transport.fetch(store, slot)
    if first is None:
        raise RuntimeError("reader: segment not found")
    private = bytes(first.payload)  # the same bytes in this process's own memory

    def get() -> None:
        got = transport.fetch(store, slot)
        assert got is not None

    dst = bytearray(len(private))  # the consumer's own buffer, its pages mapped before anything is timed
    dst[:] = private

    def get_touch() -> None:  # what a consumer sees: a fetch through the transport, every byte read into dst
        got = transport.fetch(store, slot)
        assert got is not None
        dst[:] = got.payload

    def copy_into() -> None:  # the baseline: the same bytes, already in this process, memcpy'd into dst
        dst[:] = private

    t = interleaved({"get": get, "base_get": lambda: bytearray(private), "get_touch": get_touch,
                     "base_touch": copy_into}, rounds=repeats, inner=1)  # fmt: skip
    store.close()
    return {"get_s": t["get"], "base_get_s": t["base_get"], "get_touch_s": t["get_touch"],
            "base_touch_s": t["base_touch"]}


def run(sizes: tuple[int, ...] = (1 << 20, 16 << 20), repeats: int = 9) -> list[dict[str, Any]]:
    """One row per size: tier, size, put_s / base_put_s (here) and get_s / base_get_s (a second process).

    `get_s` is a fetch through `ShmTransport` (lease check, header check, mapping reused, zero-copy view);
    `get_touch_s` a fetch whose every byte is then copied into the reader's own buffer, against `base_touch_s`,
    a memcpy of the same bytes into that buffer; `base_*_s` otherwise a memcpy (`bytearray(...)`) of the same
    bytes in the same process. Medians in seconds.
    """
    from nexuskv_transport_shm import ShmStore

    ns = f"bench{os.getpid()}_{secrets.token_hex(3)}"
    secret = os.urandom(32)  # the reader names segments with the same name key
    store = named(ShmStore(4 * max(sizes), namespace=ns, lease_ttl_s=30.0, reap_interval_s=3600.0), secret)
    rows = []
    try:
        for i, size in enumerate(sizes):
            payload = os.urandom(size)
            slot = i.to_bytes(16, "big") + b"\0"
            desc = _descriptor(slot, payload)
            t = interleaved({"put": lambda s=slot, p=payload, d=desc: store.put(s, p, d),
                             "base_put": lambda p=payload: bytearray(p)}, rounds=repeats, inner=1)  # fmt: skip
            if not store.put(slot, payload, desc):
                raise RuntimeError("put refused")
            out = subprocess.run([sys.executable, __file__, "--reader", ns, slot.hex(), str(repeats), secret.hex()],
                                 capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
            if out.returncode != 0:
                raise RuntimeError(f"reader process failed: {out.stderr[-2000:]}")
            got = json.loads(out.stdout.splitlines()[-1])
            rows.append({"tier": "shm", "size": size, "put_s": t["put"], "get_s": got["get_s"],
                         "base_put_s": t["base_put"], "base_get_s": got["base_get_s"],
                         "get_touch_s": got["get_touch_s"], "base_touch_s": got["base_touch_s"],
                         "reader": "second process"})  # fmt: skip
            store.delete(slot)
    finally:
        store.close()
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--reader":
        from nexuskv import configure_logging

        configure_logging(stream=sys.stderr)
        print(json.dumps(_reader(sys.argv[2], sys.argv[3], int(sys.argv[4]), bytes.fromhex(sys.argv[5]))))
    else:
        from nexuskv import configure_logging

        configure_logging(stream=sys.stderr)
        for row in run(**quick({}, {"sizes": (64 << 10,), "repeats": 2})):
            print(json.dumps(row))
