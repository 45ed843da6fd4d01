"""The Mooncake Store tier: payloads and their descriptors as Mooncake objects, moved through registered memory.

Each slot is one object `{prefix}/{name}`, `name` the slot's keyed name (`nexuskv.store_name`, never the slot): a
small header (the descriptor as JSON) followed by the payload, so a reader on any node gets both in one read, and
the kernel verifies the descriptor's checksum on what it gets. A put
copies header and payload into a registered staging buffer and `put_from`s it; a get is one `get_buffer` into the
client's registered local buffer, returned as a memoryview (no further copy; the memory goes back to Mooncake when
the last view of it is released). Capacity, priorities and LRU order are kept in this process.
"""

from __future__ import annotations

import contextlib
import heapq
import hmac
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

from nexuskv import (
    ConfigError,
    EvictionCallback,
    Lineage,
    StateDescriptor,
    StoredState,
    get_logger,
    parent_slot,
    pick_victims,
    slot_of,
    store_name,
)
from nexuskv_tier_mooncake._link import MasterLink, MooncakeTierError
from nexuskv_tier_mooncake.mooncake_client import (
    NO_ROOM,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    load_mooncake,
    split_address,
)
from nexuskv_tier_mooncake.object_format import Entry, decode_descriptor, encode_header, header_length

__all__ = ["MooncakeStore", "MooncakeTierError"]

MIN_SEGMENT = 16 << 20  # Mooncake refuses a smaller global segment

log = get_logger(__name__)

_Evicted = list[tuple[bytes, StateDescriptor, None]]


class MooncakeStore:
    """A tier store in a Mooncake Store, bounded in bytes, evicting lowest priority first (LRU among equals).

    Options (keywords, as in a kernel's `[tiers.<name>]` table): `master`, the master's `host:port`;
    `capacity_bytes`; `prefix` of every object key; `segment_bytes`, the memory this process contributes to the
    store (default: 1.25 x `capacity_bytes`, at least 16 MiB, so Mooncake's own eviction at its 90% watermark stays
    idle; 0 when other processes provide the memory); `local_buffer_bytes`, the client's registered buffer that
    gets read into; `local_hostname`, `metadata_server`, `protocol`, `device_name` as in Mooncake's `setup`;
    `lease_ttl_s`, the master's `--default_kv_lease_ttl` (how long a read blocks a removal); `force_remove` to
    remove objects under a read lease anyway; `down_backoff_s`, how long calls fail at once after the master was
    found unreachable; `probe_timeout_s`, the longest wait for the master's port to answer; `probe_interval_s`,
    how often a watcher thread probes it (0: only after a failed call); `rpc_timeout_s`, the longest a call waits
    on a master that accepts connections but does not answer (Mooncake's `MC_RPC_TIMEOUT_MS`, set for the process
    unless already set); `sync_interval_s`, how often the objects held are checked against the master (Mooncake
    evicts on its own).

    Calls raise `MooncakeTierError` when the master is unreachable, within `probe_timeout_s`, never Mooncake's own
    retry loops (tens of seconds). Objects found gone (evicted by Mooncake, lost with a restarted master) are
    reported through the eviction callback, so the kernel's index stays exact.

    Object keys are the slots' keyed names under the name key the kernel hands over (`use_name_key`) before
    anything else; until then `put` / `get` / `delete` raise `ConfigError`. A read whose object's descriptor is not
    the slot's (an object renamed or copied under this slot's key) is dropped, never served (`misnamed`).
    """

    shared = True
    """Every node on this Mooncake cluster reads it: another node's payloads here are read in place."""

    def __init__(
        self,
        name: str = "mooncake",
        master: str = "127.0.0.1:50051",
        capacity_bytes: int = 1 << 30,
        prefix: str = "nexuskv",
        segment_bytes: int | None = None,
        local_buffer_bytes: int = 128 << 20,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
        lease_ttl_s: float = 10.0,
        force_remove: bool = False,
        down_backoff_s: float = 0.5,
        probe_timeout_s: float = 0.25,
        sync_interval_s: float = 5.0,
        probe_interval_s: float = 0.05,
        rpc_timeout_s: float = 2.0,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not prefix or "/" in prefix:
            raise ValueError(f"prefix must be non-empty and hold no '/', got {prefix!r}")
        if local_buffer_bytes <= 0:
            raise ValueError(f"local_buffer_bytes must be positive, got {local_buffer_bytes}")
        address = split_address(master)
        mooncake = load_mooncake()
        self.name = name
        self.master = master
        self.capacity_bytes = int(capacity_bytes)
        self.prefix = prefix
        if segment_bytes is None:
            segment_bytes = max(MIN_SEGMENT, -(-self.capacity_bytes * 5 // 4))
        if segment_bytes != 0 and segment_bytes < MIN_SEGMENT:
            raise ValueError(f"segment_bytes must be 0 (no memory of this process) or at least 16 MiB (Mooncake's "
                             f"minimum), got {segment_bytes}")  # fmt: skip
        self.segment_bytes = int(segment_bytes)
        self.local_buffer_bytes = int(local_buffer_bytes)
        self.lease_ttl_s = float(lease_ttl_s)
        self.force_remove = bool(force_remove)
        self.sync_interval_s = float(sync_interval_s)
        self._entries: dict[str, Entry] = {}
        self._slots: dict[bytes, Entry] = {}
        self._lineage = Lineage(lambda s: s in self._slots)
        self._heap: list[tuple[float, int, bytes]] = []
        self._deadlines: list[tuple[float, int, bytes]] = []
        self._doomed: dict[str, tuple[float, int]] = {}  # key -> (retry at, bytes): removals waiting on a lease
        self._pending_bytes = 0
        self._seq = itertools.count()
        self._used = 0
        self._lock = threading.RLock()  # local metadata; never held across a Mooncake call
        self._write_lock = threading.Lock()  # one put / delete / flush at a time (held across its calls)
        self._on_evict: EvictionCallback | None = None
        self.evictions = 0
        self.floor = 0.0  # priority of the most valuable payload evicted so far (GreedyDual's L)
        self._resync = False  # the last check got no answer for some objects
        self._name_key: bytes | None = None
        self.misnamed = 0  # objects read under a slot's key whose descriptor is another slot's
        self._last_sync = time.monotonic()
        self._link = MasterLink(name, mooncake, master, address,
                                (local_hostname, metadata_server, self.segment_bytes, self.local_buffer_bytes,
                                 protocol, device_name, master),
                                down_backoff_s=float(down_backoff_s), probe_timeout_s=float(probe_timeout_s),
                                probe_interval_s=float(probe_interval_s), rpc_timeout_s=float(rpc_timeout_s),
                                on_recover=self._recovered)  # fmt: skip
        try:
            self._connected()
        except MooncakeTierError as exc:
            log.error("mooncake master unreachable at start; the tier starts empty and connects once it answers",
                      tier=name, master=master, error=str(exc))  # fmt: skip

    @property
    def client(self) -> Any:
        """The `mooncake.store.MooncakeDistributedStore` this store uses (None until the master first answered)."""
        return self._link.client

    def _connected(self) -> Any:
        """The client; raises `MooncakeTierError` at once while the master does not answer (see `MasterLink`)."""
        client = self._link.connected()
        if self._resync:
            self._sync(client)
        return client

    # ------------------------------------------------------------------------------------------ TierStore

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Be told (slot, descriptor, None) about every eviction, expiry and object found gone."""
        self._on_evict = callback

    def _notify(self, evicted: _Evicted) -> None:
        cb = self._on_evict
        if cb is not None:
            for slot, desc, data in evicted:
                cb(slot, desc, data)

    def use_name_key(self, key: bytes) -> None:
        """Name objects by `store_name(key, slot)`: the kernel calls it with the deployment's name key first.

        A store used on its own needs one too (`nexuskv.StateSeal(secret).name_key`): clients with the same key
        share objects, any other key finds none. The key cannot change.
        """
        store_name(key, b"")  # ValueError for a key that is no name key
        if self._name_key is not None and not hmac.compare_digest(self._name_key, key):
            raise ConfigError(f"tier {self.name}: its name key cannot change while it is open")
        self._name_key = bytes(key)

    def key_of(self, slot: bytes) -> str:
        """The Mooncake object key of a slot: `{prefix}/{store_name(name key, slot)}`, never the slot."""
        key = self._name_key
        if key is None:
            raise ConfigError(f"tier {self.name}: no name key (the kernel hands it over; on its own call "
                              f"use_name_key(key) first): objects are never named by slot")  # fmt: skip
        return f"{self.prefix}/{store_name(key, slot)}"

    def put(self, slot: bytes, payload: bytes | memoryview, descriptor: StateDescriptor, priority: float = 0.0,
            ttl_s: float | None = None) -> bool:  # fmt: skip
        """Store `payload` and its descriptor as one object, evicting lower priority first. False if it cannot fit.

        An object already there under the key is kept (keys are content addressed: it is the same state) and the
        put succeeds. A slot whose removal still waits on a reader's lease is not stored again until it is gone.
        Raises `MooncakeTierError` when the master is unreachable (nothing changes then).
        """
        key = self.key_of(slot)  # ConfigError without a name key
        view = memoryview(payload).cast("B")
        header = encode_header(descriptor)
        size = len(header) + view.nbytes
        if size > self.capacity_bytes or (ttl_s is not None and ttl_s <= 0):
            return False
        expired: _Evicted = []
        with self._write_lock:
            client = self._connected()
            try:
                self._housekeeping(client, expired)
            except BaseException:
                self._notify(expired)  # what expired before the failure is gone: the kernel hears of it
                raise
            if key in self._doomed and not self._remove_doomed(client, key):
                self._notify(expired)
                return False
            with self._lock:
                old = self._slots.get(slot)
                victims = self._victims(size - (old.size if old is not None else 0), priority, slot,
                                        parent_slot(slot, descriptor))  # fmt: skip
            if victims is None:
                self._notify(expired)
                return False
            evicted: _Evicted = []
            refused = False
            try:
                for v in victims:
                    refused |= not self._remove(client, v.key, v.size)  # a read lease: its room comes later
                    with self._lock:
                        s = slot_of(bytes.fromhex(v.descriptor.key), v.descriptor.group)  # never parsed from the key
                        if self._forget(s, v):
                            self.floor = max(self.floor, v.priority)  # GreedyDual aging
                            self.evictions += 1
                            evicted.append((s, v.descriptor, None))
                if refused:  # storing now would go over capacity until the lease ends: refuse, as a full tier does
                    self._notify(expired + evicted)
                    return False
                rc = self._link.put_object(client, key, header, view)
            except BaseException:
                self._notify(expired + evicted)
                raise
            if rc in NO_ROOM:
                log.warning("mooncake store full; payload not stored", tier=self.name, key=key, code=rc)
                self._last_sync = 0.0  # Mooncake is evicting on its own: look at what is left on the next call
                self._notify(expired + evicted)
                return False
            if rc not in (0, OBJECT_ALREADY_EXISTS):
                log.warning("mooncake put refused; payload not stored", tier=self.name, key=key, code=rc)
                self._notify(expired + evicted)
                return False
            entry = Entry(key=key, descriptor=descriptor, header=header, size=size, priority=priority,
                          seq=next(self._seq), expires=time.monotonic() + ttl_s if ttl_s is not None else None)
            with self._lock:
                self._forget(slot, self._slots.get(slot))
                self._slots[slot] = self._entries[key] = entry
                self._lineage.add(slot, descriptor)
                self._used += size
                heapq.heappush(self._heap, (priority, entry.seq, slot))
                if entry.expires is not None:
                    heapq.heappush(self._deadlines, (entry.expires, entry.seq, slot))
        self._notify(expired + evicted)
        return True

    def _victims(self, need: int, priority: float, slot: bytes, protect: bytes | None) -> list[Entry] | None:
        """Entries to evict (never above `priority`, never `slot`, leaves first) so `need` more bytes fit, or None."""

        def size_of(s: bytes, seq: int) -> int | None:
            e = self._slots.get(s)
            return e.size if e is not None and e.seq == seq else None

        picked = pick_victims(self._heap, used=self._used + self._pending_bytes, need=need,
                              capacity=self.capacity_bytes, priority=priority, size_of=size_of, keep=slot,
                              lineage=self._lineage, protect=protect)  # fmt: skip
        if picked is None:
            return None
        for item in picked:  # the entries stay until their removal went through; their heap entries too
            heapq.heappush(self._heap, item)
        return [self._slots[s] for _, _, s in picked]

    def _forget(self, slot: bytes, entry: Entry | None) -> bool:
        """Drop `slot` from the local metadata if it still is `entry` (lock held)."""
        if entry is None or self._slots.get(slot) is not entry:
            return False
        del self._slots[slot]
        del self._entries[entry.key]
        self._used -= entry.size
        return True

    def get(self, slot: bytes) -> StoredState | None:
        """The payload (a memoryview of Mooncake's registered local buffer) and descriptor of `slot`, or None.

        One `get_buffer`; when the local buffer is exhausted (readers still hold earlier payloads), one `get_into`
        a registered scratch buffer and a copy. A slot this process never stored is read too (the tier is shared).
        An object found gone is reported as evicted.
        """
        key = self.key_of(slot)  # ConfigError without a name key
        with self._lock:
            e = self._slots.get(slot)
            gone: _Evicted = []
            if e is not None and e.expires is not None and e.expires <= time.monotonic():
                self._forget(slot, e)
                self._doom(e.key, e.size)
                gone.append((slot, e.descriptor, None))
        if gone:
            self._notify(gone)
            return None
        key = e.key if e is not None else key
        if e is None and key in self._doomed:  # deleted here; its removal waits on a lease
            return None
        client = self._link.enter()  # counted: close waits for this read before it closes the client
        try:
            if self._resync:
                self._sync(client)
            return self._read(slot, e, key, client)
        finally:
            self._link.leave()

    def _read(self, slot: bytes, e: Entry | None, key: str, client: Any) -> StoredState | None:
        handle = client.get_buffer(key)
        if handle is not None:
            view = memoryview(handle).cast("B")  # Mooncake exports signed chars ("b")
        else:
            view = self._link.read_copy(client, key)
            if view is None:
                return self._gone(slot, e)
        try:
            n = header_length(view)
            head = view[:n]
            desc = e.descriptor if e is not None and head == e.header else decode_descriptor(head)
        except ValueError as exc:
            return self._bad(slot, e, key, str(exc))
        if desc.key != slot[:-1].hex() or desc.group != slot[-1]:  # another slot's object under this slot's key
            self.misnamed += 1
            return self._bad(slot, e, key, "another slot's state under this slot's key (renamed or copied)")
        if e is not None:
            with self._lock:
                if self._slots.get(slot) is e:
                    e.seq = next(self._seq)
                    heapq.heappush(self._heap, (e.priority, e.seq, slot))
                    if len(self._heap) > 2 * len(self._slots) + 64:
                        self._compact()
        return StoredState(view[n:], desc)

    def _gone(self, slot: bytes, e: Entry | None) -> None:
        """The object is not in Mooncake (evicted there, or lost with a restarted master): report it."""
        if e is None:
            return None
        with self._lock:
            forgot = self._forget(slot, e)
        if forgot:
            log.info("mooncake object gone; reported as evicted", tier=self.name, key=e.key)
            self._notify([(slot, e.descriptor, None)])
        return None

    def _bad(self, slot: bytes, e: Entry | None, key: str, why: str) -> None:
        log.warning("mooncake object unusable; dropped", tier=self.name, key=key, reason=why)
        with self._lock:
            forgot = e is not None and self._forget(slot, e)
            self._doom(key, e.size if forgot and e is not None else 0)
        if forgot and e is not None:
            self._notify([(slot, e.descriptor, None)])
        return None

    def delete(self, slot: bytes) -> bool:
        """Drop a payload; True if it was held. Deletion is not an eviction: no callback.

        The slot is forgotten at once. Mooncake refuses to remove an object while a reader holds its lease (a
        get grants one for `lease_ttl_s`): the removal is then retried once the lease has run out (on later calls,
        or `flush_removals`), and `used_bytes` counts the object until it went through.
        """
        self.key_of(slot)  # ConfigError without a name key
        with self._write_lock:
            with self._lock:
                e = self._slots.get(slot)
                if e is None or not self._forget(slot, e):
                    return False
                self._doom(e.key, e.size)
            with contextlib.suppress(MooncakeTierError):  # stays queued: retried once the master answers
                self._remove_doomed(self._connected(), e.key)
            return True

    def _doom(self, key: str, size: int) -> None:
        """Queue `key` for removal (lock held)."""
        if key not in self._doomed:
            self._pending_bytes += size
            self._doomed[key] = (time.monotonic(), size)

    def _remove_doomed(self, client: Any, key: str) -> bool:
        """Try one queued removal now; True when the object is gone."""
        _, size = self._doomed[key]
        if not self._remove(client, key, size):
            return False
        with self._lock:
            if self._doomed.pop(key, None) is not None:
                self._pending_bytes -= size
        return True

    def _remove(self, client: Any, key: str, size: int) -> bool:
        """Remove one object; False (and queued) while a reader's lease blocks it."""
        rc = self._link.check(client.remove(key, self.force_remove), "remove")
        if rc in (0, OBJECT_NOT_FOUND):
            return True
        if rc == OBJECT_HAS_LEASE:
            log.info("mooncake object under a read lease; removal retried when it ends", tier=self.name, key=key)
        else:
            log.warning("mooncake remove refused; retried later", tier=self.name, key=key, code=rc)
        with self._lock:
            self._doom(key, size)
            self._doomed[key] = (time.monotonic() + self.lease_ttl_s, self._doomed[key][1])
        return False

    def flush_removals(self) -> int:
        """Retry every queued removal now (ignoring when their leases end); returns how many are still queued."""
        with self._write_lock:
            client = self._connected()
            for key in list(self._doomed):
                self._remove_doomed(client, key)
            return len(self._doomed)

    @property
    def pending_removals(self) -> int:
        """Objects deleted or evicted here whose removal from Mooncake still waits (a read lease, a down master)."""
        return len(self._doomed)

    def _housekeeping(self, client: Any, out: _Evicted) -> None:
        """Before a write (write lock held): expire TTLs, retry due removals, re-check what is held when due."""
        now = time.monotonic()
        with self._lock:
            dl = self._deadlines
            while dl and dl[0][0] <= now:
                _, _seq, slot = heapq.heappop(dl)
                e = self._slots.get(slot)
                if e is not None and e.expires is not None and e.expires <= now and self._forget(slot, e):
                    self._doom(e.key, e.size)
                    out.append((slot, e.descriptor, None))
            due = [k for k, (at, _) in self._doomed.items() if at <= now]
        for key in due:
            self._remove_doomed(client, key)
        if now - self._last_sync >= self.sync_interval_s:
            self._sync(client)

    def sync(self) -> int:
        """Check every object held against the master; those gone are reported as evicted. Returns how many."""
        client = self._link.enter()  # counted as a reader: close (and release_abandoned) never close it under this
        try:
            return self._sync(client)
        finally:
            self._link.leave()

    def _recovered(self) -> None:
        """The master answers again after a failure: it may have restarted, and lost every object."""
        self._sync(self._link.client)

    def _sync(self, client: Any) -> int:
        self._last_sync = time.monotonic()
        with self._lock:
            held = list(self._slots.items())
        gone: _Evicted = []
        unknown = 0
        for i in range(0, len(held), 512):
            part = held[i : i + 512]
            found = client.batch_is_exist([e.key for _, e in part])
            with self._lock:
                for (slot, e), there in zip(part, found, strict=True):
                    if there == 0 and self._forget(slot, e):
                        gone.append((slot, e.descriptor, None))
                    elif there < 0:
                        unknown += 1
        self._resync = unknown > 0  # not answered (the master just came back?): look again on the next call
        if unknown:
            log.info("mooncake master did not answer for some objects; checked again on the next call",
                     tier=self.name, objects=unknown)  # fmt: skip
        if gone:
            log.warning("mooncake store dropped payloads (evicted there, or the master restarted)", tier=self.name,
                        payloads=len(gone))  # fmt: skip
            self._notify(gone)
        return len(gone)

    def _compact(self) -> None:
        self._heap = [(e.priority, e.seq, s) for s, e in self._slots.items()]
        heapq.heapify(self._heap)

    def __contains__(self, slot: object) -> bool:
        return slot in self._slots

    def slots(self) -> Iterator[bytes]:
        """Every slot held (a snapshot of the local metadata)."""
        with self._lock:
            return iter(list(self._slots))

    def used_bytes(self) -> int:
        """Bytes held now: objects held, and objects whose removal still waits on a lease (header bytes included)."""
        return self._used + self._pending_bytes

    def __len__(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        """Close the client (objects in this process's segment go with it); never waits on a dead master.

        Puts and deletes finish first (the write lock), reads too (counted); calls after close raise.
        """
        with self._write_lock:
            self._link.close()
