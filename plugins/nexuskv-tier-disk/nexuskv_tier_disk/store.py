"""The disk tier store: one checksummed file per payload under a directory, bounded in bytes, evicting by priority.

Writes go through a bounded queue to writer threads (temporary file, fsync, rename); reads run on a small bounded
pool and verify the file's checksum every time; a new store rebuilds its holdings from the directory once it has
the deployment's name key (`use_name_key`): files are named by a keyed hash of their slot, never by the slot.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import heapq
import hmac
import itertools
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from attrs import Factory, define

from nexuskv import (
    ConfigError,
    EvictionCallback,
    Lineage,
    StateDescriptor,
    StoredState,
    get_logger,
    parent_slot,
    pick_victims,
    slot_named,
    store_name,
)
from nexuskv_tier_disk import codec as codecs
from nexuskv_tier_disk import durable_files, file_format

__all__ = ["DiskStore", "Recovery"]

log = get_logger(__name__)

_now = time.time  # wall clock: TTL deadlines are kept in the files and outlive the process

_Evicted = tuple[bytes, StateDescriptor, "bytes | memoryview | None"]


@define
class Recovery:
    """What a store found in its directory when it started: what it kept and what it discarded, and why."""

    recovered: int = 0
    recovered_bytes: int = 0
    temp_removed: list[str] = Factory(list)  # interrupted writes (and evictions) of an earlier process
    corrupt: list[tuple[str, str]] = Factory(list)  # (file, reason): partial, damaged or unreadable
    expired: list[str] = Factory(list)  # past their TTL
    over_capacity: list[str] = Factory(list)  # the lowest-priority files past a (now smaller) capacity
    ignored: list[str] = Factory(list)  # names that are not ours (left alone)
    misnamed: list[tuple[str, str]] = Factory(list)  # (file, reason): not under the keyed name of its state

    @property
    def discarded(self) -> int:
        """Files deleted at start for any reason (temporary files included)."""
        return (len(self.temp_removed) + len(self.corrupt) + len(self.expired) + len(self.over_capacity)
                + len(self.misnamed))  # fmt: skip


@define
class _Entry:
    descriptor: StateDescriptor
    priority: float
    seq: int  # LRU order (changes on every read)
    gen: int  # identity of this put (a write of an older put never lands)
    size: int  # bytes counted against capacity: the file size once written, an upper bound while pending
    expires: float = 0.0  # unix seconds; 0 = never
    buf: bytes | memoryview | None = None  # the payload while its write is pending (reads are served from it)


class DiskStore:
    """A tier store keeping each payload in its own file under `path`, with a byte capacity.

    Eviction order: lowest `priority` first, least recently used among equals, never above the incoming priority;
    `floor` is the priority of the most valuable payload evicted (GreedyDual aging). `put` returns at once: the
    payload is queued for a writer thread and served from memory until its file is in place; it returns False when
    the payload cannot fit or the write queue is full (backpressure). `get` reads on a bounded pool, verifies the
    file's xxh3-128 checksum and decodes; a file that fails is a miss, is deleted, logged, and reported through the
    eviction callback. Evicted files are read back on the writer thread so the callback can demote their payload.

    Files are named `store_name(name_key, slot) + ".nkv"`: the directory's listing shows no slot or block key. The
    kernel hands the name key over (`use_name_key`) before anything else; until then the store reads nothing from
    its directory and `put` / `get` / `delete` raise `ConfigError` (it never names a file by slot).
    """

    def __init__(
        self,
        capacity_bytes: int = 1 << 30,
        name: str = "disk",
        *,
        path: str | os.PathLike[str] | None = None,
        codec: str = "shuffle-zstd",
        level: int = 3,
        fsync: bool = True,
        write_queue: int = 64,
        write_queue_bytes: int = 256 << 20,
        write_workers: int = 1,
        read_workers: int = 2,
        read_queue: int = 64,
        read_timeout_s: float | None = 5.0,
        evict_payloads: bool = True,
        verify_on_start: bool = False,
    ) -> None:
        if path is None:
            raise ConfigError(f"tier {name}: the disk tier needs a `path` (a directory)")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if codec not in codecs.CODECS:
            raise ValueError(f"codec must be one of {codecs.CODECS}, got {codec!r}")
        for opt, v in (("write_queue", write_queue), ("write_queue_bytes", write_queue_bytes),
                       ("write_workers", write_workers), ("read_workers", read_workers)):  # fmt: skip
            if int(v) < 1:
                raise ValueError(f"{opt} must be at least 1, got {v}")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.codec = codec
        self.level = int(level)
        self.fsync = bool(fsync)
        self.write_queue = int(write_queue)
        self.write_queue_bytes = int(write_queue_bytes)
        self.read_timeout_s = read_timeout_s
        self.evict_payloads = bool(evict_payloads)
        self.floor = 0.0  # priority of the most valuable payload evicted so far (GreedyDual's L)
        self.evictions = 0
        self.rejected = 0  # puts refused by backpressure
        self.write_errors = 0
        self.corrupt_reads = 0
        self.read_timeouts = 0
        self.problems: collections.deque[tuple[str, str]] = collections.deque(maxlen=256)  # recent (file, why)

        self._items: dict[bytes, _Entry] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count()
        self._used = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._jobs: collections.deque[tuple[Any, ...]] = collections.deque()
        self._queued_writes = 0
        self._queued_bytes = 0
        self._busy = 0
        self._closed = False
        self._stopping = False
        self._on_evict: EvictionCallback | None = None
        self._lineage = Lineage(lambda s: s in self._items)  # a prefix is never dropped while its continuation stays

        durable_files.private_dirs(self.path)
        unsafe = durable_files.refuse_unsafe_dir(self.path)
        if unsafe:
            raise ConfigError(f"tier {name}: {self.path} cannot hold this tier's state: {unsafe}")
        self._lock_fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, durable_files.FILE_MODE)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"tier {name}: {self.path} is in use by another disk store") from None
        self._dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        self._name_key: bytes | None = None
        self._verify_on_start = bool(verify_on_start)
        self.recovery = Recovery()  # what the directory held: read once the name key is known (`use_name_key`)
        self._read_slots = threading.BoundedSemaphore(int(read_workers) + max(0, int(read_queue)))
        self._read_q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()  # fd, size, buffer, box, done
        self._readers = [
            threading.Thread(target=self._read_loop, name=f"nkv-{name}-r{i}", daemon=True)
            for i in range(int(read_workers))
        ]
        self._writers = [
            threading.Thread(target=self._write_loop, name=f"nkv-{name}-w{i}", daemon=True)
            for i in range(int(write_workers))
        ]
        for t in (*self._writers, *self._readers):
            t.start()

    # ------------------------------------------------------------------------------------------ protocol

    def use_name_key(self, key: bytes) -> None:
        """Name files by `store_name(key, slot)`, then (the first time) rebuild the holdings from the directory.

        The kernel calls it with the deployment's name key before anything else; a store used on its own needs one
        too (`nexuskv.StateSeal(secret).name_key`: the same secret finds the same files again). A file that is not
        under the keyed name of the state it holds (renamed, planted, written under another secret, or named by
        raw slot before names were keyed) is deleted at that point (`recovery.misnamed`). The key cannot change.
        """
        store_name(key, b"")  # ValueError for a key that is no name key
        with self._lock:
            if self._name_key is not None:
                if not hmac.compare_digest(self._name_key, key):
                    raise ConfigError(f"tier {self.name}: its name key cannot change while it is open")
                return
            self._name_key = bytes(key)
            self.recovery = self._recover(self._verify_on_start)

    def _keyed(self) -> bytes:
        key = self._name_key
        if key is None:
            raise ConfigError(f"tier {self.name}: no name key (the kernel hands it over; on its own call "
                              f"use_name_key(key) first): files are never named by slot")  # fmt: skip
        return key

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Be told (slot, descriptor, payload) about every eviction, expiry, failed write and corrupt file."""
        self._on_evict = callback

    def put(self, slot: bytes, payload: bytes | memoryview, descriptor: StateDescriptor, priority: float = 0.0,
            ttl_s: float | None = None) -> bool:  # fmt: skip
        """Queue `payload` for writing, evicting lower-priority payloads to make room.

        False (and nothing changes) when it cannot fit without evicting more valuable state, or when the write queue
        is full. The payload is readable at once.
        """
        self._keyed()
        data = payload if type(payload) is bytes else bytes(payload)
        meta = file_format.encode_meta(descriptor)
        need = file_format.FIXED_SIZE + len(meta) + len(data)  # the codec never stores more than the raw bytes
        expires = _now() + ttl_s if ttl_s is not None else 0.0
        evicted: list[_Evicted] = []
        with self._lock:
            if self._closed:
                return False
            if self._queued_writes >= self.write_queue or (
                self._queued_bytes and self._queued_bytes + len(data) > self.write_queue_bytes
            ):
                self.rejected += 1
                return False
            old = self._items.pop(slot, None)
            if old is not None:
                self._used -= old.size
            parent = parent_slot(slot, descriptor)
            if need > self.capacity_bytes or not self._make_room(need, priority, evicted, parent):
                if old is not None:  # keep what was there rather than lose both
                    self._items[slot] = old
                    self._used += old.size
                ok = False
            else:
                seq = next(self._seq)
                self._items[slot] = _Entry(descriptor, priority, seq, seq, need, expires, data)
                heapq.heappush(self._heap, (priority, seq, slot))
                self._lineage.add(slot, descriptor)
                self._used += need
                self._jobs.append(("write", slot, seq, data, meta))
                self._queued_writes += 1
                self._queued_bytes += len(data)
                self._cond.notify()
                ok = True
        self._notify(evicted)
        return ok

    def get(self, slot: bytes) -> StoredState | None:
        """The decoded payload and descriptor of `slot`, checksum verified, or None (a miss, never bad bytes)."""
        self._keyed()
        reason = ""
        with self._lock:
            e = self._items.get(slot)
            if e is None or self._closed:
                return None
            if e.expires and e.expires <= _now():
                self._drop(slot, e)
                expired = e
            else:
                expired = None
                e.seq = next(self._seq)
                heapq.heappush(self._heap, (e.priority, e.seq, slot))
                if len(self._heap) > 2 * len(self._items) + 64:
                    self._heap = [(x.priority, x.seq, k) for k, x in self._items.items()]
                    heapq.heapify(self._heap)
                if e.buf is not None:
                    return StoredState(memoryview(e.buf), e.descriptor)
                gen, size, desc = e.gen, e.size, e.descriptor
                try:
                    fd = os.open(self._file(slot), os.O_RDONLY)  # under the lock: the file of this very entry
                except OSError as exc:
                    fd, reason = -1, f"cannot open: {exc.strerror}"
        if expired is not None:
            self._notify([(slot, expired.descriptor, None)])
            return None
        if fd < 0:
            self._discard(slot, gen, reason)
            return None
        if not self._read_slots.acquire(timeout=self.read_timeout_s):
            os.close(fd)
            self.read_timeouts += 1
            log.warning("disk read queue full; served as a miss", tier=self.name, slot=slot.hex())
            return None
        done = threading.Lock()
        done.acquire()
        box: list[tuple[bytes | memoryview | None, str]] = []
        # Allocated here, not on the reader: glibc gives each thread its own arena, and a big block freed in the
        # caller's arena is reused, where one from a reader's arena is a fresh mmap (page faults: +50% on 16 MiB).
        buf = np.empty(size, dtype=np.uint8)
        self._read_q.put((fd, size, buf, box, done))
        if done.acquire(timeout=-1 if self.read_timeout_s is None else self.read_timeout_s):
            payload, reason = box[0]
        else:
            self.read_timeouts += 1
            log.warning("disk read timed out; served as a miss", tier=self.name, slot=slot.hex(),
                        timeout_s=self.read_timeout_s)  # fmt: skip
            return None
        if payload is None:
            if reason:  # else the store closed meanwhile: a plain miss
                self._discard(slot, gen, reason)
            return None
        return StoredState(payload, desc)

    def delete(self, slot: bytes) -> bool:
        """Drop a payload and its file; True if it was held. Deletion is not an eviction: no callback."""
        self._keyed()
        with self._lock:
            e = self._items.get(slot)
            if e is None:
                return False
            self._drop(slot, e)
            return True

    def __contains__(self, slot: object) -> bool:
        return slot in self._items

    def __len__(self) -> int:
        return len(self._items)

    def slots(self) -> Iterator[bytes]:
        """Every slot held (a snapshot)."""
        with self._lock:
            return iter(list(self._items))

    def descriptors(self) -> Iterator[tuple[bytes, StateDescriptor]]:
        """(slot, descriptor) of every payload held, from memory (rebuilt from file headers at start)."""
        with self._lock:
            return iter([(k, e.descriptor) for k, e in self._items.items()])

    def used_bytes(self) -> int:
        """Bytes held now: file sizes, and an upper bound for payloads whose write is pending."""
        return self._used

    def pending(self) -> int:
        """Writes and evictions queued or in progress."""
        with self._lock:
            return len(self._jobs) + self._busy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write and eviction is done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued writes (up to `timeout` seconds), stop the threads and release the directory.

        The files stay: a store opened on the directory later serves them again.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.flush(timeout):
            log.warning("disk tier closed with writes pending", tier=self.name, pending=self.pending())
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._writers:
            t.join(timeout)
        for _ in self._readers:
            self._read_q.put(None)
        for t in self._readers:
            t.join(timeout)
        with contextlib.suppress(queue.Empty):
            while True:  # a read that raced with close: answer it as a miss
                job = self._read_q.get_nowait()
                if job is not None:
                    os.close(job[0])
                    job[3].append((None, ""))
                    job[4].release()
        os.close(self._dir_fd)
        os.close(self._lock_fd)  # releases the directory lock

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def file_of(self, slot: bytes) -> str:
        """The path of the file that holds (or will hold) `slot`: its keyed name, never the slot."""
        return self._file(slot)

    # ------------------------------------------------------------------------------------------ eviction

    def _name(self, slot: bytes) -> str:
        return store_name(self._keyed(), slot)

    def _file(self, slot: bytes) -> str:
        return os.path.join(self.path, self._name(slot) + file_format.SUFFIX)

    def _unlink(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _drop(self, slot: bytes, e: _Entry) -> None:
        """Forget an entry and delete its file (lock held). A pending write of it will not land."""
        del self._items[slot]
        self._used -= e.size
        self._unlink(self._file(slot))

    def _make_room(self, need: int, priority: float, evicted: list[_Evicted], protect: bytes | None = None) -> bool:
        """Evict lowest-priority payloads (never above `priority`, leaves first) until `need` bytes fit, or nothing."""
        def size_of(slot: bytes, seq: int) -> int | None:
            e = self._items.get(slot)
            return e.size if e is not None and e.seq == seq else None

        victims = pick_victims(self._heap, used=self._used, need=need, capacity=self.capacity_bytes,
                               priority=priority, size_of=size_of, lineage=self._lineage, protect=protect)  # fmt: skip
        if victims is None:
            return False
        for prio, _, slot in victims:
            self.floor = max(self.floor, prio)
            self.evictions += 1
            e = self._items.pop(slot)
            self._used -= e.size
            path = self._file(slot)
            if e.buf is not None:  # still in memory: hand it over now; its queued write will not land
                self._unlink(path)  # an older version of the slot, if any
                evicted.append((slot, e.descriptor, e.buf))
            elif self.evict_payloads and self._on_evict is not None:
                aside = os.path.join(self.path, f"{file_format.EVICT_PREFIX}{self._name(slot)}-{e.gen}")
                try:
                    os.rename(path, aside)  # read back on a writer thread, then deleted
                    self._jobs.append(("evict", slot, e.descriptor, aside, e.size))
                    self._cond.notify()
                except OSError:
                    self._unlink(path)
                    evicted.append((slot, e.descriptor, None))
            else:
                self._unlink(path)
                evicted.append((slot, e.descriptor, None))
        return True

    def _notify(self, evicted: list[_Evicted]) -> None:
        cb = self._on_evict
        if cb is not None:
            for slot, desc, data in evicted:
                try:
                    cb(slot, desc, data)
                except Exception:
                    log.exception("eviction callback failed", tier=self.name, slot=slot.hex())

    def _discard(self, slot: bytes, gen: int, reason: str) -> None:
        """A file failed verification: forget it (if still the same entry), delete it, log and report it."""
        with self._lock:
            e = self._items.get(slot)
            mine = e is not None and e.gen == gen
            if mine:
                self._drop(slot, e)
        self.corrupt_reads += 1
        name = self._name(slot) + file_format.SUFFIX
        self.problems.append((name, reason))
        log.warning("disk payload failed verification; dropped and served as a miss", tier=self.name, file=name,
                    reason=reason)  # fmt: skip
        if mine:
            self._notify([(slot, e.descriptor, None)])

    # ------------------------------------------------------------------------------------------ threads

    def _read(self, fd: int, size: int, buf: np.ndarray | None = None) -> tuple[bytes | memoryview | None, str]:
        """Read, verify and decode one file (on a reader thread); (payload, "") or (None, why)."""
        try:
            header, stored = file_format.read_verified(fd, size, buf)
            return codecs.decode(stored, header.codec, header.raw_len, elem_size=header.elem_size), ""
        except OSError as exc:
            return None, f"read failed: {exc.strerror}"
        except (file_format.CorruptFile, ValueError) as exc:
            return None, str(exc)
        finally:
            os.close(fd)

    def _read_loop(self) -> None:
        while (job := self._read_q.get()) is not None:
            fd, size, buf, box, done = job
            try:
                box.append(self._read(fd, size, buf))
            except BaseException as exc:  # never leave a reader waiting
                box.append((None, f"read failed: {exc!r}"))
            finally:
                self._read_slots.release()
                done.release()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy += 1
                if job[0] == "write":
                    self._queued_writes -= 1
                    self._queued_bytes -= len(job[3])
            try:
                if job[0] == "write":
                    self._write(*job[1:])
                else:
                    self._evict_file(*job[1:])
            except Exception:
                log.exception("disk tier job failed", tier=self.name, job=job[0])
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _write(self, slot: bytes, gen: int, data: bytes, meta: bytes) -> None:
        """Encode and write one payload: temporary file, fsync, rename, directory fsync (on a writer thread)."""
        with self._lock:
            e = self._items.get(slot)
            if e is None or e.gen != gen:
                return  # evicted, deleted or replaced while queued
            prio, expires, desc = e.priority, e.expires, e.descriptor
        enc = codecs.encode(data, self.codec, elem_size=codecs.element_size(desc), level=self.level)
        head = file_format.pack_header(meta, enc.codec, enc.elem_size, len(enc.data), len(data), prio, expires,
                               file_format.digest(enc.data))  # fmt: skip
        tmp = os.path.join(self.path, f"{file_format.TEMP_PREFIX}{self._name(slot)}-{gen}")
        try:
            durable_files.write_file(tmp, [head, enc.data], self.fsync)
        except OSError as exc:
            self._write_failed(slot, gen, data, exc)
            return
        size = len(head) + len(enc.data)
        with self._lock:
            e = self._items.get(slot)
            if e is None or e.gen != gen:
                self._unlink(tmp)
                return
            try:
                os.replace(tmp, self._file(slot))
            except OSError as exc:
                self._unlink(tmp)
                self._write_failed(slot, gen, data, exc)
                return
            self._used += size - e.size
            e.size = size
            e.buf = None
        if self.fsync:
            durable_files.fsync_dir(self._dir_fd)

    def _write_failed(self, slot: bytes, gen: int, data: bytes, exc: OSError) -> None:
        """A write failed (disk full, I/O error): drop the entry and report it, payload attached for demotion."""
        self.write_errors += 1
        with self._lock:
            e = self._items.get(slot)
            mine = e is not None and e.gen == gen
            if mine:
                self._drop(slot, e)
        level = log.error if exc.errno != errno.ENOSPC else log.warning
        level("disk write failed; payload dropped from the tier", tier=self.name, slot=slot.hex(),
              error=exc.strerror or str(exc), errno=errno.errorcode.get(exc.errno or 0, exc.errno))  # fmt: skip
        if mine:
            self._notify([(slot, e.descriptor, data)])

    def _evict_file(self, slot: bytes, desc: StateDescriptor, aside: str, size: int) -> None:
        """Read an evicted file back for the callback (so the kernel can demote it), then delete it."""
        payload: bytes | memoryview | None = None
        try:
            fd = os.open(aside, os.O_RDONLY)
            payload, reason = self._read(fd, size)
            if payload is None:
                log.warning("evicted disk payload failed verification; reported without it", tier=self.name,
                            file=self._name(slot) + file_format.SUFFIX, reason=reason)  # fmt: skip
        except OSError:
            pass
        finally:
            self._unlink(aside)
        with self._lock:
            again = slot in self._items  # put again since: the kernel's index entry is the new one's
        if not again:
            self._notify([(slot, desc, payload)])

    # ------------------------------------------------------------------------------------------ recovery

    def _recover(self, verify: bool) -> Recovery:
        """Rebuild the holdings from the directory, deleting interrupted, corrupt, expired and misnamed files.

        The slot of a file is the one its descriptor names, kept only when the file is under that slot's keyed name
        (`slot_named`); the name itself is never parsed.
        """
        key = self._keyed()
        rec = Recovery()
        reader = file_format.DescriptorReader()
        now = _now()
        found: list[tuple[int, bytes, _Entry]] = []
        for name in sorted(os.listdir(self.path)):
            path = os.path.join(self.path, name)
            if name.startswith((file_format.TEMP_PREFIX, file_format.EVICT_PREFIX)):
                self._unlink(path)
                rec.temp_removed.append(name)
                continue
            if name == ".lock":
                continue
            if not name.endswith(file_format.SUFFIX) or not os.path.isfile(path):
                rec.ignored.append(name)
                continue
            try:
                header, meta, size = file_format.read_header(path)
                if size != header.file_size:
                    raise file_format.CorruptFile(f"size mismatch: header says {header.file_size}, "
                                                  f"file has {size} bytes")
                desc = reader.read(meta)
                slot = slot_named(key, name[: -len(file_format.SUFFIX)], desc)
                if slot is None:
                    why = _misnamed(name[: -len(file_format.SUFFIX)], desc)
                    rec.misnamed.append((name, why))
                    self._unlink(path)
                    log.warning("disk tier discarded a misnamed file at start", tier=self.name, file=name, reason=why)
                    continue
                if verify:
                    fd = os.open(path, os.O_RDONLY)
                    payload, reason = self._read(fd, size)
                    if payload is None:
                        raise file_format.CorruptFile(reason)
                mtime = os.stat(path).st_mtime_ns
            except (file_format.CorruptFile, ValueError, OSError) as exc:
                reason = str(exc) if not isinstance(exc, OSError) else f"unreadable: {exc.strerror}"
                rec.corrupt.append((name, reason))
                self._unlink(path)
                log.warning("disk tier discarded a file at start", tier=self.name, file=name, reason=reason)
                continue
            if header.expires and header.expires <= now:
                self._unlink(path)
                rec.expired.append(name)
                continue
            found.append((mtime, slot, _Entry(desc, header.priority, 0, 0, size, header.expires)))
        found.sort(key=lambda f: f[0])
        for _, slot, e in found:
            e.seq = e.gen = next(self._seq)
            self._items[slot] = e
            self._lineage.add(slot, e.descriptor)
            self._used += e.size
            self._heap.append((e.priority, e.seq, slot))
        heapq.heapify(self._heap)
        while self._used > self.capacity_bytes and self._heap:
            _, _, slot = heapq.heappop(self._heap)
            e = self._items.pop(slot)
            self._used -= e.size
            self._unlink(self._file(slot))
            rec.over_capacity.append(self._name(slot) + file_format.SUFFIX)
        if self._items:
            self.floor = min(e.priority for e in self._items.values())
        rec.recovered, rec.recovered_bytes = len(self._items), self._used
        if rec.discarded:
            durable_files.fsync_dir(self._dir_fd)
        log.info("disk tier opened", tier=self.name, path=self.path, recovered=rec.recovered,
                 recovered_bytes=rec.recovered_bytes, temp_removed=len(rec.temp_removed), corrupt=len(rec.corrupt),
                 expired=len(rec.expired), over_capacity=len(rec.over_capacity),
                 misnamed=len(rec.misnamed))  # fmt: skip
        return rec


def _misnamed(stem: str, desc: StateDescriptor) -> str:
    """Why a file whose descriptor names state of another name is not served (its name is never parsed)."""
    if stem == f"{desc.key}{desc.group:02x}":
        return "named by raw slot (written before names were keyed): recomputed and stored again under its keyed name"
    return "not the keyed name of the state it holds (renamed, planted, or written under another secret)"
