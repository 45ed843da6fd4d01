"""The Redis tier store: payloads and descriptors in a Redis server, chunked, written atomically, read in one trip.

Each slot is one Redis hash `{prefix}:{tenant}:{name}` (`name` the slot's keyed name, never the slot) holding the
metadata record, a write token and the payload in chunks, so one MULTI/EXEC writes it (readers never see half a
value), one HMGET reads it back, and one EXPIRE / DEL covers all of it. Capacity and priority eviction are enforced
from metadata kept in this process.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis

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
    slot_of,
    store_name,
)
from nexuskv_tier_redis.client import make_client, where
from nexuskv_tier_redis.layout import (
    META,
    TOKEN,
    Entry,
    chunk_fields,
    decode_meta,
    encode_meta,
    glob_escape,
    parse_key,
    slot_key,
    tenant_prefix,
)

__all__ = ["RedisStore", "RedisTierError", "TenantView"]

log = get_logger(__name__)

T = TypeVar("T")
_Evicted = list[tuple[bytes, StateDescriptor, None]]


class RedisTierError(ConnectionError):
    """The Redis server could not be reached or did not answer in time (the kernel counts it on the breaker)."""


class RedisStore:
    """A tier store in a Redis server, bounded in bytes, evicting lowest priority first (LRU among equals).

    Options (all keyword, as in a kernel's `[tiers.<name>]` table): `url` of the server; `capacity_bytes`;
    `prefix` of every key; `chunk_bytes`, the largest single value written; `connect_timeout_s` and
    `read_timeout_s`, the longest any call waits on the server; `default_ttl_s`, the TTL of payloads put without
    one; `down_backoff_s`, how long calls fail at once after the server was found unreachable; `verify_crc` to
    store a crc32 with every put and check it on every read (off by default: the kernel re-verifies the
    descriptor's checksum wherever it restores a payload); `username` /
    `password` for the server. Calls raise `RedisTierError` when the server is unreachable; they never wait longer
    than the timeouts. Keys found missing on the server (TTL, a flush, a restart without persistence) are
    reported through the eviction callback, so the kernel's index stays exact.

    Keys are named by the slot's keyed name (`store_name`), under the name key the kernel hands over
    (`use_name_key`) before anything else: the server is read only then, and until then `put` / `get` / `delete`
    raise `ConfigError`. Reading the server back takes each slot from the descriptor stored under a key and skips
    (counts in `misnamed`) a key that is not that slot's keyed name under that descriptor's tenant.
    """

    shared = True
    """Every node that uses this server reads it: another node's payloads here are read in place."""

    def __init__(
        self,
        name: str = "redis",
        url: str = "redis://127.0.0.1:6379/0",
        capacity_bytes: int = 1 << 30,
        prefix: str = "nexuskv",
        chunk_bytes: int = 4 << 20,
        connect_timeout_s: float = 0.5,
        read_timeout_s: float = 2.0,
        default_ttl_s: float | None = None,
        down_backoff_s: float = 0.5,
        verify_crc: bool = False,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if not prefix or ":" in prefix:
            raise ValueError(f"prefix must be non-empty and hold no ':', got {prefix!r}")
        self.name = name
        self.url = url
        self.capacity_bytes = int(capacity_bytes)
        self.prefix = prefix
        self.chunk_bytes = int(chunk_bytes)
        self.connect_timeout_s = float(connect_timeout_s)
        self.read_timeout_s = float(read_timeout_s)
        self.default_ttl_s = default_ttl_s
        self.down_backoff_s = float(down_backoff_s)
        self.verify_crc = verify_crc
        self._client = make_client(url, self.connect_timeout_s, self.read_timeout_s, username=username,
                                   password=password)  # fmt: skip
        self._where = where(self._client)
        self._entries: dict[bytes, Entry] = {}
        self._lineage = Lineage(lambda s: s in self._entries)  # a prefix is never dropped while its continuation stays
        self._heap: list[tuple[float, int, bytes]] = []
        self._deadlines: list[tuple[float, int, bytes]] = []  # (expires, seq, slot) of payloads with a TTL
        self._seq = itertools.count()
        self._used = 0
        self._lock = threading.RLock()  # local metadata; never held across a server call
        self._write_lock = threading.Lock()  # one put / delete at a time (held across its server call)
        self._on_evict: EvictionCallback | None = None
        self.evictions = 0
        self.floor = 0.0  # priority of the most valuable payload evicted so far (GreedyDual's L)
        self._down_until = 0.0
        self._last_error = ""
        self._suspect = False  # a call failed since the last success: check for a server restart first
        self._run_id: str | None = None
        self._name_key: bytes | None = None
        self.misnamed = 0  # keys skipped when reading the server back: not the keyed name of their state

    def use_name_key(self, key: bytes) -> None:
        """Name keys by `store_name(key, slot)`, then (the first time) read what the server holds back.

        The kernel calls it with the deployment's name key before anything else; a store used on its own needs one
        too (`nexuskv.StateSeal(secret).name_key`: the same secret finds the same keys). The key cannot change.
        """
        store_name(key, b"")  # ValueError for a key that is no name key
        if self._name_key is not None:
            if not hmac.compare_digest(self._name_key, key):
                raise ConfigError(f"tier {self.name}: its name key cannot change while it is open")
            return
        self._name_key = bytes(key)
        try:
            self._run_id = self._server_id()
            self._adopt(self._scan())
        except RedisTierError as exc:
            self._run_id = None  # read back in full once the server answers
            log.error("redis tier unreachable at start; it starts empty and re-reads the server once it answers",
                      tier=self.name, server=self._where, error=str(exc))  # fmt: skip

    def _keyed(self) -> bytes:
        key = self._name_key
        if key is None:
            raise ConfigError(f"tier {self.name}: no name key (the kernel hands it over; on its own call "
                              f"use_name_key(key) first): keys are never named by slot")  # fmt: skip
        return key

    # ------------------------------------------------------------------------------------------ server calls

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one server call; connection problems become `RedisTierError` and fail fast for a while."""
        now = time.monotonic()
        if now < self._down_until:
            raise RedisTierError(f"redis tier {self.name!r} at {self._where} unavailable "
                                 f"(retrying in {self._down_until - now:.2f} s): {self._last_error}")  # fmt: skip
        if self._suspect:
            self._suspect = False
            self._recover()
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: BaseException) -> RedisTierError:
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._down_until = time.monotonic() + self.down_backoff_s
        self._suspect = True
        log.warning("redis tier call failed", tier=self.name, server=self._where, error=self._last_error)
        return RedisTierError(f"redis tier {self.name!r} at {self._where} unavailable: {self._last_error}")

    def _server_id(self) -> str:
        try:
            return str(self._client.info("server")["run_id"])
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise self._failed(exc) from exc

    def _recover(self) -> None:
        """After a failure: if the server restarted (new run id), re-read what it holds and report what is gone."""
        run_id = self._server_id()
        if run_id == self._run_id:
            return
        self._run_id = run_id
        if self._name_key is None:  # nothing was read yet: `use_name_key` reads the server
            return
        log.warning("redis server restarted; re-reading the tier", tier=self.name, server=self._where)
        try:
            found = self._scan()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._run_id = None  # try again after the next failure
            raise self._failed(exc) from exc
        self._adopt(found)

    def _scan(self) -> dict[bytes, Entry]:
        """Every slot under this store's prefix, from the metadata records on the server (no payload reads).

        A slot is the one its descriptor names, kept only when its key is that slot's keyed name under the
        descriptor's tenant; any other key (renamed, planted, another secret's, an older version's raw slot name) is
        skipped and counted, never deleted (the server is shared).
        """
        name_key = self._keyed()
        found: dict[bytes, Entry] = {}
        skipped = [0]
        match = glob_escape(self.prefix) + ":*"
        batch: list[bytes] = []

        def flush() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key in batch:
                pipe.hget(key, META)
                pipe.pttl(key)
            res = pipe.execute()
            for i, key in enumerate(batch):
                raw, pttl = res[2 * i], res[2 * i + 1]
                parsed = parse_key(self.prefix, key)
                if raw is None or parsed is None or pttl == -2:
                    continue
                try:
                    entry = decode_meta(key, raw, pttl, next(self._seq))
                except ValueError as exc:
                    log.warning("unreadable redis tier entry skipped", tier=self.name, key=key.decode(errors="replace"),
                                error=str(exc))  # fmt: skip
                    continue
                desc = entry.descriptor
                s = slot_named(name_key, parsed[1], desc)
                if s is None or key != slot_key(self.prefix, desc.namespace.tenant, parsed[1]):
                    skipped[0] += 1
                    continue
                found[s] = entry
            batch.clear()

        try:
            for key in self._client.scan_iter(match=match, count=1000, _type="hash"):
                batch.append(key)
                if len(batch) >= 500:
                    flush()
            if batch:
                flush()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise self._failed(exc) from exc
        if skipped[0]:
            self.misnamed += skipped[0]
            log.warning("redis tier keys not under the keyed name of their state skipped (renamed, planted, another "
                        "secret's, or named by raw slot before names were keyed)", tier=self.name,
                        keys=skipped[0])  # fmt: skip
        return found

    def _adopt(self, found: dict[bytes, Entry]) -> None:
        """Replace the local metadata with `found`; entries that are gone (or were rewritten) are reported."""
        with self._lock:
            gone: _Evicted = [(s, e.descriptor, None) for s, e in self._entries.items()
                              if s not in found or found[s].token != e.token]  # fmt: skip
            self._entries = found
            self._lineage.clear()
            for s, e in found.items():
                self._lineage.add(s, e.descriptor)
            self._used = sum(e.size for e in found.values())
            self._compact()
        if gone:
            log.warning("redis tier lost payloads (expired, flushed or server restarted)", tier=self.name,
                        payloads=len(gone))  # fmt: skip
        self._notify(gone)

    # ------------------------------------------------------------------------------------------ TierStore

    def set_eviction_callback(self, callback: EvictionCallback | None) -> None:
        """Be told (slot, descriptor, None) about every eviction, expiry and payload found gone."""
        self._on_evict = callback

    def _notify(self, evicted: _Evicted) -> None:
        cb = self._on_evict
        if cb is not None:
            for slot, desc, data in evicted:
                cb(slot, desc, data)

    def key_of(self, slot: bytes, tenant: str) -> bytes:
        """The Redis key of a slot of a tenant: `{prefix}:{tenant}:{store_name(name key, slot)}`."""
        return slot_key(self.prefix, tenant, store_name(self._keyed(), slot))

    def put(self, slot: bytes, payload: bytes | memoryview, descriptor: StateDescriptor, priority: float = 0.0,
            ttl_s: float | None = None) -> bool:  # fmt: skip
        """Store `payload` in one transaction; evict lower-priority payloads to make room. False if it cannot fit.

        `ttl_s` (default `default_ttl_s`) becomes the key's expiry on the server. Raises `RedisTierError` when
        the server is unreachable (nothing changes then).
        """
        view = memoryview(payload).cast("B")
        size = view.nbytes
        ttl = ttl_s if ttl_s is not None else self.default_ttl_s
        if size > self.capacity_bytes or (ttl is not None and ttl <= 0):
            return False
        key = self.key_of(slot, descriptor.namespace.tenant)
        cb = self.chunk_bytes
        parts = [view[i : i + cb] for i in range(0, size, cb)]
        lengths = tuple(p.nbytes for p in parts)
        crc: int | None = None
        if self.verify_crc:  # the kernel verifies the descriptor's checksum anyway: only on request
            crc = 0
            for p in parts:
                crc = zlib.crc32(p, crc)
        token = os.urandom(8).hex().encode()
        meta = encode_meta(descriptor, lengths, token, crc, priority, ttl)
        expired: _Evicted = []
        with self._write_lock:
            with self._lock:
                self._purge_expired(expired)
                old = self._entries.get(slot)
                victims = self._victims(size - (old.size if old is not None else 0), priority, slot,
                                        parent_slot(slot, descriptor))
            if victims is None:
                self._notify(expired)
                return False
            drop = [v.key for v in victims]
            if old is not None and old.key != key:
                drop.append(old.key)
            fields: dict[bytes, bytes | memoryview] = {META: meta, TOKEN: token}
            fields.update(zip(chunk_fields(len(parts)), parts, strict=True))
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(key, *drop)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            if ttl is not None:
                pipe.pexpire(key, max(1, round(ttl * 1e3)))
            try:
                self._call(pipe.execute)
            except RedisTierError:
                self._notify(expired)
                raise
            except redis.ResponseError as exc:
                if not isinstance(exc, redis.exceptions.OutOfMemoryError) and "maxmemory" not in str(exc):
                    raise
                log.warning("redis server full (maxmemory); payload not stored", tier=self.name, error=str(exc))
                self._notify(expired)
                return False
            entry = Entry(key=key, descriptor=descriptor, size=size, chunks=lengths, token=token, crc=crc,
                          priority=priority, seq=next(self._seq),
                          expires=time.monotonic() + ttl if ttl is not None else None)  # fmt: skip
            evicted: _Evicted = []
            with self._lock:
                for v in victims:
                    s = slot_of(bytes.fromhex(v.descriptor.key), v.descriptor.group)  # never parsed from the key
                    if self._forget(s, v):
                        self.floor = max(self.floor, v.priority)  # GreedyDual aging
                        self.evictions += 1
                        evicted.append((s, v.descriptor, None))
                self._forget(slot, self._entries.get(slot))
                self._entries[slot] = entry
                self._lineage.add(slot, descriptor)
                self._used += size
                heapq.heappush(self._heap, (priority, entry.seq, slot))
                if entry.expires is not None:
                    heapq.heappush(self._deadlines, (entry.expires, entry.seq, slot))
        self._notify(expired + evicted)
        return True

    def _forget(self, slot: bytes, entry: Entry | None) -> bool:
        """Drop `slot` from the local metadata if it still is `entry` (lock held)."""
        if entry is None or self._entries.get(slot) is not entry:
            return False
        del self._entries[slot]
        self._used -= entry.size
        return True

    def _purge_expired(self, out: _Evicted) -> None:
        """Drop entries whose TTL passed (the server has dropped their keys too); lock held."""
        now = time.monotonic()
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, _seq, slot = heapq.heappop(dl)
            e = self._entries.get(slot)
            if e is not None and e.expires is not None and e.expires <= now and self._forget(slot, e):
                out.append((slot, e.descriptor, None))

    def _victims(self, need: int, priority: float, slot: bytes, protect: bytes | None = None) -> list[Entry] | None:
        """Entries to evict (never above `priority`, never `slot`, leaves first) so `need` more bytes fit, or None."""

        def size_of(s: bytes, seq: int) -> int | None:
            e = self._entries.get(s)
            return e.size if e is not None and e.seq == seq else None

        picked = pick_victims(self._heap, used=self._used, need=need, capacity=self.capacity_bytes,
                              priority=priority, size_of=size_of, keep=slot, lineage=self._lineage,
                              protect=protect)  # fmt: skip
        if picked is None:
            return None
        for item in picked:  # the entries stay until the write succeeded; their heap entries too
            heapq.heappush(self._heap, item)
        return [self._entries[s] for _, _, s in picked]

    def _compact(self) -> None:
        self._heap = [(e.priority, e.seq, s) for s, e in self._entries.items()]
        heapq.heapify(self._heap)
        self._deadlines = [(e.expires, e.seq, s) for s, e in self._entries.items() if e.expires is not None]
        heapq.heapify(self._deadlines)

    def get(self, slot: bytes) -> StoredState | None:
        """The payload and descriptor of `slot` (one HMGET), or None; a key found gone is reported as evicted."""
        self._keyed()
        with self._lock:
            e = self._entries.get(slot)
            if e is None:
                return None
            if e.expires is not None and e.expires <= time.monotonic():
                self._forget(slot, e)
                gone: _Evicted = [(slot, e.descriptor, None)]
                e = None
        if e is None:
            self._notify(gone)
            return None
        got = self._call(self._client.hmget, e.key, [TOKEN, *chunk_fields(len(e.chunks))])
        token, parts = got[0], got[1:]
        if token != e.token:
            return self._reread(slot, e, vanished=token is None)
        if any(p is None or len(p) != n for p, n in zip(parts, e.chunks, strict=True)):
            return self._bad(slot, e, "chunk missing or of the wrong length")
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.verify_crc and e.crc is not None and zlib.crc32(data) != e.crc:
            return self._bad(slot, e, "crc32 mismatch")
        with self._lock:
            if self._entries.get(slot) is e:
                e.seq = next(self._seq)
                heapq.heappush(self._heap, (e.priority, e.seq, slot))
                if len(self._heap) > 2 * len(self._entries) + 64:
                    self._compact()
        return StoredState(data, e.descriptor)

    def _reread(self, slot: bytes, e: Entry, vanished: bool) -> StoredState | None:
        """The key is gone or was rewritten by another writer: report it, or adopt the new value."""
        if not vanished:
            raw = self._call(self._client.hgetall, e.key)
            pttl = self._call(self._client.pttl, e.key)
            if raw.get(META) is not None:
                try:
                    new = decode_meta(e.key, raw[META], pttl, next(self._seq))
                except ValueError as exc:
                    return self._bad(slot, e, str(exc))
                if not _is_slot(new.descriptor, slot):
                    return self._bad(slot, e, "another slot's state under this slot's key")
                parts = [raw.get(f) for f in chunk_fields(len(new.chunks))]
                if all(p is not None and len(p) == n for p, n in zip(parts, new.chunks, strict=True)):
                    with self._lock:
                        if self._forget(slot, e):
                            self._entries[slot] = new
                            self._used += new.size
                            heapq.heappush(self._heap, (new.priority, new.seq, slot))
                            if new.expires is not None:
                                heapq.heappush(self._deadlines, (new.expires, new.seq, slot))
                    return StoredState(b"".join(parts), new.descriptor)  # type: ignore[arg-type]
        with self._lock:
            forgot = self._forget(slot, e)
        if forgot:
            self._notify([(slot, e.descriptor, None)])
        return None

    def _bad(self, slot: bytes, e: Entry, why: str) -> None:
        log.warning("redis tier payload unusable; dropped", tier=self.name, key=e.key.decode(), reason=why)
        self._call(self._client.delete, e.key)
        with self._lock:
            forgot = self._forget(slot, e)
        if forgot:
            self._notify([(slot, e.descriptor, None)])
        return None

    def delete(self, slot: bytes) -> bool:
        """Drop a payload (on the server too); True if it was held. Deletion is not an eviction: no callback."""
        self._keyed()
        with self._write_lock:
            with self._lock:
                e = self._entries.get(slot)
            if e is None:
                return False
            self._call(self._client.delete, e.key)
            with self._lock:
                return self._forget(slot, e)

    def __contains__(self, slot: object) -> bool:
        return slot in self._entries

    def slots(self) -> Iterator[bytes]:
        """Every slot held (a snapshot of the local metadata)."""
        with self._lock:
            return iter(list(self._entries))

    def descriptors(self) -> list[tuple[bytes, StateDescriptor]]:
        """(slot, descriptor) of every payload held, as read from the server at start (the kernel re-indexes)."""
        with self._lock:
            now = time.monotonic()
            return [(s, e.descriptor) for s, e in self._entries.items() if e.expires is None or e.expires > now]

    def used_bytes(self) -> int:
        """Bytes held now (payload bytes, as this process accounts them)."""
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        """Close the connections; what the server holds stays (the next start re-indexes it)."""
        self._client.close()

    # ------------------------------------------------------------------------------------------ tenants

    def for_tenant(self, tenant: str, *, username: str | None = None, password: str | None = None) -> TenantView:
        """A read-only view of one tenant's keys; with credentials it reads as that server user (see `grant`)."""
        client = self._client
        if username is not None or password is not None:
            client = make_client(self.url, self.connect_timeout_s, self.read_timeout_s, username=username,
                                 password=password)  # fmt: skip
        return TenantView(self, tenant, client, owned=client is not self._client)

    def grant(self, tenant: str, password: str, username: str | None = None) -> str:
        """Create (or reset) a server ACL user that may touch only `tenant`'s keys; returns its user name.

        The user may read and write keys matching `{prefix}:{tenant}:*` and nothing else: no other key, no
        key listing (SCAN, KEYS), no admin or dangerous command. Needs a connection allowed to run ACL SETUSER.
        """
        user = username or f"{self.prefix}-{tenant}"
        pattern = glob_escape(tenant_prefix(self.prefix, tenant)) + "*"
        self._call(self._client.execute_command, "ACL", "SETUSER", user, "reset", "on", f">{password}",
                   f"~{pattern}", "resetchannels", "-@all", "+@read", "+@write", "+@transaction", "+@connection",
                   "-@dangerous", "-@admin", "-scan", "-keys", "-randomkey")  # fmt: skip
        return user


class TenantView:
    """Reads of one tenant's keys only: every key it touches is built from its own prefix.

    A slot of another tenant is simply not found here; with a per-tenant server user (`RedisStore.grant`), the
    server itself refuses any other key (`PermissionError`), whatever key a bug would build.
    """

    def __init__(self, store: RedisStore, tenant: str, client: redis.Redis, *, owned: bool = False) -> None:
        self.store = store
        self.tenant = tenant
        self.prefix = tenant_prefix(store.prefix, tenant)
        self._client = client
        self._owned = owned

    def key_of(self, slot: bytes) -> bytes:
        """This tenant's key of a slot (its keyed name, under this tenant's prefix)."""
        return self.store.key_of(slot, self.tenant)

    def _read(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except redis.exceptions.NoPermissionError as exc:
            raise PermissionError(f"redis refused tenant {self.tenant!r}: {exc}") from exc
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise RedisTierError(f"redis tier {self.store.name!r} unavailable: {exc}") from exc

    def read_key(self, key: bytes) -> StoredState | None:
        """Read one slot's hash by key (the server's ACL decides whether this tenant may)."""
        raw = self._read(self._client.hgetall, key)
        meta = raw.get(META)
        if meta is None:
            return None
        try:
            e = decode_meta(key, meta, -1, 0)
        except ValueError:
            return None
        parts = [raw.get(f) for f in chunk_fields(len(e.chunks))]
        if any(p is None or len(p) != n for p, n in zip(parts, e.chunks, strict=True)):
            return None
        return StoredState(b"".join(parts), e.descriptor)  # type: ignore[arg-type]

    def get(self, slot: bytes) -> StoredState | None:
        """This tenant's payload of `slot`, or None.

        None also when the slot belongs to another tenant, or the key holds another slot's or another tenant's state
        (renamed or copied there).
        """
        got = self.read_key(self.key_of(slot))
        ok = got is not None and _is_slot(got.descriptor, slot) and got.descriptor.namespace.tenant == self.tenant
        return got if ok else None

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, bytes) and bool(self._read(self._client.exists, self.key_of(slot)))

    def close(self) -> None:
        """Close the view's own connections (a view without credentials shares the store's)."""
        if self._owned:
            self._client.close()


def _is_slot(desc: StateDescriptor, slot: bytes) -> bool:
    """True when `desc` describes the state of `slot` (its block key and group)."""
    return len(slot) == 17 and desc.group == slot[-1] and desc.key == slot[:-1].hex()
