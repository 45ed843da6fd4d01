"""Disk tier figures: put / get time of `nexuskv-tier-disk` against raw file I/O of the same bytes, and codec stats.

Both sides run in one process, interleaved (the order alternates every repeat), on files in the same directory:
- put: `DiskStore.put` + `flush()` (encode, header, temporary file, write, fsync, rename, directory fsync) against
  `open / write / fsync / close` of the same bytes plus a directory fsync (the same fsync policy; `fsync=False`
  drops both fsyncs on both sides);
- get: `DiskStore.get` (read on the store's reader pool, xxh3-128 verify, decode) against `open / read / close`.
Files were just written, so both sides read from the page cache. Payloads are fp16-like KV: normal values cast to
float16 (a stand-in for real KV). `python bench/_tier_disk.py` prints one run.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from _common import named, quick
from nexuskv import (
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    StateDescriptor,
    StateGroup,
    TokenizerIdentity,
    TokenSpan,
    checksum,
    slot_of,
)
from nexuskv_tier_disk import DiskStore, codec

__all__ = ["codec_stats", "kv_payload", "run"]

RESULTS = ()  # run on its own, it prints one run's figures (`bench/tiers.py` turns them into RESULT lines)


def kv_payload(nbytes: int, dtype: str = "float16", seed: int = 0) -> bytes:
    """`nbytes` of fp16 / fp32 values drawn from a standard normal distribution (a stand-in for KV)."""
    np_dtype = {"float16": np.float16, "float32": np.float32}[dtype]
    n = nbytes // np.dtype(np_dtype).itemsize
    return np.random.default_rng(seed).standard_normal(n).astype(np_dtype).tobytes()


def _descriptor(key: bytes, payload: bytes) -> StateDescriptor:
    return StateDescriptor(
        key=key.hex(),
        namespace=Namespace("bench"),
        model=ModelIdentity("bench-model", dtype="float16"),
        tokenizer=TokenizerIdentity("bench"),
        layout=Layout((StateGroup("dense", 32, 8, 128),)),
        span=TokenSpan(0, 16),
        nbytes=len(payload),
        checksum=checksum(payload),
        placement=Placement("disk", "bench"),
    )


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(
    sizes: Sequence[int] = (1 << 20, 16 << 20),
    repeats: int = 7,
    *,
    codecs: Sequence[str] = ("raw", "shuffle-zstd"),
    fsync: bool = True,
    path: str | None = None,
) -> list[dict[str, Any]]:
    """Median put / get seconds of the disk tier and of raw file I/O, per codec and payload size.

    Each row: tier, codec, size, fsync, stored_nbytes (file size in the tier), put_s, get_s, base_put_s, base_get_s.
    """
    rows: list[dict[str, Any]] = []
    root = tempfile.mkdtemp(prefix="nkv-bench-disk-", dir=path)
    try:
        for name in codecs:
            for size in sizes:
                rows.append(_run_one(os.path.join(root, f"{name}-{size}"), name, size, repeats, fsync))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _run_one(where: str, codec_name: str, size: int, repeats: int, fsync: bool) -> dict[str, Any]:
    payload = kv_payload(size)
    keys = [hashlib.blake2b(f"{codec_name}-{size}-{i}".encode(), digest_size=16).digest() for i in range(repeats + 1)]
    descs = [_descriptor(k, payload) for k in keys]
    store = named(DiskStore(4 * size + (1 << 20), name="disk", path=where, codec=codec_name, fsync=fsync))
    dir_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    raw_path = os.path.join(where, "raw.bin")
    sink: list[object] = []

    def raw_put() -> None:
        with open(raw_path, "wb", buffering=0) as f:
            f.write(payload)
            if fsync:
                os.fsync(f.fileno())
        if fsync:
            os.fsync(dir_fd)

    def raw_get() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            sink.append(f.read())

    samples: dict[str, list[float]] = {"put": [], "get": [], "base_put": [], "base_get": []}
    stored = 0
    try:
        for i in range(repeats + 1):  # the first round warms up and is not counted
            slot = slot_of(keys[i])

            def put(slot: bytes = slot, i: int = i) -> None:
                store.put(slot, payload, descs[i])
                store.flush()

            def get(slot: bytes = slot) -> None:
                got = store.get(slot)
                assert got is not None and len(got.payload) == size
                sink.append(got.payload)

            pairs = [("put", put), ("base_put", raw_put), ("get", get), ("base_get", raw_get)]
            if i % 2:
                pairs = [pairs[1], pairs[0], pairs[3], pairs[2]]
            gc.collect()
            gc.disable()
            try:
                for label, fn in pairs:
                    t = _timed(fn)
                    if i:
                        samples[label].append(t)
                    sink.clear()
            finally:
                gc.enable()
            stored = os.path.getsize(store.file_of(slot))
            store.delete(slot)
            os.unlink(raw_path)
    finally:
        store.close()
        os.close(dir_fd)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "tier": "disk",
        "codec": codec_name,
        "size": size,
        "fsync": fsync,
        "stored_nbytes": stored,
        "put_s": med["put"],
        "get_s": med["get"],
        "base_put_s": med["base_put"],
        "base_get_s": med["base_get"],
    }


def codec_stats(payload: bytes, elem_size: int, *, level: int = 3, repeats: int = 5) -> dict[str, Any]:
    """Compression ratio and encode / decode MB/s (medians) of plain zstd and shuffle+zstd at `level`."""
    out: dict[str, Any] = {"raw_nbytes": len(payload), "elem_size": elem_size, "level": level}
    mb = len(payload) / 1e6
    for label, name in (("zstd", "zstd"), ("shuffle", "shuffle-zstd")):
        enc = codec.encode(payload, name, elem_size=elem_size, level=level)
        enc_t, dec_t = [], []
        for _ in range(repeats):
            enc_t.append(_timed(lambda name=name: codec.encode(payload, name, elem_size=elem_size, level=level)))
            dec_t.append(_timed(lambda e=enc: codec.decode(e.data, e.codec, len(payload), elem_size=e.elem_size)))
        out[f"{label}_codec"] = enc.codec  # what was stored ("raw" when compressing did not pay)
        out[f"{label}_ratio"] = len(payload) / len(enc.data)
        out[f"{label}_encode_MBps"] = mb / statistics.median(enc_t)
        out[f"{label}_decode_MBps"] = mb / statistics.median(dec_t)
    return out


if __name__ == "__main__":
    for row in run(**quick({}, {"sizes": (64 << 10,), "repeats": 1})):
        print(f"disk {row['codec']:>12} {row['size'] >> 20:>3} MiB fsync={row['fsync']}: "
              f"put {row['put_s'] * 1e3:7.2f} ms (raw write {row['base_put_s'] * 1e3:7.2f} ms, "
              f"x{row['put_s'] / row['base_put_s']:.2f})  get {row['get_s'] * 1e3:6.2f} ms (raw read "
              f"{row['base_get_s'] * 1e3:6.2f} ms, x{row['get_s'] / row['base_get_s']:.2f})  "
              f"stored {row['size'] / row['stored_nbytes']:.3f}:1")  # fmt: skip
    for size in quick((32 << 10, 1 << 20, 16 << 20), (32 << 10,)):
        for dtype, elem in (("float16", 2), ("float32", 4)):
            stats = codec_stats(kv_payload(size, dtype), elem, repeats=quick(5, 1))
            print(f"codec {dtype} {size >> 10:>6} KiB: " + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()))  # fmt: skip
