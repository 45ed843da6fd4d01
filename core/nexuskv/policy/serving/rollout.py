"""Fleet-wide policy rollout: publish a policy bundle once, every node applies it whole or refuses it and says why.

A `PolicyChannel` is where bundles are published and where nodes report back: etcd (the `nexuskv-etcd`
plugin's `EtcdPolicyChannel`, through the control plane) or, for machines without etcd, a `DirectoryChannel`
on a shared volume. Publishing stores the bundle under its revision (kept, so a rollback is publishing an older
revision again), appends it to the history and makes it the current revision, as one step for readers.

Each node runs a `Rollout`: a thread that polls the channel's current revision and, when it changes, fetches
the bundle and hands it to `LivePolicies.apply`, which compiles it off the hot path and swaps it in atomically,
or refuses it whole. Then the node reports what it serves, what the channel wants, and every problem (file,
rule, line and column). A node that cannot load a bundle keeps serving its revision, reports `failed`, and does
not try that revision again until the channel's current revision changes (or the node restarts). A channel
that does not answer is asked again at every poll; the node reports `unreachable` when it can, and reports its
state again as soon as the channel answers. Nothing the channel does stops the thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import quote, unquote

from attrs import define, field

from nexuskv.logs import get_logger
from nexuskv.policy.bundle import BundleError, PolicyBundle
from nexuskv.policy.serving.live import LivePolicies

__all__ = ["STATUSES", "DirectoryChannel", "PolicyChannel", "Rollout", "describe"]

log = get_logger("nexuskv.policy.rollout")  # the component name operators filter on: stable

# What a node's report says about the channel's current revision.
STATUSES = ("applied", "unchanged", "failed", "unreachable")


@runtime_checkable
class PolicyChannel(Protocol):
    """Where policy bundles are published for a fleet, and where its nodes report what they serve."""

    def publish(self, bundle: PolicyBundle) -> None:
        """Store `bundle` under its revision, append it to the history and make it current (one step for readers)."""

    def current(self) -> str | None:
        """The revision nodes should serve (None before the first publish)."""

    def fetch(self, revision: str) -> PolicyBundle:
        """The bundle of a published revision; `BundleError` when it is missing or damaged."""

    def history(self) -> list[tuple[str, float, str]]:
        """Every publish as `(revision, published_at, note)`, oldest first."""

    def report(self, node: str, report: Mapping[str, Any]) -> None:
        """Record a node's latest rollout report (replacing its previous one)."""

    def reports(self) -> dict[str, dict[str, Any]]:
        """The latest report of every node that ever reported, by node."""

    def close(self) -> None:
        """Release what the channel holds (connections); it is not used afterwards."""


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception, in one line (etcd3gw's errors keep their text in `detail_text`)."""
    text = str(exc) or str(getattr(exc, "detail_text", "") or "")
    text = " ".join(text.split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# ------------------------------------------------------------------------------------------ a shared directory


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temp file in the same directory, fsynced, then `os.replace`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@define(eq=False)
class DirectoryChannel:
    """A policy channel in a directory several machines (a shared volume) or processes see.

    Layout: `bundles/<revision>.json` (each published bundle, kept), `history.jsonl` (one line per publish:
    revision, published_at, note), `current` (the revision nodes should serve, one line), `nodes/<node>.json`
    (each node's latest report). Every file is replaced whole (temp file + `os.replace`), so a reader never sees
    half of one; a bundle is written before `current` names it, so a reader that sees a revision can fetch it.
    Publishers take an exclusive `flock` on `.lock`, so concurrent publishes do not interleave their history.
    With `create`, the directory is made now (publishers); otherwise, while it is missing, `current()` and
    `report()` raise: a volume not mounted is an unreachable channel, not "nothing published".
    """

    path: Path = field(converter=Path)
    create: bool = field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.create:
            self.path.mkdir(parents=True, exist_ok=True)

    def _bundle_path(self, revision: str) -> Path:
        if not revision or "/" in revision or revision.startswith("."):
            raise BundleError(f"not a bundle revision: {revision!r}")
        return self.path / "bundles" / f"{revision}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.path / ".lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def publish(self, bundle: PolicyBundle) -> None:
        """Write the bundle, append the history line, then replace `current` (the step readers see)."""
        (self.path / "bundles").mkdir(parents=True, exist_ok=True)
        line = json.dumps({"revision": bundle.revision, "published_at": time.time(), "note": bundle.note},
                          sort_keys=True) + "\n"  # fmt: skip
        with self._locked():
            _write_atomic(self._bundle_path(bundle.revision), bundle.to_json().encode())
            with open(self.path / "history.jsonl", "ab") as f:
                f.write(line.encode())
                f.flush()
                os.fsync(f.fileno())
            _write_atomic(self.path / "current", (bundle.revision + "\n").encode())

    def current(self) -> str | None:
        """The revision in `current`; None when nothing was published yet (raises while the directory is missing)."""
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: policy channel directory missing (volume not mounted?)")
        try:
            text = (self.path / "current").read_text().strip()
        except FileNotFoundError:
            return None
        return text or None

    def fetch(self, revision: str) -> PolicyBundle:
        """The bundle of `revision`, its content checked against the revision."""
        path = self._bundle_path(revision)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BundleError(f"{path}: no bundle of revision {revision} in the channel") from None
        except OSError as exc:
            raise BundleError(f"{path}: cannot read: {exc.strerror or exc}") from None
        return PolicyBundle.stored(data, revision, str(path))

    def history(self) -> list[tuple[str, float, str]]:
        """Every publish, oldest first (a damaged line, such as a crashed writer's last one, is skipped)."""
        try:
            lines = (self.path / "history.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        out: list[tuple[str, float, str]] = []
        for line in lines:
            try:
                entry = json.loads(line)
                out.append((str(entry["revision"]), float(entry["published_at"]), str(entry.get("note", ""))))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def report(self, node: str, report: Mapping[str, Any]) -> None:
        """Replace `nodes/<node>.json` (the node name is %-quoted into a file name)."""
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: policy channel directory missing (volume not mounted?)")
        nodes = self.path / "nodes"
        nodes.mkdir(exist_ok=True)
        _write_atomic(nodes / f"{quote(node, safe='')}.json", json.dumps(dict(report), sort_keys=True).encode())

    def reports(self) -> dict[str, dict[str, Any]]:
        """Every node's latest report (unreadable files are skipped)."""
        out: dict[str, dict[str, Any]] = {}
        for path in sorted((self.path / "nodes").glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                out[str(data.get("node") or unquote(path.stem))] = data
        return out

    def close(self) -> None:
        """Nothing to release."""


# ------------------------------------------------------------------------------------------ a node's rollout


@define(eq=False)
class Rollout:
    """One node following a channel: apply each new current revision to `live`, report the outcome.

    `start()` runs `poll_once` every `interval_s` on a daemon thread, the first one at once (so the node's
    serving revision is reported before any rollout); tests call `poll_once()` directly. `close()` stops the
    thread and closes the channel. Every public method is thread-safe.
    """

    live: LivePolicies
    channel: PolicyChannel
    node: str
    interval_s: float = 1.0
    _lock: threading.Lock = field(init=False, factory=threading.Lock)  # one poll at a time
    _stop: threading.Event = field(init=False, factory=threading.Event)
    _thread: threading.Thread | None = field(init=False, default=None)
    _handled: str | None = field(init=False, default=None)  # the last current revision fetched and tried
    _status: str = field(init=False, default="unchanged")  # of the last revision handled
    _problems: list[str] = field(init=False, factory=list)
    _load_ms: float = field(init=False, default=0.0)
    _pending: bool = field(init=False, default=True)  # a report is owed (at start, after a failed report)
    _unreachable: str = field(init=False, default="")  # the channel's last error while it does not answer
    _report_failing: bool = field(init=False, default=False)  # reports fail while the channel otherwise answers
    _last: dict[str, Any] | None = field(init=False, default=None)

    def start(self) -> Rollout:
        """Start polling on a daemon thread (a second call does nothing); returns self."""
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="nexuskv-policy-rollout", daemon=True)
                self._thread.start()
        return self

    def close(self) -> None:
        """Stop polling (waits for a poll in progress) and close the channel."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, 2 * self.interval_s))
        with contextlib.suppress(Exception):
            self.channel.close()

    @property
    def last_report(self) -> dict[str, Any] | None:
        """The last report made (or attempted), None before the first."""
        with self._lock:
            return None if self._last is None else dict(self._last)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # never: poll_once catches what the channel raises; but the thread must live
                log.exception("policy rollout poll failed", node=self.node, error=describe(exc))
            if self._stop.wait(self.interval_s):
                return

    def poll_once(self) -> dict[str, Any] | None:
        """One step: read the current revision, apply it if new, report. The report made, or None if none was owed.

        A report is owed at the first poll, when the current revision changed, after the channel did not answer,
        and after a report that could not be written.
        """
        with self._lock:
            try:
                wanted = self.channel.current()
            except Exception as exc:
                return self._channel_down("current", exc)
            if wanted is not None and wanted != self._handled:
                try:
                    bundle = self.channel.fetch(wanted)
                except BundleError as exc:  # missing or damaged: this revision cannot be applied; not retried
                    self._handled, self._status, self._problems, self._load_ms = wanted, "failed", [str(exc)], 0.0
                    log.error("policy bundle unusable", node=self.node, revision=wanted, serving=self.live.revision,
                              problem=str(exc))  # fmt: skip
                except Exception as exc:  # the channel did not answer: ask again next poll
                    return self._channel_down("fetch", exc)
                else:
                    self._apply(wanted, bundle)
                self._pending = True
            if self._unreachable:
                log.info("policy channel answers again", node=self.node, error_was=self._unreachable)
                self._unreachable = ""
                self._pending = True
            if not self._pending:
                return None
            return self._send(wanted, self._status, self._problems)

    def _apply(self, wanted: str, bundle: PolicyBundle) -> None:
        try:
            result = self.live.apply(bundle, source="rollout")
        except Exception as exc:  # LivePolicies catches loader errors; anything else still must not kill the thread
            self._handled, self._status, self._problems = wanted, "failed", [describe(exc)]
            log.exception("policy rollout apply failed", node=self.node, revision=wanted)
            return
        self._handled = wanted
        self._status = "applied" if result.applied else "unchanged" if result.ok else "failed"
        self._problems = [str(p) for p in result.problems]
        self._load_ms = result.load_ms
        if not result.ok:  # LivePolicies has logged every problem with file, rule, line and column
            log.error("policy rollout refused", node=self.node, revision=wanted, serving=self.live.revision,
                      problems=len(self._problems))  # fmt: skip

    def _channel_down(self, call: str, exc: Exception) -> dict[str, Any]:
        error = f"{call}: {describe(exc)}"
        if not self._unreachable:
            log.warning("policy channel unreachable", node=self.node, error=error, serving=self.live.revision)
        self._unreachable = error
        return self._send(self._handled, "unreachable", [], error=error)

    def _send(self, wanted: str | None, status: str, problems: list[str], error: str = "") -> dict[str, Any]:
        report: dict[str, Any] = {
            "node": self.node, "serving": self.live.revision, "wanted": wanted, "status": status,
            "problems": list(problems), "error": error, "load_ms": round(self._load_ms, 3), "pid": os.getpid(),
            "at": time.time(),
        }  # fmt: skip
        self._last = report
        try:
            self.channel.report(self.node, report)
        except Exception as exc:  # a report lost is written again at the next poll
            self._pending = True
            if status != "unreachable" and not self._report_failing:  # said once, like an unreachable channel
                log.warning("policy rollout report not written", node=self.node, error=describe(exc))
            self._report_failing = status != "unreachable"
        else:
            self._pending = self._report_failing = False  # after `unreachable`, recovery owes the state (poll_once)
        return dict(report)
