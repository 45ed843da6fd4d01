"""Payload codecs of the disk tier: raw, zstandard, and zstandard over a byte-plane shuffle of float payloads.

The shuffle splits each value's bytes into planes (all first bytes, then all second bytes, ...) and compresses each
plane as its own zstd frame, so the sign / exponent bytes get their own entropy tables (zstd codes a block's
literals with one table: planes in one frame only pay off past its 128 KiB blocks). It never changes what decodes.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard
from attrs import frozen

from nexuskv import StateDescriptor

__all__ = ["CODECS", "Encoded", "decode", "element_size", "encode", "shuffle", "unshuffle"]

CODECS = ("raw", "zstd", "shuffle-zstd")
"""Codec names a `DiskStore` accepts (`shuffle-zstd` falls back to `zstd` when the element size is unknown)."""

_ELEM = {"float16": 2, "bfloat16": 2, "float32": 4}
_local = threading.local()  # zstd contexts are not thread-safe: one per thread and level


@frozen
class Encoded:
    """A payload after the codec: the codec actually applied, its element size (shuffle only) and the bytes."""

    codec: str
    elem_size: int
    data: bytes | memoryview


def element_size(descriptor: StateDescriptor) -> int | None:
    """Bytes per value for the shuffle: from the payload's tensors, else the model dtype; None if mixed/unknown.

    The fallback to `model.dtype` applies only without KV quantization (a quantized payload's values are not in
    the model dtype). A wrong guess only costs ratio, never correctness: the shuffle is lossless at any size.
    """
    if descriptor.tensors:
        sizes = {_ELEM.get(t.dtype.removeprefix("torch.")) for t in descriptor.tensors}
        return sizes.pop() if len(sizes) == 1 else None
    if descriptor.model.quantization == "none":
        return _ELEM.get(descriptor.model.dtype.removeprefix("torch."))
    return None


def shuffle(data: bytes | memoryview, elem_size: int) -> bytes:
    """Byte planes of `data` read as `elem_size`-byte values; a tail shorter than one value is appended as is."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % elem_size
    planes = raw[:whole].reshape(-1, elem_size).T
    out = np.empty(len(raw), dtype=np.uint8)
    out[:whole].reshape(elem_size, -1)[...] = planes
    out[whole:] = raw[whole:]
    return out.tobytes()


def unshuffle(data: bytes | memoryview, elem_size: int) -> bytes:
    """Inverse of `shuffle`."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % elem_size
    out = np.empty(len(raw), dtype=np.uint8)
    out[:whole].reshape(-1, elem_size)[...] = raw[:whole].reshape(elem_size, -1).T
    out[whole:] = raw[whole:]
    return out.tobytes()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "c", None)
    if cache is None:
        cache = _local.c = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode(data: bytes | memoryview, codec: str = "zstd", *, elem_size: int | None = None, level: int = 3) -> Encoded:
    """Encode `data` with `codec`; keeps the raw bytes when compressing would not make them smaller.

    `shuffle-zstd` needs `elem_size` > 1 and otherwise compresses plainly (the result says which codec ran).
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r} (have: {', '.join(CODECS)})")
    if codec == "raw" or not len(data):
        return Encoded("raw", 0, data)
    if codec == "shuffle-zstd" and elem_size is not None and 1 < elem_size <= 16 and len(data) >= elem_size:
        enc = Encoded("shuffle-zstd", elem_size, _encode_planes(data, elem_size, level))
    else:
        enc = Encoded("zstd", 0, _compressor(level).compress(data))
    return enc if len(enc.data) < len(data) else Encoded("raw", 0, data)


def _encode_planes(data: bytes | memoryview, k: int, level: int) -> bytes:
    """k little-endian u32 frame lengths, one zstd frame per byte plane, then the tail (< k bytes) as is."""
    raw = np.frombuffer(data, dtype=np.uint8)
    whole = len(raw) - len(raw) % k
    planes = raw[:whole].reshape(-1, k).T
    c = _compressor(level)
    frames = [c.compress(np.ascontiguousarray(planes[i])) for i in range(k)]
    return b"".join([struct.pack(f"<{k}I", *map(len, frames)), *frames, raw[whole:].tobytes()])


def _decode_planes(data: bytes | memoryview, k: int, raw_nbytes: int) -> memoryview:
    whole = raw_nbytes - raw_nbytes % k
    n = whole // k
    out = np.empty(raw_nbytes, dtype=np.uint8)
    values = out[:whole].reshape(-1, k)
    try:
        lengths = struct.unpack_from(f"<{k}I", data)
    except struct.error:
        raise ValueError("shuffle-zstd payload shorter than its plane table") from None
    off = 4 * k
    d = _decompressor()
    for i, length in enumerate(lengths):
        plane = d.decompress(data[off : off + length], max_output_size=n)
        if len(plane) != n:
            raise ValueError(f"plane {i} decoded to {len(plane)} bytes, expected {n}")
        values[:, i] = np.frombuffer(plane, dtype=np.uint8)
        off += length
    if len(data) - off != raw_nbytes - whole:
        raise ValueError(f"decoded {whole + len(data) - off} bytes, expected {raw_nbytes}")
    out[whole:] = np.frombuffer(data, dtype=np.uint8)[off:]
    return memoryview(out)


def decode(data: bytes | memoryview, codec: str, raw_nbytes: int, *, elem_size: int = 0) -> bytes | memoryview:
    """Inverse of `encode` (`codec` and `elem_size` as `encode` reported them); raw bytes come back uncopied.

    Raises ValueError when the bytes do not decode to exactly `raw_nbytes`.
    """
    try:
        if codec == "raw":
            out: bytes | memoryview = data
        elif codec == "zstd":
            out = _decompressor().decompress(data, max_output_size=raw_nbytes)
        elif codec == "shuffle-zstd":
            if not 1 < elem_size <= 16:
                raise ValueError(f"shuffle-zstd needs an element size in 2..16, got {elem_size}")
            out = _decode_planes(data, elem_size, raw_nbytes)
        else:
            raise ValueError(f"unknown codec {codec!r}")
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd frame does not decode: {exc}") from None
    if len(out) != raw_nbytes:
        raise ValueError(f"decoded {len(out)} bytes, expected {raw_nbytes}")
    return out
