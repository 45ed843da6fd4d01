"""The control plane on etcd: leases with keepalive, fencing epochs from etcd's revision, a watched cluster view.

Keys live under a prefix (`nexuskv/` by default): `members/{node}` (attached to the node's lease, so it
vanishes when the lease expires or is revoked), `status/{node}` (what `publish` wrote: backpressure, link
health; on the same lease) and `epoch` (written by `bump_epoch`). A node's fencing epoch is the etcd revision
of its `join`: cluster-wide, strictly increasing, so a node that rejoins after losing its lease always holds
a larger token than before, and a writer can compare tokens without asking etcd. `members()` reads the
`ClusterView`, never the network; every other call is one HTTP request to etcd's JSON gateway (etcd3gw) with a
short timeout, and raises when etcd does not answer (the kernel's `Membership` then plans recompute).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Mapping
from typing import Any

import etcd3gw
from etcd3gw.exceptions import Etcd3Exception
from etcd3gw.utils import _encode

from nexuskv import Lease
from nexuskv_etcd.policy import EtcdPolicyChannel
from nexuskv_etcd.view import ClusterView, members_of, range_of

__all__ = ["EtcdControlPlane"]


class EtcdControlPlane:
    """`nexuskv.plugins.interfaces.ControlPlane` on an etcd cluster (`endpoint` is `host:port` of its client URL)."""

    def __init__(self, endpoint: str = "127.0.0.1:2379", prefix: str = "nexuskv/", timeout_s: float = 1.0,
                 watch: bool = True, watch_idle_s: float = 5.0) -> None:  # fmt: skip
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
        if not prefix.endswith("/"):
            raise ValueError(f"prefix must end with '/', got {prefix!r}")
        self.endpoint = endpoint
        self.prefix = prefix
        self._client = etcd3gw.client(host=host, port=int(port), timeout=timeout_s, api_path="/v3/")
        self._lock = threading.Lock()  # the plane's calls one at a time (the view's thread has its own pace)
        self.view = ClusterView(self._client, prefix, idle_s=watch_idle_s) if watch else None

    def _post(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        with self._lock:
            result: dict[str, Any] = self._client.post(self._client.get_url(path), json=payload)
        return result

    def _key(self, *parts: str) -> str:
        return _encode(self.prefix + "/".join(parts))

    def epoch(self) -> int:
        """The cluster's current revision: never decreases, and every join or bump raises it."""
        return int(self._post("/kv/range", {"key": self._key("epoch"), "count_only": True})["header"]["revision"])

    def bump_epoch(self) -> int:
        """Advance the epoch (a write) and return it."""
        return int(self._post("/kv/put", {"key": self._key("epoch"), "value": _encode(b"")})["header"]["revision"])

    def grant(self, ttl_s: float) -> Lease:
        """A lease of `ttl_s` seconds (etcd counts whole seconds: rounded up, and at least its minimum)."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        result = self._post("/lease/grant", {"TTL": max(1, math.ceil(ttl_s))})
        return Lease(lease_id=int(result["ID"]), ttl_s=float(result["TTL"]))

    def keepalive(self, lease_id: int) -> bool:
        """Renew a lease; False once it has expired or been revoked."""
        return int(self._post("/lease/keepalive", {"ID": lease_id})["result"].get("TTL", -1)) > 0

    def revoke(self, lease_id: int) -> None:
        """End a lease now (its member and status keys go with it); a lease already gone is no error."""
        try:
            self._post("/kv/lease/revoke", {"ID": lease_id})
        except Etcd3Exception as exc:
            if "Not Found" not in str(exc):
                raise

    def alive(self, lease_id: int) -> bool:
        """True while the lease is valid (etcd reports whole seconds left, -1 once gone; JSON omits a 0)."""
        return int(self._post("/kv/lease/timetolive", {"ID": lease_id}).get("TTL", 0)) >= 0

    def join(self, node: str, lease_id: int) -> int:
        """Register `node` under a live lease; its fencing epoch is the revision of that write."""
        value = _encode(json.dumps({"node": node, "lease": lease_id}))
        try:
            result = self._post("/kv/put", {"key": self._key("members", node), "value": value, "lease": lease_id})
        except Etcd3Exception as exc:
            if "Not Found" in str(exc):
                raise LookupError(f"lease {lease_id} is not alive") from None
            raise
        epoch = int(result["header"]["revision"])
        if self.view is not None:
            self.view.note_member(node, epoch)
        return epoch

    def publish(self, node: str, lease_id: int, status: Mapping[str, Any]) -> int:
        """Publish `node`'s status (backpressure, link estimates...) on its lease; returns the write's revision."""
        value = _encode(json.dumps(dict(status), sort_keys=True))
        result = self._post("/kv/put", {"key": self._key("status", node), "value": value, "lease": lease_id})
        return int(result["header"]["revision"])

    def members(self) -> Mapping[str, int]:
        """Live nodes and their fencing epochs: the watched view (the last one seen while etcd is away)."""
        if self.view is not None and self.view.synced:
            return self.view.members()
        return members_of(range_of(self._post, self.prefix + "members/")[1], self.prefix)

    def policy_channel(self) -> EtcdPolicyChannel:
        """The fleet's policy channel under `{prefix}policy/`, through this plane's connection (see `policy.py`)."""
        return EtcdPolicyChannel(self._post, self.prefix)

    def close(self) -> None:
        """Stop the watch and close the HTTP session (leases are left to expire or to the caller to revoke)."""
        if self.view is not None:
            self.view.stop()
        with contextlib.suppress(Exception):
            self._client.session.close()

    def __repr__(self) -> str:
        """Endpoint and prefix."""
        return f"<EtcdControlPlane {self.endpoint} prefix={self.prefix!r}>"
