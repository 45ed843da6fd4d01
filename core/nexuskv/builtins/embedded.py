"""Builtin embedded control plane: in-process monotonic epochs, leases and membership for one machine."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from nexuskv import Lease, hookimpl

__all__ = ["EmbeddedControlPlane"]


class EmbeddedControlPlane:
    """Epochs, leases and membership held in this process (no server).

    Leases expire `ttl_s` after their last keepalive on a monotonic clock; a node's membership ends with its
    lease. Every `join` bumps the epoch, so a node that rejoins gets a fencing token above all earlier ones.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._epoch = 0
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl, expires_at)
        self._members: dict[str, tuple[int, int]] = {}  # node -> (lease_id, epoch)
        self._lock = threading.Lock()

    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    def bump_epoch(self) -> int:
        """Advance the epoch by one and return it."""
        with self._lock:
            self._epoch += 1
            return self._epoch

    def grant(self, ttl_s: float) -> Lease:
        """A new lease of `ttl_s` seconds."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        with self._lock:
            lease_id = next(self._ids)
            self._leases[lease_id] = (ttl_s, self._clock() + ttl_s)
        return Lease(lease_id=lease_id, ttl_s=ttl_s)

    def _expire(self) -> None:
        now = self._clock()
        dead = [lid for lid, (_, exp) in self._leases.items() if exp <= now]
        for lid in dead:
            del self._leases[lid]
        if dead:
            gone = set(dead)
            self._members = {n: v for n, v in self._members.items() if v[0] not in gone}

    def keepalive(self, lease_id: int) -> bool:
        """Renew a lease; False once it has expired or been revoked."""
        with self._lock:
            self._expire()
            got = self._leases.get(lease_id)
            if got is None:
                return False
            self._leases[lease_id] = (got[0], self._clock() + got[0])
            return True

    def revoke(self, lease_id: int) -> None:
        """End a lease and the memberships attached to it."""
        with self._lock:
            self._leases.pop(lease_id, None)
            self._members = {n: v for n, v in self._members.items() if v[0] != lease_id}

    def alive(self, lease_id: int) -> bool:
        """True while the lease is valid."""
        with self._lock:
            self._expire()
            return lease_id in self._leases

    def join(self, node: str, lease_id: int) -> int:
        """Register `node` under a live lease; return its new fencing epoch."""
        with self._lock:
            self._expire()
            if lease_id not in self._leases:
                raise LookupError(f"lease {lease_id} is not alive")
            self._epoch += 1
            self._members[node] = (lease_id, self._epoch)
            return self._epoch

    def members(self) -> Mapping[str, int]:
        """Live nodes and their epochs."""
        with self._lock:
            self._expire()
            return {n: e for n, (_, e) in sorted(self._members.items())}

    def close(self) -> None:
        """Forget all leases and members."""
        with self._lock:
            self._leases.clear()
            self._members.clear()


@hookimpl(trylast=True)
def nexuskv_control_plane(config: Mapping[str, Any]) -> EmbeddedControlPlane | None:
    """Provide the embedded control plane unless the config names another."""
    return EmbeddedControlPlane() if config.get("name", "embedded") == "embedded" else None
