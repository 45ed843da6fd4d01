"""The node's membership in the control plane: its lease, its epoch (the fencing token) and the heartbeat.

The heartbeat thread keeps the lease alive off the hot path; `plan` only reads `ok()`. When the control plane
does not answer (at start or later), the node keeps running and its plans fall back to recompute until the
lease is renewed; after a lost lease, or a whole TTL without a renewal, it joins again, and the epoch it gets
is a new fencing token.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from nexuskv.logs import get_logger
from nexuskv.plugins.interfaces import ControlPlane, Lease

__all__ = ["Membership"]

log = get_logger("nexuskv.control")  # the component name operators filter on: stable


class Membership:
    """One node's lease and epoch in a control plane, kept alive by a heartbeat thread."""

    def __init__(self, plane: ControlPlane, node: str, lease_ttl_s: float,
                 status: Callable[[], Mapping[str, Any]] | None = None) -> None:  # fmt: skip
        """Join `plane` as `node`; with `status`, every heartbeat also publishes it (planes with `publish`)."""
        self.plane = plane
        self._status = status
        self.node = node
        self.lease_ttl_s = lease_ttl_s
        self.epoch = 0
        self.lease: Lease | None = None
        self._error = ""
        self._seen = time.monotonic()
        self._lock = threading.Lock()  # the heartbeat and close() both change lease and epoch
        self._listeners: list[Callable[[int, float], None]] = []
        self._rejoin = threading.Event()
        try:
            self._join()
            self._seen = time.monotonic()  # renewed now, not when we started asking
        except Exception as exc:  # fail open: plans recompute until the control plane answers
            self._error = f"{type(exc).__name__}: {exc}"
            log.error("control plane unavailable at start", error=self._error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="nexuskv-heartbeat", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        lease = self.plane.grant(self.lease_ttl_s)
        epoch = self.plane.join(self.node, lease.lease_id)
        with self._lock:
            self.lease, self.epoch = lease, epoch

    def _beat(self) -> None:
        every = max(0.05, self.lease_ttl_s / 3)
        while not self._stop.wait(every):
            self._tick()

    def _tick(self) -> None:
        """One heartbeat: renew the lease, or join again with a new lease and a new fencing epoch.

        A node that could not renew its lease for a whole TTL (the plane was down, or this process was frozen)
        cannot know whether its lease expired somewhere, so it joins again even when the old lease still
        renews (a restarted etcd extends every lease): its later writes carry a token above the old one.
        """
        try:
            sent = time.monotonic()  # a renewal counts from when it was asked for: the lease ends no earlier
            asked = self._rejoin.is_set()
            lapsed = sent - self._seen >= self.lease_ttl_s or asked
            renewed = not lapsed and self.lease is not None and self.plane.keepalive(self.lease.lease_id)
            # A renewal that answered a whole TTL after the last one (the call hung while the plane was away)
            # does not vouch for the time between: the lease may have lapsed somewhere. Join again.
            lapsed = lapsed or time.monotonic() - self._seen >= self.lease_ttl_s
            if self.lease is None or lapsed or not renewed:
                if lapsed and self.lease is not None:
                    with contextlib.suppress(Exception):
                        self.plane.revoke(self.lease.lease_id)
                sent = time.monotonic()
                self._join()  # a new lease, and with it a new fencing token
                if asked:
                    self._rejoin.clear()  # only once a join succeeded: a failed one is tried again
                log.info("joined the control plane", node=self.node, epoch=self.epoch)
            self._seen = sent
            self._error = ""
            self._publish()
        except Exception as exc:
            self._error = f"{type(exc).__name__}: {exc}"
            log.warning("control plane heartbeat failed", error=self._error)
            return
        self._notify()

    def rejoin(self) -> None:
        """Ask for a new lease and fencing epoch at the next heartbeat (a part found this epoch fenced out)."""
        self._rejoin.set()

    def listen(self, listener: Callable[[int, float], None]) -> None:
        """Call `listener(epoch, renewed_at)` after every renewal or join (on the heartbeat thread), and once now.

        `renewed_at` is the `time.monotonic()` of the renewal: the lease runs until `renewed_at + lease_ttl_s` at
        the latest. Listeners extend what lives on the lease elsewhere (a cluster index's liveness key) and learn
        new epochs; one that raises is logged and kept.
        """
        self._listeners.append(listener)
        if self.ok():
            self._call(listener)

    def _notify(self) -> None:
        for listener in list(self._listeners):
            self._call(listener)

    def _call(self, listener: Callable[[int, float], None]) -> None:
        try:
            listener(self.epoch, self._seen)
        except Exception as exc:
            log.warning("membership listener failed", listener=repr(listener), error=f"{type(exc).__name__}: {exc}")

    def peer_status(self, node: str) -> Mapping[str, Any] | None:
        """What `node` last published (addresses, link estimates), from the control plane's view; None if unknown."""
        view = getattr(self.plane, "view", None)
        if view is None:
            return None
        try:
            got: Mapping[str, Any] | None = view.status_of(node)
        except Exception:
            return None
        return got

    def publish_now(self) -> None:
        """Publish this node's status at once (after a part it advertises, such as a server address, started)."""
        if self.ok():
            self._publish()

    def ok(self) -> bool:
        """True while the lease is known to be alive (last heartbeat within the lease TTL, no error since)."""
        return not self._error and time.monotonic() - self._seen < self.lease_ttl_s

    @property
    def problem(self) -> str:
        """Why `ok()` is False: the last error, or that the lease was not renewed in time."""
        return self._error or "lease not renewed"

    def _publish(self) -> None:
        """Publish this node's status (what it measures, for the others); a failure here is not a lost lease."""
        publish = getattr(self.plane, "publish", None)
        if self._status is None or publish is None or self.lease is None:
            return
        try:
            status = self._status()
            if status:  # nothing to say: no write (every write grows etcd's history)
                publish(self.node, self.lease.lease_id, status)
        except Exception as exc:
            log.warning("publishing the node status failed", error=f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """Stop the heartbeat and wait for a beat in progress (the lease lapses by itself unless `close` revokes it).

        Waiting matters: a beat that is joining when we leave would otherwise register the node again after
        `close` revoked its lease.
        """
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.lease_ttl_s))

    def close(self) -> None:
        """Stop the heartbeat, revoke the lease and close the control plane (errors are ignored: we are leaving)."""
        self.stop()
        with contextlib.suppress(Exception):
            if self.lease is not None:
                self.plane.revoke(self.lease.lease_id)
            self.plane.close()
