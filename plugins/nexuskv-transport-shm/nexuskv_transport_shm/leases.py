"""The shm tier's host-local lease registry: who owns which segments until when; reaping what dead owners left."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path

from attrs import define

from nexuskv_transport_shm.segments import (
    LEASE,
    NEW_SUFFIX,
    TEMP,
    lease_name,
    parse_name,
    read_meta,
    unlink_if_same,
    unlink_quietly,
)


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """The kernel start time of a running (non-zombie) process, or None when it is gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X", b"x"):
        return None
    return fields[19].decode()  # field 22 of proc(5); fields[0] is field 3


@define(frozen=True)
class LeaseInfo:
    """The immutable part of a lease record; its mtime is the last renewal."""

    lease_id: str
    pid: int
    pidns: str
    start: str
    ttl_s: float


class LeaseRegistry:
    """Host-local leases: one file per lease (owner pid, its start time and pid namespace, TTL), renewed by mtime.

    A lease is alive while its file exists, was renewed within its TTL, and -- where the owner is visible in this
    pid namespace -- its owner process still runs (same start time, not a zombie). So a killed owner is noticed
    at once and a hung one after its TTL.
    """

    def __init__(self, directory: Path, namespace: str) -> None:
        self.directory = directory
        self._dir = str(directory)
        self.namespace = namespace
        self._pidns = _pid_namespace()
        self._infos: dict[str, LeaseInfo] = {}

    def path(self, lease_id: str) -> str:
        """The file of a lease."""
        return f"{self._dir}/{self.namespace}-{LEASE}-{lease_id}"

    def grant(self, ttl_s: float, mode: int = 0o600) -> str:
        """A new lease owned by this process (written whole: temp file then rename)."""
        lease_id = secrets.token_hex(8)
        pid = os.getpid()
        info = LeaseInfo(lease_id, pid, self._pidns, _start_time(pid) or "", ttl_s)
        data = json.dumps({"pid": pid, "pidns": info.pidns, "start": info.start, "ttl_s": ttl_s}).encode()
        tmp = self.directory / (lease_name(self.namespace, lease_id) + NEW_SUFFIX)
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, mode)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp, self.path(lease_id))
        self._infos[lease_id] = info
        return lease_id

    def renew(self, lease_id: str) -> bool:
        """Renew a lease of this process; False once it expired or was removed (then it must not be revived)."""
        path = self.path(lease_id)
        info = self.info(lease_id)
        try:
            st = os.stat(path)
            if info is None or time.time() - st.st_mtime > info.ttl_s:
                return False
            os.utime(path)
        except FileNotFoundError:
            return False
        return True

    def revoke(self, lease_id: str) -> None:
        """Remove a lease record."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(lease_id))
        self._infos.pop(lease_id, None)

    def info(self, lease_id: str) -> LeaseInfo | None:
        """The lease record (cached: it never changes), or None when it is missing or unreadable."""
        info = self._infos.get(lease_id)
        if info is not None:
            return info
        try:
            raw = json.loads(Path(self.path(lease_id)).read_bytes())
            info = LeaseInfo(lease_id, int(raw["pid"]), str(raw["pidns"]), str(raw["start"]), float(raw["ttl_s"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if len(self._infos) > 4096:
            self._infos.clear()
        self._infos[lease_id] = info
        return info

    def alive(self, lease_id: str, now: float | None = None) -> bool:
        """True while the lease file exists, was renewed within its TTL and its owner process still runs."""
        info = self.info(lease_id)
        if info is None:
            return False
        try:
            st = os.stat(self.path(lease_id))
        except FileNotFoundError:
            self._infos.pop(lease_id, None)
            return False
        if (time.time() if now is None else now) - st.st_mtime > info.ttl_s:
            return False
        if info.pidns and info.pidns == self._pidns and info.start:
            return _start_time(info.pid) == info.start
        return True  # owner not visible from here: the TTL alone decides


Removed = tuple[str, str | None, bytes | None]  # file name, a published segment's keyed name, descriptor JSON


def reap(directory: Path, namespace: str, registry: LeaseRegistry, grace_s: float) -> list[Removed]:
    """Remove what dead or expired leases left in `directory`: segments, half-written segments, lease records.

    Returns (file name, keyed name, descriptor bytes) of everything removed: the keyed name (`store_name`) of
    published segments only, the descriptor where it could be read (None otherwise); a name is never taken for a
    slot (the store derives the slot from the descriptor and checks the name against it). Published segments
    go when their lease is no longer alive or their TTL passed; temp segments when their writer's lease is not
    alive; a lease record last, after its segments. Entries that cannot be attributed (bad header, stray `.new`
    files) go after `grace_s`.
    """
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    live: dict[str, bool] = {}

    def alive(lease_id: str) -> bool:
        got = live.get(lease_id)
        if got is None:
            got = live[lease_id] = registry.alive(lease_id, now)
        return got

    def old(entry: os.DirEntry[str]) -> bool:
        try:
            return now - entry.stat().st_mtime > grace_s
        except FileNotFoundError:
            return False

    removed: list[Removed] = []
    dead_leases: list[os.DirEntry[str]] = []
    for entry in entries:
        parsed = parse_name(namespace, entry.name)
        if parsed is None:
            continue
        kind, rest = parsed
        path = entry.path
        if kind == LEASE:
            if rest.endswith(NEW_SUFFIX):
                if old(entry):
                    unlink_quietly(path)
                    removed.append((entry.name, None, None))
            elif not alive(rest):
                dead_leases.append(entry)
        elif kind == TEMP:
            if not alive(rest.partition("-")[0]):
                unlink_quietly(path)
                removed.append((entry.name, None, None))
        else:
            meta = read_meta(path)
            if meta is None:  # damaged, half-published, or not this user's (never read, and not ours to remove)
                if old(entry) and unlink_quietly(path):
                    removed.append((entry.name, rest, None))
                continue
            h, desc, st = meta
            if h.expired(now) or not alive(h.lease_id):
                if not h.expired(now) and registry.alive(h.lease_id):  # a lease granted since the first look
                    continue
                if unlink_if_same(path, st.st_ino):
                    removed.append((entry.name, rest, desc))
    for entry in dead_leases:
        unlink_quietly(entry.path)
        removed.append((entry.name, None, None))
    return removed
