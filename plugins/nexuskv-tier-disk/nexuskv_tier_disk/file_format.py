"""The disk tier's payload file format: the header, codec ids, checksums, verified reads and fast descriptor parsing."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import xxhash
from attrs import frozen

from nexuskv import DescriptorParser, StateDescriptor, to_dict

MAGIC = b"NKVD"


VERSION = 1


SUFFIX = ".nkv"


TEMP_PREFIX = ".tmp-"  # a write in progress (or one a crash interrupted)


EVICT_PREFIX = ".evict-"  # an evicted file waiting to be read back for the eviction callback


CODEC_IDS = {"raw": 0, "zstd": 1, "shuffle-zstd": 2}


CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}


# magic, version, codec id, element size, pad, meta length, stored length, raw length, priority, expiry (unix s,
# 0 = never), xxh3-128 of the stored data; then xxh3-64 of everything before it plus the descriptor JSON.
_FIXED = struct.Struct("<4sBBBxIQQdd16s")


_SUM = struct.Struct("<Q")


FIXED_SIZE = _FIXED.size + _SUM.size


MAX_META = 1 << 20


class CorruptFile(Exception):
    """A payload file that is partial, damaged or not ours; the message says why."""


@frozen
class Header:
    """The parsed header of a payload file."""

    codec: str
    elem_size: int
    meta_len: int
    stored_len: int
    raw_len: int
    priority: float
    expires: float  # unix seconds; 0.0 = never
    digest: bytes

    @property
    def data_offset(self) -> int:
        """Where the stored payload starts in the file."""
        return FIXED_SIZE + self.meta_len

    @property
    def file_size(self) -> int:
        """Size of the whole file."""
        return self.data_offset + self.stored_len


def digest(data: bytes | memoryview) -> bytes:
    """Fast checksum of stored bytes (xxh3-128): every read verifies it."""
    return xxhash.xxh3_128_digest(data)


def encode_meta(descriptor: StateDescriptor) -> bytes:
    """The descriptor as compact JSON (the contract's JSON form)."""
    return json.dumps(to_dict(descriptor), separators=(",", ":")).encode()


def pack_header(meta: bytes, codec: str, elem_size: int, stored_len: int, raw_len: int, priority: float,
                expires: float, data_digest: bytes) -> bytes:  # fmt: skip
    """Fixed header + header checksum + descriptor JSON."""
    fixed = _FIXED.pack(MAGIC, VERSION, CODEC_IDS[codec], elem_size, len(meta), stored_len, raw_len, priority,
                        expires, data_digest)  # fmt: skip
    return fixed + _SUM.pack(xxhash.xxh3_64_intdigest(fixed + meta)) + meta


def parse_header(head: bytes | memoryview, meta: bytes | memoryview) -> Header:
    """Check and parse the fixed header; `meta` is the descriptor JSON that follows it. Raises CorruptFile."""
    if len(head) < FIXED_SIZE:
        raise CorruptFile("shorter than a header")
    magic, version, codec_id, elem, meta_len, stored, raw, prio, expires, dig = _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise CorruptFile("bad magic")
    if version != VERSION:
        raise CorruptFile(f"unknown format version {version}")
    if meta_len > MAX_META or len(meta) != meta_len:
        raise CorruptFile("header truncated")
    (want,) = _SUM.unpack_from(head, _FIXED.size)
    h = xxhash.xxh3_64()
    h.update(head[: _FIXED.size])
    h.update(meta)
    if h.intdigest() != want:
        raise CorruptFile("header checksum mismatch")
    if codec_id not in CODEC_NAMES:
        raise CorruptFile(f"unknown codec id {codec_id}")
    return Header(CODEC_NAMES[codec_id], elem, meta_len, stored, raw, prio, expires, dig)


def meta_length(head: bytes | memoryview) -> int:
    """The descriptor JSON length a (not yet verified) fixed header announces, bounded."""
    if len(head) < FIXED_SIZE:
        raise CorruptFile("shorter than a header")
    n = _FIXED.unpack_from(head)[4]
    if n > MAX_META:
        raise CorruptFile("header truncated")
    return n


def read_header(path: str) -> tuple[Header, bytes, int]:
    """Header, descriptor JSON and file size of a payload file, without reading the payload. Raises CorruptFile."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(4096)
        n = meta_length(head)
        if len(head) < FIXED_SIZE + n:
            head += f.read(FIXED_SIZE + n - len(head))
    header = parse_header(head[:FIXED_SIZE], head[FIXED_SIZE : FIXED_SIZE + n])
    return header, bytes(head[FIXED_SIZE : FIXED_SIZE + n]), size


def read_verified(
    fd: int, size: int, buf: np.ndarray | None = None, chunk: int = 256 << 10
) -> tuple[Header, memoryview]:
    """Read a whole payload file (`size` bytes, as the store recorded it) and verify it; raises CorruptFile.

    Returns the header and a view of the stored bytes (in `buf`, `size` bytes, when given). The file is read in
    chunks and each is hashed while it is still in the CPU cache: hashing the whole payload after reading it costs
    about twice as much (memory bound).
    """
    if buf is None:
        buf = np.empty(size, dtype=np.uint8)  # not zero-filled, unlike bytearray
    mv = memoryview(buf)
    got = _read_into(fd, mv, 0, min(size, max(chunk, FIXED_SIZE)))
    if got < FIXED_SIZE:
        raise CorruptFile(f"truncated: {got} of {size} bytes")
    start = FIXED_SIZE + meta_length(mv)
    if got < start:
        got += _read_into(fd, mv, got, min(size, start) - got)
    header = parse_header(mv[:FIXED_SIZE], mv[FIXED_SIZE:start])
    if header.file_size != size:
        raise CorruptFile(f"size mismatch: header says {header.file_size}, file holds {size} bytes")
    h = xxhash.xxh3_128()
    h.update(mv[start:got])
    while got < size:
        n = _read_into(fd, mv, got, min(chunk, size - got))
        if not n:
            raise CorruptFile(f"truncated: {got} of {size} bytes")
        h.update(mv[got : got + n])
        got += n
    if os.pread(fd, 1, size):
        raise CorruptFile(f"size mismatch: the file is longer than {size} bytes")
    if h.digest() != header.digest:
        raise CorruptFile("payload checksum mismatch")
    return header, mv[start:]


def _read_into(fd: int, mv: memoryview, off: int, n: int) -> int:
    """Fill mv[off:off+n] from the same offset of the file; fewer bytes only at end of file."""
    done = 0
    while done < n:
        got = os.preadv(fd, [mv[off + done : off + n]], off + done)
        if not got:
            break
        done += got
    return done


class DescriptorReader:
    """Parses stored descriptor JSON fast, with the same checks as the schema (`nexuskv.DescriptorParser`)."""

    def __init__(self) -> None:
        self._parser = DescriptorParser()

    def read(self, meta: bytes) -> StateDescriptor:
        """The descriptor in `meta`; raises CorruptFile when it is not a valid state descriptor."""
        try:
            return self._parser.parse(meta)
        except Exception as exc:
            raise CorruptFile(f"bad descriptor: {exc}") from None
