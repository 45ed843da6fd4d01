"""Mooncake tier get / put against Mooncake's own `get_into` / `put_from` of the same bytes, timed interleaved.

`run()` starts its own mooncake_master (127.0.0.1, free ports), measures on one client (the tier's own, so both
sides read the same segment through the same transfer engine), stops it and returns one dict per payload size;
`bench/mooncake.py` turns them into a RESULT line.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from _common import interleaved, named, tier_descriptor
from nexuskv import StateDescriptor
from nexuskv_tier_mooncake import MooncakeStore
from nexuskv_tier_mooncake.testing import MooncakeMaster

__all__ = ["run"]


def run(sizes: Iterable[int] = (1 << 20, 16 << 20), rounds: int = 41) -> list[dict[str, Any]]:
    """Medians (seconds) of the tier's get / put and of Mooncake's get_into / put_from, per payload size.

    The baseline reads into (and writes from) a buffer of the payload's size registered once with the same client;
    the tier writes header + payload through its registered staging buffer and reads with `get_buffer` into the
    client's registered local buffer, handing out a view of it.
    """
    sizes = tuple(sizes)
    largest = max(sizes)
    out: list[dict[str, Any]] = []
    with MooncakeMaster() as master:
        # The tier keeps at most 4 payloads (it evicts its own); the segment also holds the baseline's objects.
        store = named(MooncakeStore(master=master.address, prefix="bench" + uuid.uuid4().hex[:8],
                                    capacity_bytes=4 * largest + (1 << 20), segment_bytes=12 * largest,
                                    local_buffer_bytes=4 * largest))  # fmt: skip
        client = store.client
        region = mmap.mmap(-1, largest)
        anchor = ctypes.c_char.from_buffer(region)
        ptr = ctypes.addressof(anchor)
        assert client.register_buffer(ptr, largest) == 0
        try:
            for size in sizes:
                data = os.urandom(size)
                region[:size] = data
                key = os.urandom(16)
                slot = key + b"\x00"
                desc = tier_descriptor(key, data, "mooncake")
                native = f"native/{key.hex()}"
                # the slot the gets read ranks above the puts' objects: their evictions take earlier puts (never
                # read, so never under a read lease, which would make the tier refuse the put)
                assert store.put(slot, data, desc, priority=1.0) and client.put_from(native, ptr, size) == 0

                def get(slot: bytes = slot, size: int = size) -> None:
                    got = store.get(slot)
                    assert got is not None and len(got.payload) == size

                def base_get(k: str = native, size: int = size) -> None:
                    assert client.get_into(k, ptr, size) == size

                fresh = iter(range(1, 1 << 30))  # every put a new object (a read's lease would block overwrites)

                def put(data: bytes = data, desc: StateDescriptor = desc, fresh: Iterator[int] = fresh) -> None:
                    assert store.put(next(fresh).to_bytes(17, "big"), data, desc)  # evicts the oldest when full

                def base_put(k: str = native + "/put", size: int = size) -> None:
                    client.remove(k, True)
                    assert client.put_from(k, ptr, size) == 0

                gets = interleaved({"get_s": get, "base_get_s": base_get}, rounds, inner=1)
                puts = interleaved({"put_s": put, "base_put_s": base_put}, max(5, rounds // 4), inner=1)
                out.append({"tier": "mooncake", "size": size, **gets, **puts})
                for s in list(store.slots()):
                    store.delete(s)
                client.remove(native, True)
                client.remove(native + "/put", True)
        finally:
            client.unregister_buffer(ptr)
            store.close()
            del anchor
            region.close()
    return out
