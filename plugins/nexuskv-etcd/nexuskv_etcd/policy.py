"""The policy channel on etcd: a fleet's policy bundles, their history and every node's rollout report.

Keys under `{prefix}policy/`: `bundles/<revision>` (each published bundle's JSON, kept for rollbacks),
`current` (the revision nodes should serve), `history/<20-digit ns timestamp>-<revision>` (one per publish:
revision, published_at, note; listed in etcd's revision order, so publishers' clocks do not matter) and
`nodes/<node>` (each node's latest report). `publish` writes the bundle, the history entry and `current` in one
etcd transaction: a reader that sees a revision in `current` can fetch its bundle. Node reports are plain keys,
not on the node's lease: a node that died leaves its last report, dated by its `at`.

etcd refuses requests over `--max-request-bytes` (1.5 MiB by default), so bundles over `MAX_BUNDLE_BYTES`
(1 MiB of JSON) are refused with a `BundleError` before anything is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from etcd3gw.utils import _decode, _encode

from nexuskv import BundleError, PolicyBundle
from nexuskv_etcd.view import range_of

__all__ = ["MAX_BUNDLE_BYTES", "EtcdPolicyChannel"]

MAX_BUNDLE_BYTES = 1 << 20

Post = Callable[[str, dict[str, Any]], dict[str, Any]]


class EtcdPolicyChannel:
    """`nexuskv.policy.serving.rollout.PolicyChannel` on etcd, through a `post(path, payload)` to its JSON gateway."""

    def __init__(self, post: Post, prefix: str = "nexuskv/", on_close: Callable[[], None] | None = None) -> None:
        """`post` is an `EtcdControlPlane`'s `_post` (or any callable with its contract); `on_close` runs at `close`."""
        if not prefix.endswith("/"):
            raise ValueError(f"prefix must end with '/', got {prefix!r}")
        self._post = post
        self.prefix = prefix
        self.root = prefix + "policy/"
        self._on_close = on_close

    @classmethod
    def connect(cls, endpoint: str, prefix: str = "nexuskv/", timeout_s: float = 5.0) -> EtcdPolicyChannel:
        """A channel with its own connection to etcd at `host:port` (what the CLI uses); `close` closes it."""
        from nexuskv_etcd.plane import EtcdControlPlane

        plane = EtcdControlPlane(endpoint, prefix=prefix, timeout_s=timeout_s, watch=False)
        return cls(plane._post, prefix, on_close=plane.close)

    def _get(self, key: str) -> bytes | None:
        kvs = self._post("/kv/range", {"key": _encode(self.root + key)}).get("kvs") or []
        return _decode(kvs[0].get("value", "")) if kvs else None

    def publish(self, bundle: PolicyBundle) -> None:
        """Bundle, history entry and `current` in one transaction (a `BundleError` if the bundle is too large)."""
        data = bundle.to_json().encode()
        if len(data) > MAX_BUNDLE_BYTES:
            raise BundleError(f"bundle {bundle.revision} is {len(data)} bytes of JSON: the etcd policy channel "
                              f"takes at most {MAX_BUNDLE_BYTES} (etcd refuses requests over 1.5 MiB by default); "
                              "make the policies smaller or publish through a shared directory")  # fmt: skip
        published_at = time.time()
        entry = json.dumps({"revision": bundle.revision, "published_at": published_at, "note": bundle.note},
                           sort_keys=True)  # fmt: skip
        puts = [(f"bundles/{bundle.revision}", data), (f"history/{time.time_ns():020d}-{bundle.revision}", entry),
                ("current", bundle.revision)]  # fmt: skip
        self._post("/kv/txn", {"success": [{"request_put": {"key": _encode(self.root + k), "value": _encode(v)}}
                                           for k, v in puts]})  # fmt: skip

    def current(self) -> str | None:
        """The revision in `current` (None before the first publish)."""
        value = self._get("current")
        return (value.decode() or None) if value is not None else None

    def fetch(self, revision: str) -> PolicyBundle:
        """The bundle of `revision`, its content checked against the revision (`BundleError` if missing/damaged)."""
        value = self._get(f"bundles/{revision}")
        if value is None:
            raise BundleError(f"etcd {self.root}bundles/{revision}: no bundle of revision {revision} in the channel")
        return PolicyBundle.stored(value, revision, f"etcd {self.root}bundles/{revision}")

    def history(self) -> list[tuple[str, float, str]]:
        """Every publish, oldest first (ordered by the etcd revision that wrote it)."""
        _, kvs = range_of(self._post, self.root + "history/")
        out: list[tuple[int, str, float, str]] = []
        for kv in kvs:
            try:
                entry = json.loads(_decode(kv.get("value", "")))
                out.append((int(kv.get("create_revision", 0)), str(entry["revision"]),
                            float(entry["published_at"]), str(entry.get("note", ""))))  # fmt: skip
            except (ValueError, KeyError, TypeError):
                continue
        return [(rev, at, note) for _, rev, at, note in sorted(out)]

    def report(self, node: str, report: Mapping[str, Any]) -> None:
        """Put `nodes/<node>` (a plain key: it outlives the node)."""
        value = _encode(json.dumps(dict(report), sort_keys=True))
        self._post("/kv/put", {"key": _encode(self.root + "nodes/" + node), "value": value})

    def reports(self) -> dict[str, dict[str, Any]]:
        """Every node's latest report."""
        start = len(self.root + "nodes/")
        _, kvs = range_of(self._post, self.root + "nodes/")
        out: dict[str, dict[str, Any]] = {}
        for kv in kvs:
            try:
                data = json.loads(_decode(kv.get("value", "")))
            except ValueError:
                continue
            if isinstance(data, dict):
                out[_decode(kv["key"]).decode()[start:]] = data
        return out

    def close(self) -> None:
        """Close the connection if this channel made it (a control plane's channel leaves the plane open)."""
        if self._on_close is not None:
            self._on_close()

    def __repr__(self) -> str:
        """Its key prefix."""
        return f"<EtcdPolicyChannel {self.root!r}>"
