"""Shared-memory segments: their names, their layout, writing, mapping, and a cache of mappings.

Everything here works on plain files of a tmpfs directory (`/dev/shm` on Linux, where POSIX `shm_open`
names live), so no Python resource tracker ever owns a segment: lifetime is decided by leases alone.
"""

from __future__ import annotations

import collections
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
import zlib
from pathlib import Path

from attrs import define

NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")


SEGMENT, TEMP, LEASE = "s", "t", "l"  # published segment, segment being written, lease record


NEW_SUFFIX = ".new"  # a lease record being written


def check_namespace(namespace: str) -> str:
    """The namespace, or ValueError (letters, digits and `_` only, so names split unambiguously on `-`)."""
    if not NAMESPACE_RE.match(namespace):
        raise ValueError(f"namespace must match {NAMESPACE_RE.pattern}, got {namespace!r}")
    return namespace


def segment_name(namespace: str, name: str) -> str:
    """The published name of a slot's segment: one per slot and namespace on the host.

    `name` is the slot's keyed name (`nexuskv.store_name`), never the slot: a listing of the directory shows no slot
    or block key.
    """
    return f"{namespace}-{SEGMENT}-{name}"


def temp_name(namespace: str, lease_id: str) -> str:
    """A fresh name for a segment being written (invisible to readers; carries its writer's lease)."""
    return f"{namespace}-{TEMP}-{lease_id}-{secrets.token_hex(6)}"


def lease_name(namespace: str, lease_id: str) -> str:
    """The name of a lease record."""
    return f"{namespace}-{LEASE}-{lease_id}"


def parse_name(namespace: str, name: str) -> tuple[str, str] | None:
    """(kind, rest) of a name in this namespace: rest is the slot's keyed name, `lease-rand` or the lease id."""
    head, sep, rest = name.partition("-")
    if head != namespace or not sep:
        return None
    kind, sep, rest = rest.partition("-")
    if kind not in (SEGMENT, TEMP, LEASE) or not sep or not rest:
        return None
    return kind, rest


MAGIC = b"NXKVSHM1"


VERSION = 1


FLAG_COMPLETE = 1


ALIGN = 64  # payload offset alignment: any dtype (and a cache line)


_PREFIX = struct.Struct("<8sHHI")  # magic, version, flags, crc32(body + descriptor)


_BODY = struct.Struct("<IQQ16sddd")  # desc_len, payload_off, payload_len, lease id, expires_at, priority, created


HEADER_SIZE = 128


assert _PREFIX.size + _BODY.size <= HEADER_SIZE


@define(frozen=True)
class Header:
    """The decoded fixed header of a segment."""

    flags: int
    crc: int
    desc_len: int
    payload_off: int
    payload_len: int
    lease_id: str
    expires_at: float  # wall clock (time.time()); 0 = no TTL
    priority: float
    created: float

    @property
    def complete(self) -> bool:
        """True once the writer finished the segment (the flag is written last)."""
        return bool(self.flags & FLAG_COMPLETE)

    def expired(self, now: float) -> bool:
        """True when the payload's TTL has passed."""
        return 0.0 < self.expires_at <= now


def _body(desc_len: int, payload_off: int, payload_len: int, lease_id: str, expires_at: float, priority: float,
          created: float) -> bytes:  # fmt: skip
    return _BODY.pack(desc_len, payload_off, payload_len, lease_id.encode("ascii"), expires_at, priority, created)


def decode_header(buf: bytes | memoryview | mmap.mmap) -> Header | None:
    """The header at the start of `buf`, or None when it is not a segment of this version."""
    if len(buf) < HEADER_SIZE:
        return None
    magic, version, flags, crc = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        return None
    desc_len, off, n, lease, expires, prio, created = _BODY.unpack_from(buf, _PREFIX.size)
    return Header(flags, crc, desc_len, off, n, lease.rstrip(b"\0").decode("ascii", "replace"), expires, prio, created)


def verify_header(buf: bytes | memoryview | mmap.mmap, h: Header, size: int) -> bool:
    """True when the segment is complete, its lengths fit `size` bytes, and body + descriptor match the CRC."""
    if not h.complete or h.payload_off < HEADER_SIZE + h.desc_len or h.payload_off + h.payload_len != size:
        return False
    with memoryview(buf) as view:
        crc = zlib.crc32(view[_PREFIX.size : _PREFIX.size + _BODY.size])
        crc = zlib.crc32(view[HEADER_SIZE : HEADER_SIZE + h.desc_len], crc)
    return crc == h.crc


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def write_segment(directory: Path, tmp: str, final: str, desc: bytes, payload: bytes | memoryview, lease_id: str,
                  expires_at: float, priority: float, mode: int) -> int:  # fmt: skip
    """Write a complete segment under `tmp`, then publish it atomically as `final`; return its inode.

    The header (with the complete flag and CRC) is written last, and the rename makes the segment visible only
    once whole, replacing any earlier segment of the slot: a reader maps either the old inode or the new one,
    never a torn mix. On any error the temp segment is removed and the error raised (ENOSPC when full).
    """
    data = memoryview(payload).cast("B")
    off = -(-(HEADER_SIZE + len(desc)) // ALIGN) * ALIGN
    size = off + len(data)
    body = _body(len(desc), off, len(data), lease_id, expires_at, priority, time.time())
    crc = zlib.crc32(desc, zlib.crc32(body))
    path = directory / tmp
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
    try:
        os.ftruncate(fd, size)  # sparse: a full tmpfs fails the writes below with ENOSPC (never a SIGBUS: no mmap)
        os.pwrite(fd, desc, HEADER_SIZE)
        _write_all(fd, data, off)
        os.pwrite(fd, _PREFIX.pack(MAGIC, VERSION, FLAG_COMPLETE, crc) + body, 0)
        ino = os.fstat(fd).st_ino
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)
    try:
        os.rename(path, directory / final)
    except BaseException:
        unlink_quietly(path)
        raise
    return ino


@define(frozen=True, eq=False)
class Mapped:
    """A segment mapped read-only: the mapping, its header and descriptor bytes, and the inode it came from."""

    mm: mmap.mmap
    header: Header
    desc: bytes
    ino: int
    ctime_ns: int

    def view(self) -> memoryview:
        """A read-only memoryview of the payload over the mapping (zero copy; keeps the mapping alive)."""
        h = self.header
        return memoryview(self.mm)[h.payload_off : h.payload_off + h.payload_len]


_MAP_FLAGS = mmap.MAP_SHARED


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def ours(st: os.stat_result) -> bool:
    """True for a regular file this user owns: a segment another user planted (or a FIFO, a device) is never read."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def map_segment(path: str, populate: bool = False) -> Mapped | None:
    """Map a published segment read-only, or None.

    None when it is absent, not this user's own regular file (a symlink, another user's planted file), incomplete,
    truncated or not matching its CRC.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size < HEADER_SIZE or not ours(st):
            return None
        mm = mmap.mmap(fd, st.st_size, flags=_MAP_FLAGS | (_POPULATE if populate else 0), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    h = decode_header(mm)
    if h is None or not verify_header(mm, h, st.st_size):
        return None
    return Mapped(mm, h, mm[HEADER_SIZE : HEADER_SIZE + h.desc_len], st.st_ino, st.st_ctime_ns)


def read_meta(path: str) -> tuple[Header, bytes, os.stat_result] | None:
    """Header, descriptor bytes and stat of a published segment, without mapping it; None when not valid.

    Valid as `map_segment` says: this user's own regular file, complete, matching its CRC.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not ours(st):
            return None
        head = os.pread(fd, HEADER_SIZE, 0)
        h = decode_header(head)
        if h is None or not h.complete or h.desc_len > st.st_size:
            return None
        desc = os.pread(fd, h.desc_len, HEADER_SIZE)
    finally:
        os.close(fd)
    if not verify_header(head + desc, h, st.st_size):
        return None
    return h, desc, st


class MapCache:
    """Reader-side mappings by path, reused while the path still names the same inode (bounded LRU).

    A reused mapping keeps its page tables, so a hot segment is neither re-mapped nor re-faulted. A mapping whose
    path was unlinked or replaced is dropped at the next lookup; the memory is freed once no view holds it.
    """

    def __init__(self, max_entries: int = 256, max_bytes: int = 4 << 30) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[str, Mapped] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def lookup(self, path: str, st: os.stat_result) -> Mapped | None:
        """The cached mapping of `path` if it is of the inode `st` describes."""
        with self._lock:
            m = self._items.get(path)
            if m is None:
                return None
            if m.ino == st.st_ino and m.ctime_ns == st.st_ctime_ns:
                self._items.move_to_end(path)
                return m
            self._drop(path)
            return None

    def remember(self, path: str, m: Mapped) -> None:
        """Cache a fresh mapping, evicting the least recently used past the bounds."""
        with self._lock:
            self._drop(path)
            self._items[path] = m
            self._bytes += len(m.mm)
            while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                self._drop(next(iter(self._items)))

    def forget(self, path: str) -> None:
        """Drop the mapping of `path` (it was unlinked or found stale)."""
        with self._lock:
            self._drop(path)

    def _drop(self, path: str) -> None:
        m = self._items.pop(path, None)
        if m is not None:
            self._bytes -= len(m.mm)  # never mm.close(): views handed out may still use it

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Drop every mapping."""
        with self._lock:
            self._items.clear()
            self._bytes = 0


def unlink_if_same(path: str, ino: int) -> bool:
    """Unlink `path` only if it still names inode `ino` (a writer may have just published a new segment there)."""
    try:
        if os.stat(path).st_ino != ino:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def unlink_quietly(path: str) -> bool:
    """Unlink `path`; False when it was gone already or is not ours to remove (another user's, in sticky /dev/shm)."""
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        return False
    return True
