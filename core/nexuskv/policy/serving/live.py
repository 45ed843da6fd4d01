"""The policies a running kernel serves, replaced whole and atomically while it serves them.

`LivePolicies.current` is an immutable compiled `Policies`; every kernel operation reads it once and uses that
one object throughout, so a plan sees exactly one revision. `reload()` (the policy directory) and `apply(bundle)`
(a fleet rollout) parse, type-check and compile a new revision on the caller's thread, off the hot path, then
swap it in with one assignment. A revision with any problem is refused whole: every problem is logged with
file, rule, line and column, and the running revision keeps serving. `watch()` reloads when the directory
changes (watchfiles: a reload once the directory is quiet, so a `git pull` is one reload, not one per file).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attrs import define

from nexuskv.logs import get_logger
from nexuskv.policy.bundle import PolicyBundle
from nexuskv.policy.loader import Policies, PolicyProblem

__all__ = ["LivePolicies", "ReloadResult"]

log = get_logger("nexuskv.policy.live")  # the component name operators filter on: stable


@define(frozen=True)
class ReloadResult:
    """What one reload or rollout did: applied (a new revision serves), unchanged, or refused with its problems."""

    applied: bool
    revision: str  # the revision that was loaded or tried ("" when nothing could be read)
    previous: str  # the revision serving before
    source: str  # "start", "reload", "watch", "rollout"
    problems: tuple[PolicyProblem, ...] = ()
    unchanged: bool = False
    load_ms: float = 0.0
    at: float = 0.0  # time.time() when it finished

    @property
    def ok(self) -> bool:
        """True when the revision tried is the one serving now (applied, or already serving)."""
        return self.applied or self.unchanged

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for status reports and logs)."""
        return {"applied": self.applied, "revision": self.revision, "previous": self.previous,
                "source": self.source, "unchanged": self.unchanged, "load_ms": round(self.load_ms, 3),
                "at": self.at, "problems": [str(p) for p in self.problems]}  # fmt: skip


class LivePolicies:
    """The serving revision of a kernel's policies, and the ways to replace it."""

    def __init__(self, root: str | Path | None, functions: Mapping[str, Any] | None = None, *,
                 history: int = 32) -> None:  # fmt: skip
        """Load `root` now (a `PolicyError` when it does not load: a kernel does not start on broken policies).

        Without `root` nothing serves until a bundle is applied (`waiting` is True meanwhile).
        """
        self.root = Path(root) if root is not None else None
        self.functions = dict(functions or {})
        self._lock = threading.Lock()  # one reload at a time: an older revision never replaces a newer one
        self._listeners: list[Callable[[ReloadResult], None]] = []
        self._history: collections.deque[ReloadResult] = collections.deque(maxlen=history)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.current: Policies | None = None
        if self.root is not None:
            t0 = time.perf_counter()
            self.current = Policies.load(self.root, self.functions)
            self._history.append(ReloadResult(True, self.current.revision, "", "start",
                                              load_ms=(time.perf_counter() - t0) * 1e3, at=time.time()))  # fmt: skip

    @property
    def revision(self) -> str:
        """The serving revision ("" while waiting for the first one)."""
        cur = self.current
        return cur.revision if cur is not None else ""

    @property
    def waiting(self) -> bool:
        """True until some revision serves (a rollout node before its first bundle)."""
        return self.current is None

    def history(self) -> list[ReloadResult]:
        """The most recent reload results, oldest first."""
        with self._lock:
            return list(self._history)

    def listen(self, listener: Callable[[ReloadResult], None]) -> None:
        """Call `listener(result)` after every reload or rollout attempt (on the thread that made it)."""
        self._listeners.append(listener)

    def reload(self, source: str = "reload") -> ReloadResult:
        """Load the policy directory again; swap it in if it loads cleanly and differs from the serving one."""
        if self.root is None:
            raise ValueError("no policy directory to reload (the kernel config has no `policies`)")
        root = self.root
        return self._replace(source, lambda: Policies._load(root, self.functions))

    def apply(self, bundle: PolicyBundle, source: str = "rollout") -> ReloadResult:
        """Compile a bundle and swap it in if it loads cleanly and differs from the serving revision."""
        return self._replace(source, lambda: Policies.check_bundle(bundle, self.functions),
                             revision=bundle.revision)  # fmt: skip

    def _replace(self, source: str, load: Callable[[], tuple[Policies, list[PolicyProblem]]],
                 revision: str | None = None) -> ReloadResult:  # fmt: skip
        with self._lock:
            previous = self.revision
            t0 = time.perf_counter()
            if revision is not None and revision == previous:
                result = ReloadResult(False, revision, previous, source, unchanged=True, at=time.time())
            else:
                try:
                    policies, problems = load()
                except Exception as exc:  # a loader bug must not take the serving revision down with it
                    policies, problems = None, [PolicyProblem(str(self.root or "bundle"),
                                                              f"loading failed: {type(exc).__name__}: {exc}")]
                ms = (time.perf_counter() - t0) * 1e3
                tried = policies.revision if policies is not None else (revision or "")
                if problems or policies is None:
                    result = ReloadResult(False, tried, previous, source, tuple(problems), load_ms=ms, at=time.time())
                elif tried == previous:
                    result = ReloadResult(False, tried, previous, source, unchanged=True, load_ms=ms, at=time.time())
                else:
                    self.current = policies  # the swap: one assignment, seen whole by every later read
                    result = ReloadResult(True, tried, previous, source, load_ms=ms, at=time.time())
            self._history.append(result)
        self._report(result)
        return result

    def _report(self, result: ReloadResult) -> None:
        if result.applied:
            log.info("policies replaced", revision=result.revision, previous=result.previous, source=result.source,
                     load_ms=round(result.load_ms, 3))  # fmt: skip
        elif result.problems:
            for p in result.problems:
                log.error("policy revision refused", source=result.source, revision=result.revision or None,
                          serving=result.previous or None, file=p.file, rule=p.rule or None, line=p.line,
                          column=p.column, problem=p.message)  # fmt: skip
        for listener in list(self._listeners):
            try:
                listener(result)
            except Exception as exc:
                log.warning("policy reload listener failed", error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------------------------------ watching

    def watch(self, debounce_ms: int = 300) -> None:
        """Reload whenever the policy directory changes, from a background thread (until `close`).

        A reload starts once the directory has been quiet for `debounce_ms` (changes closer together than that,
        a `git pull`, an editor saving several files, are one reload; at most 10x that long is grouped). Watch
        the directory itself: a deploy that swaps a symlink or replaces the directory is not seen (call
        `reload` then, or roll out bundles, the atomic way to change several files).
        """
        if self.root is None:
            raise ValueError("no policy directory to watch (the kernel config has no `policies`)")
        if self._watcher is not None:
            return
        try:
            import watchfiles
        except ImportError:  # pragma: no cover - installed with the kernel's `watch` extra
            raise ImportError("watching the policy directory needs watchfiles: pip install 'nexuskv[watch]'") from None
        root = self.root

        def run() -> None:
            # `watch` yields batches of changes debounced over `debounce_ms`; stop_event ends it within a step.
            # watchfiles yields once nothing changed for `step` ms, or after `debounce` ms of changes at the most
            for _changes in watchfiles.watch(root, stop_event=self._stop, debounce=10 * debounce_ms, step=debounce_ms,
                                             watch_filter=_is_policy_file, raise_interrupt=False):  # fmt: skip
                if self._stop.is_set():
                    return
                self.reload(source="watch")

        self._watcher = threading.Thread(target=run, name="nexuskv-policy-watch", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Stop watching."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)


def _is_policy_file(_change: Any, path: str) -> bool:
    return path.endswith(".toml")
