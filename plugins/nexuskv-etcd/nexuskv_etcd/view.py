"""The cluster as one node sees it: members, their fencing epochs and published status, kept current by a watch.

`ClusterView` lists `{prefix}members/` and `{prefix}status/` once, then follows etcd's watch stream from the
revision after that list, so every join, lease expiry, revoke and status change arrives as an event. A stream
that stays silent for `idle_s` is not trusted (etcd frozen, a connection dropped without a reset): the view
lists again and opens a new watch. When the stream breaks (etcd down, restarted, compacted), the view keeps its
last state, says it is not live, and lists again once etcd answers. Reading it never touches the network.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import requests
from etcd3gw.utils import _decode, _encode, _increment_last_byte

from nexuskv import get_logger

__all__ = ["ClusterView", "members_of", "range_of"]

log = get_logger(__name__)


class ClusterView:
    """Members -> epoch and members -> status under a key prefix, watched from a background thread."""

    def __init__(self, client: Any, prefix: str, retry_s: float = 0.2, idle_s: float = 5.0) -> None:
        self._client = client
        self.prefix = prefix
        self.retry_s = retry_s
        self.idle_s = idle_s
        self._members: dict[str, int] = {}
        self._status: dict[str, dict[str, Any]] = {}
        self._noted: dict[str, int] = {}  # joins made here, until a list or the watch has them
        self.revision = 0
        self.synced = False  # listed at least once
        self.live = False  # the watch stream is open now
        self.error = ""
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, name="nexuskv-etcd-view", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------------- reading

    def members(self) -> dict[str, int]:
        """Live members and their fencing epochs, as last seen."""
        with self._cond:
            return dict(self._members)

    def status(self) -> dict[str, dict[str, Any]]:
        """Each member's last published status."""
        with self._cond:
            return {k: dict(v) for k, v in self._status.items()}

    def status_of(self, node: str) -> dict[str, Any] | None:
        """One member's last published status (None if unknown): what a load from that peer needs, nothing more."""
        with self._cond:
            got = self._status.get(node)
            return None if got is None else dict(got)

    def wait_for(self, predicate: Callable[[ClusterView], bool], timeout_s: float) -> bool:
        """Wait until `predicate(view)` holds (re-checked on every change); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    # ----------------------------------------------------------------------------------------- following

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._list()
                self._follow()
                continue  # the stream was idle for idle_s: list again and open a new watch, at once
            except Exception as exc:  # etcd down or the stream broke: keep the last view, list again later
                if self._stop.is_set():
                    return
                with self._cond:
                    was_live = self.live
                    self.live = False
                    self.error = f"{type(exc).__name__}: {exc}"
                    self._cond.notify_all()
                if was_live or not self.synced:
                    log.warning("etcd watch interrupted; keeping the last view", error=self.error)
            self._stop.wait(self.retry_s)

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._client.post(self._client.get_url(path), json=payload)
        return result

    def _list(self) -> None:
        revision, members = range_of(self._post, self.prefix + "members/")
        _, status = range_of(self._post, self.prefix + "status/")
        m = members_of(members, self.prefix)
        s = {_decode(kv["key"]).decode()[len(self.prefix) + 7 :]: _status_of(kv) for kv in status}
        with self._cond:  # the listed revision is etcd's now (lower than before if etcd was rebuilt)
            # a join this process made after the list's snapshot is not in it: keep it until a list covers it
            self._noted = {node: e for node, e in self._noted.items() if e > revision}
            for node, e in self._noted.items():
                m[node] = max(m.get(node, 0), e)
            self._members, self._status, self.revision = m, s, revision
            self.synced, self.error = True, ""
            self._cond.notify_all()

    def _follow(self) -> None:
        request = {"create_request": {"key": _encode(self.prefix), "range_end": _encode(_increment_last_byte(
            self.prefix)), "start_revision": self.revision + 1}}  # fmt: skip
        self._resp = self._client.session.post(self._client.get_url("/watch"), json=request, stream=True,
                                               timeout=(self._client.timeout, self.idle_s))  # fmt: skip
        self._resp.raise_for_status()
        try:
            self._read(self._resp)
        except requests.exceptions.ConnectionError as exc:
            if "timed out" in str(exc) or isinstance(exc.__context__, TimeoutError):
                return  # silent for idle_s: the caller lists again
            raise

    def _read(self, resp: Any) -> None:
        for line in resp.iter_lines(chunk_size=None):
            if self._stop.is_set():
                return
            if not line.strip():
                continue
            result = json.loads(line).get("result", {})
            if result.get("created"):
                with self._cond:
                    self.live = True
                    self._cond.notify_all()
                log.info("etcd watch following", revision=self.revision)
                continue
            if result.get("canceled") or result.get("compact_revision"):
                raise RuntimeError(f"watch canceled: {result.get('cancel_reason') or 'compacted'}")
            self._apply(result.get("events", []), int(result.get("header", {}).get("revision", 0)))
        raise ConnectionError("watch stream ended")

    def _apply(self, events: list[dict[str, Any]], revision: int) -> None:
        with self._cond:
            for event in events:
                kv = event["kv"]
                key = _decode(kv["key"]).decode()[len(self.prefix) :]
                deleted = event.get("type") == "DELETE"
                kind, _, node = key.partition("/")
                if kind == "members":
                    if deleted:
                        self._members.pop(node, None)
                    else:
                        self._members[node] = int(kv["mod_revision"])
                elif kind == "status":
                    if deleted:
                        self._status.pop(node, None)
                    else:
                        self._status[node] = _status_of(kv)
            self.revision = max(self.revision, revision)
            self._cond.notify_all()

    def note_member(self, node: str, epoch: int) -> None:
        """Record a join this process made (its write may reach the watch a moment later)."""
        with self._cond:
            self._noted[node] = max(self._noted.get(node, 0), epoch)
            if epoch > self._members.get(node, 0):
                self._members[node] = epoch
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop following (the thread ends; the last view stays readable)."""
        self._stop.set()
        resp = self._resp
        if resp is not None:  # unblock the streaming read
            with contextlib.suppress(Exception):
                sock = socket.fromfd(resp.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with contextlib.suppress(Exception):
                resp.close()
        self._thread.join(timeout=self.idle_s + 5)

    def __repr__(self) -> str:
        """Members and freshness."""
        return f"<ClusterView rev={self.revision} live={self.live} members={self.members()}>"


def _status_of(kv: dict[str, Any]) -> dict[str, Any]:
    """A status value as a dict ({} for one that is not a JSON object: a bad writer must not blind the view)."""
    try:
        value = json.loads(_decode(kv.get("value", "")) or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def range_of(post: Callable[[str, dict[str, Any]], dict[str, Any]], key: str) -> tuple[int, list[dict[str, Any]]]:
    """etcd's revision and the key-values under the prefix `key`, read with `post(path, payload)`."""
    result = post("/kv/range", {"key": _encode(key), "range_end": _encode(_increment_last_byte(key))})
    return int(result["header"]["revision"]), result.get("kvs", [])


def members_of(kvs: list[dict[str, Any]], prefix: str) -> dict[str, int]:
    """Node -> fencing epoch (the revision its member key was written at) from `{prefix}members/` key-values."""
    start = len(prefix) + len("members/")
    return {_decode(kv["key"]).decode()[start:]: int(kv["mod_revision"]) for kv in kvs}
