"""The host-wide shared-memory tier store: one POSIX shm segment per slot, owned by its writer's lease.

Any process of the host that opens a `ShmStore` on the same directory and namespace, with the same name key
(the same deployment secret), sees the same segments; a segment lives as long as its writer's lease, and whichever
process notices a dead lease first reclaims it. Segments are named by a keyed hash of their slot, never the slot.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import json
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from nexuskv import (
    ConfigError,
    EvictionCallback,
    Lineage,
    StateDescriptor,
    StoredState,
    from_dict,
    get_logger,
    parent_slot,
    pick_victims,
    slot_named,
    store_name,
    to_dict,
)
from nexuskv_transport_shm import leases, segments

__all__ = ["DEFAULT_DIR", "ShmStore"]

DEFAULT_DIR = "/dev/shm"

log = get_logger(__name__)


class ShmStore:
    """A tier in host shared memory: `put` publishes a segment under this process's lease, `get` maps one.

    - Host-wide: `get`, `slots`, `descriptors` and `in` see every live segment of the namespace, whoever wrote
      it; `capacity_bytes`, `used_bytes` and eviction concern the payloads *this* store wrote (its lease).
    - Zero copy: `get` returns a read-only memoryview over a read-only mapping of the segment.
    - Segments are immutable once published (temp name, then an atomic rename), so a reader never sees a torn
      payload; a replaced or reclaimed segment stays valid in the memory of whoever still maps it.
    - Lease-owned: a segment whose lease is not alive (owner killed, hung past the TTL, or closed) or whose
      `ttl_s` passed is never served; the reaper (at open, then every `reap_interval_s`, in any process)
      unlinks it. `close` removes this store's segments and lease.

    `shm_dir` must be a tmpfs (the default is where Linux keeps POSIX shm objects); the namespace separates
    deployments sharing it. Segments are created with `mode` (owner-only by default: KV state is user data).

    - Keyed names: a slot's segment is `{namespace}-s-{store_name(name_key, slot)}`, so listing the directory
      reveals no slot or block key, and only holders of the deployment's secret can name (ask for, plant under) a
      slot. The kernel hands the name key over (`use_name_key`) before anything else; until then every call that
      would name a slot or list segments raises `ConfigError`. A listing (`slots`, `descriptors`) takes the slot
      from each segment's descriptor and skips (counts in `misnamed`) a segment not under that slot's keyed name;
      a read does the same for a segment whose descriptor is not the slot's.
    """

    shared = True
    """Host-wide: another process's payloads here are read in place, not fetched from it."""

    def __init__(self, capacity_bytes: int = 1 << 30, name: str = "shm", *, namespace: str = "nxkv",
                 shm_dir: str | os.PathLike[str] = DEFAULT_DIR, lease_ttl_s: float = 10.0,
                 reap_interval_s: float | None = None, mode: int = 0o600) -> None:  # fmt: skip
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self.namespace = segments.check_namespace(namespace)
        self.directory = Path(shm_dir)
        self._dir = str(self.directory)
        if not self.directory.is_dir():
            raise ValueError(f"shm_dir {str(self.directory)!r} is not a directory (the shm tier needs Linux /dev/shm "
                             "or another tmpfs)")  # fmt: skip
        self.lease_ttl_s = float(lease_ttl_s)
        self.reap_interval_s = float(reap_interval_s) if reap_interval_s is not None else self.lease_ttl_s / 2
        self.mode = mode
        self.registry = leases.LeaseRegistry(self.directory, self.namespace)
        self.lease_id: str | None = None
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._own: dict[bytes, tuple[int, float, int, int]] = {}  # slot -> (nbytes, priority, seq, inode)
        self._lineage = Lineage(lambda s: s in self._own)  # a prefix is never dropped while its continuation stays
        self._heap: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count()
        self._used = 0
        self._on_evict: EvictionCallback | None = None
        self._descs: OrderedDict[bytes, StateDescriptor] = OrderedDict()
        self._descs_lock = threading.Lock()
        self.evictions = 0
        self.reaped = 0
        self.misnamed = 0  # segments skipped: not under the keyed name of the state they hold
        self._name_key: bytes | None = None
        self.floor = 0.0
        self._stop = threading.Event()
        self.reap()
        self._thread = threading.Thread(target=self._run, name=f"nexuskv-shm-{name}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- names

    def use_name_key(self, key: bytes) -> None:
        """Name segments by `store_name(key, slot)`: the kernel calls it with the deployment's name key first.

        A store used on its own needs one too (`nexuskv.StateSeal(secret).name_key`): processes with the same key
        find each other's segments, any other key finds none. The key cannot change.
        """
        store_name(key, b"")  # ValueError for a key that is no name key
        with self._lock:
            if self._name_key is not None and not hmac.compare_digest(self._name_key, key):
                raise ConfigError(f"tier {self.name}: its name key cannot change while it is open")
            self._name_key = bytes(key)

    def _keyed(self) -> bytes:
        key = self._name_key
        if key is None:
            raise ConfigError(f"tier {self.name}: no name key (the kernel hands it over; on its own call "
                              f"use_name_key(key) first): segments are never named by slot")  # fmt: skip
        return key

    def segment_of(self, slot: bytes) -> str:
        """The name of the segment that holds (or would hold) `slot`: its keyed name, never the slot."""
        return segments.segment_name(self.namespace, store_name(self._keyed(), slot))

    def _slot_of(self, name: str, raw: bytes | None) -> tuple[bytes | None, StateDescriptor | None]:
        """(slot, descriptor) of a segment from its descriptor, the slot None unless `name` is its keyed name."""
        desc = self._descriptor(raw) if raw is not None else None
        if desc is None or self._name_key is None:
            return None, desc
        return slot_named(self._name_key, name, desc), desc

    # ---------------------------------------------------------------- leases and reaping

    def _run(self) -> None:
        every = min(self.lease_ttl_s / 3, self.reap_interval_s)
        next_reap = time.monotonic() + self.reap_interval_s
        while not self._stop.wait(every):
            try:
                self._renew()
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + self.reap_interval_s
                    self.reap()
                    self._reconcile()
            except Exception as exc:  # keep beating: a failed round is retried at the next one
                log.warning("shm lease round failed", tier=self.name, error=repr(exc))

    def _renew(self) -> None:
        with self._lock:
            lease = self.lease_id
            if lease is None or self.registry.renew(lease):
                return
            # Expired (we were stalled past the TTL) or reclaimed: others may already treat it as dead, so never
            # revive it. Drop what it owned; the next put takes a new lease.
            lost = self._drop_own(lease)
            self.registry.revoke(lease)
            self.lease_id = None
        log.warning("shm lease lost; its segments are dropped", tier=self.name, lease=lease, segments=len(lost))
        self._notify([(slot, desc, None) for slot, desc in lost])

    def _drop_own(self, lease: str) -> list[tuple[bytes, StateDescriptor]]:
        """Unlink every segment this store still owns under `lease`; forget them. Caller holds the lock."""
        lost = []
        for slot, (_, _, _, ino) in self._own.items():
            path = self._path(slot)
            meta = segments.read_meta(path)
            if meta is not None and meta[0].lease_id == lease and segments.unlink_if_same(path, ino):
                lost.append((slot, self._descriptor(meta[1])))
        self._own.clear()
        self._heap.clear()
        self._used = 0
        return lost

    def _ensure_lease(self) -> str:
        if self._pid != os.getpid():  # forked: the parent's lease and segments are not ours
            self._pid = os.getpid()
            self.lease_id = None
            self._own.clear()
            self._heap.clear()
            self._used = 0
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, name=f"nexuskv-shm-{self.name}", daemon=True)
            self._thread.start()
        if self.lease_id is None:
            self.lease_id = self.registry.grant(self.lease_ttl_s, self.mode)
            log.info("shm lease granted", tier=self.name, lease=self.lease_id, ttl_s=self.lease_ttl_s)
        return self.lease_id

    def lease_alive(self, lease_id: str) -> bool:
        """True while `lease_id` is alive (this store's own lease without a file read)."""
        if lease_id == self.lease_id and self._pid == os.getpid():
            return True
        return self.registry.alive(lease_id)

    def reap(self) -> list[str]:
        """Reclaim what dead or expired leases left in the namespace; return the names removed.

        Removed segments that were published are reported through the eviction callback (payload None), so a
        kernel in this process drops them from its index.
        """
        removed = leases.reap(self.directory, self.namespace, self.registry, grace_s=max(self.lease_ttl_s, 1.0))
        if not removed:
            return []
        self.reaped += len(removed)
        named = [self._slot_of(keyed, raw) for _, keyed, raw in removed if keyed is not None]
        gone = [(slot, desc) for slot, desc in named if slot is not None and desc is not None]
        with self._lock:
            for slot, _ in gone:
                self._forget(slot)
        log.info("shm segments reclaimed", tier=self.name, removed=len(removed), segments=len(named))
        self._notify([(slot, desc, None) for slot, desc in gone])
        return [name for name, _, _ in removed]

    def _reconcile(self) -> None:
        """Forget own slots whose segment was deleted or replaced by another process."""
        with self._lock:
            for slot, (_, _, _, ino) in list(self._own.items()):
                try:
                    same = os.stat(self._path(slot)).st_ino == ino
                except FileNotFoundError:
                    same = False
                if not same:
                    self._forget(slot)

    # ---------------------------------------------------------------- TierStore

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Be told (slot, descriptor, payload) about every eviction, expiry and reclaimed segment."""
        self._on_evict = callback

    def _path(self, slot: bytes) -> str:
        return f"{self._dir}/{self.segment_of(slot)}"

    def put(self, slot: bytes, payload: bytes | memoryview, descriptor: StateDescriptor, priority: float = 0.0,
            ttl_s: float | None = None) -> bool:  # fmt: skip
        """Publish `payload` as the slot's segment under this process's lease; False if it cannot fit.

        A live segment of another process with the same checksum is kept as is (same block, nothing to write).
        May evict this store's lower-priority segments first.
        """
        nbytes = memoryview(payload).nbytes
        if nbytes > self.capacity_bytes:
            return False
        existing = self._live_meta(slot)
        if existing is not None and existing[0].lease_id != self.lease_id:
            desc = self._descriptor(existing[1])
            if desc is not None and desc.checksum == descriptor.checksum and _is_slot(desc, slot):
                return True
        desc_bytes = json.dumps(to_dict(descriptor), separators=(",", ":")).encode()
        evicted: list[tuple[bytes, StateDescriptor, memoryview | None]] = []
        with self._lock:
            lease = self._ensure_lease()
            old = self._own.pop(slot, None)
            if old is not None:
                self._used -= old[0]
            if not self._make_room(nbytes, priority, evicted, parent_slot(slot, descriptor)):
                if old is not None:
                    self._own[slot] = old
                    self._used += old[0]
                ok = False
            else:
                expires = time.time() + ttl_s if ttl_s is not None else 0.0
                try:
                    ino = segments.write_segment(self.directory, segments.temp_name(self.namespace, lease),
                                                 self.segment_of(slot), desc_bytes, payload, lease, expires,
                                                 priority, self.mode)  # fmt: skip
                except OSError as exc:
                    log.warning("shm put failed", tier=self.name, slot=slot.hex(), error=repr(exc))
                    ok = False  # an old segment of ours may have been kept; reconcile will tell
                    if old is not None:
                        self._own[slot] = old
                        self._used += old[0]
                else:
                    seq = next(self._seq)
                    self._own[slot] = (nbytes, priority, seq, ino)
                    heapq.heappush(self._heap, (priority, seq, slot))
                    self._lineage.add(slot, descriptor)
                    self._used += nbytes
                    ok = True
        self._notify(evicted)
        return ok

    def _make_room(self, need: int, priority: float, evicted: list,  # type: ignore[type-arg]
                   protect: bytes | None = None) -> bool:  # fmt: skip
        """Evict own segments of priority <= `priority` (lowest, leaves first) until `need` more bytes fit, or none."""
        def size_of(slot: bytes, seq: int) -> int | None:
            item = self._own.get(slot)
            return item[0] if item is not None and item[2] == seq else None

        victims = pick_victims(self._heap, used=self._used, need=need, capacity=self.capacity_bytes,
                               priority=priority, size_of=size_of, lineage=self._lineage, protect=protect)  # fmt: skip
        if victims is None:
            return False
        for prio, _, slot in victims:
            self.floor = max(self.floor, prio)
            nbytes, _, _, ino = self._own.pop(slot)
            self._used -= nbytes
            path = self._path(slot)
            mapped = segments.map_segment(path)  # the payload stays readable after the unlink (kernel may demote it)
            if mapped is not None and mapped.header.lease_id == self.lease_id and segments.unlink_if_same(path, ino):
                self.evictions += 1
                desc = self._descriptor(mapped.desc)
                if desc is not None:
                    evicted.append((slot, desc, mapped.view()))
        return True

    def _forget(self, slot: bytes) -> None:
        item = self._own.pop(slot, None)
        if item is not None:
            self._used -= item[0]

    def _notify(self, evicted: list) -> None:  # type: ignore[type-arg]
        cb = self._on_evict
        if cb is not None:
            for slot, desc, data in evicted:
                cb(slot, desc, data)

    def _descriptor(self, raw: bytes) -> StateDescriptor | None:
        """The descriptor stored as `raw` JSON (parsed once per distinct bytes, then cached)."""
        with self._descs_lock:
            desc = self._descs.get(raw)
            if desc is not None:
                self._descs.move_to_end(raw)
                return desc
        try:
            desc = from_dict(StateDescriptor, json.loads(raw))
        except Exception as exc:  # a segment written by an incompatible version: a miss, not an error
            log.warning("shm segment descriptor unreadable", tier=self.name, error=repr(exc))
            return None
        with self._descs_lock:
            self._descs[raw] = desc
            if len(self._descs) > 8192:
                self._descs.popitem(last=False)
        return desc

    def _live_meta(self, slot: bytes) -> tuple[segments.Header, bytes, os.stat_result] | None:
        meta = segments.read_meta(self._path(slot))
        if meta is None or meta[0].expired(time.time()) or not self.lease_alive(meta[0].lease_id):
            return None
        return meta

    def read(self, slot: bytes, cache: segments.MapCache | None = None, populate: bool = False) -> StoredState | None:
        """Map the slot's segment and return its payload as a read-only view; None on a miss.

        A miss also when the segment is incomplete or damaged, its lease is not alive, or its TTL passed; such a
        segment is reclaimed on the spot. `cache` reuses mappings of unchanged segments (see `ShmTransport`).
        """
        path = self._path(slot)
        mapped = None
        if cache is not None:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                cache.forget(path)
                return None
            mapped = cache.lookup(path, st)
        if mapped is None:
            mapped = segments.map_segment(path, populate)
            if mapped is None:
                return None
            if cache is not None:
                cache.remember(path, mapped)
        h = mapped.header
        if h.expired(time.time()) or not self.lease_alive(h.lease_id):
            if cache is not None:
                cache.forget(path)
            self._reclaim(slot, path, mapped)
            return None
        desc = self._descriptor(mapped.desc)
        if desc is None:
            return None
        if not _is_slot(desc, slot):  # another slot's state under this slot's name (renamed, or copied here)
            self._misnamed(1)
            return None
        return StoredState(mapped.view(), desc)

    def _reclaim(self, slot: bytes, path: str, mapped: segments.Mapped) -> None:
        if segments.unlink_if_same(path, mapped.ino):
            self.reaped += 1
            with self._lock:
                self._forget(slot)
            desc = self._descriptor(mapped.desc)
            log.info("shm segment reclaimed on read", tier=self.name, slot=slot.hex(), lease=mapped.header.lease_id)
            if desc is not None:
                self._notify([(slot, desc, None)])

    def get(self, slot: bytes) -> StoredState | None:
        """The slot's payload (read-only memoryview over a fresh mapping of the segment) and descriptor, or None."""
        return self.read(slot)

    def delete(self, slot: bytes) -> bool:
        """Unlink the slot's segment, whoever wrote it (the kernel quarantines bad payloads this way)."""
        with self._lock:
            self._forget(slot)
        try:
            os.unlink(self._path(slot))
        except FileNotFoundError:
            return False
        return True

    def __contains__(self, slot: object) -> bool:
        if not isinstance(slot, bytes):
            return False
        meta = self._live_meta(slot)
        desc = self._descriptor(meta[1]) if meta is not None else None
        return desc is not None and _is_slot(desc, slot)

    def _misnamed(self, n: int) -> None:
        self.misnamed += n
        log.warning("shm segments not under the keyed name of their state skipped (renamed, planted, another "
                    "secret's, or named by raw slot before names were keyed)", tier=self.name, segments=n)  # fmt: skip

    def _listing(self) -> list[tuple[bytes, StateDescriptor]]:
        """(slot, descriptor) of every live segment of the namespace under its state's keyed name (a snapshot).

        The slot is the descriptor's; the name is only checked against it (`slot_named`), never parsed.
        """
        self._keyed()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        out, skipped, now = [], 0, time.time()
        for entry in entries:
            parsed = segments.parse_name(self.namespace, entry.name)
            if parsed is None or parsed[0] != segments.SEGMENT:
                continue
            meta = segments.read_meta(entry.path)
            if meta is None or meta[0].expired(now) or not self.lease_alive(meta[0].lease_id):
                continue
            slot, desc = self._slot_of(parsed[1], meta[1])
            if slot is None or desc is None:
                skipped += desc is not None
                continue
            out.append((slot, desc))
        if skipped:
            self._misnamed(skipped)
        return out

    def slots(self) -> Iterator[bytes]:
        """Every slot with a live segment on the host under its keyed name (a snapshot)."""
        return iter([slot for slot, _ in self._listing()])

    def descriptors(self) -> Iterator[tuple[bytes, StateDescriptor]]:
        """(slot, descriptor) of every live segment on the host, from the headers (payloads are not mapped)."""
        return iter(self._listing())

    def used_bytes(self) -> int:
        """Payload bytes of the segments this store wrote and still owns."""
        return self._used

    def __len__(self) -> int:
        return len(self._own)

    def close(self) -> None:
        """Stop the lease thread, unlink this store's segments and end its lease (no eviction callbacks)."""
        self._stop.set()
        if self._thread is not threading.current_thread() and not sys.is_finalizing():
            self._thread.join(timeout=2.0)
        with self._lock:
            lease = self.lease_id
            if lease is not None and self._pid == os.getpid():
                self._drop_own(lease)
                self.registry.revoke(lease)
            self.lease_id = None


def _is_slot(desc: StateDescriptor, slot: bytes) -> bool:
    """True when `desc` describes the state of `slot` (its block key and group)."""
    return len(slot) == 17 and desc.group == slot[-1] and desc.key == slot[:-1].hex()
