"""Circuit breakers per tier and transport: after repeated failures a path is skipped until it proves healthy.

Breakers are fed with outcomes (loads reported by connectors, writer puts, probes) rather than wrapping calls,
because the calls that fail happen in engines and worker threads, not inside the kernel's hot path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Breaker", "Health"]


class Breaker:
    """A circuit breaker: closed, open after `threshold` consecutive failures, half-open after `cooldown_s`.

    Half-open lets one trial through: a success closes it, a failure opens it again.
    """

    __slots__ = ("_clock", "_lock", "cooldown_s", "failures", "last_error", "name", "opened_at", "state",
                 "threshold", "trial_at", "trips")  # fmt: skip

    def __init__(self, name: str, threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.name = name
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self.state = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.trial_at = 0.0
        self.last_error = ""
        self.trips = 0

    def allow(self) -> bool:
        """May this path be planned on now? An open breaker past its cooldown lets one trial through."""
        if self.state == "closed":
            return True
        with self._lock:
            now = self._clock()
            if self.state == "open" and now - self.opened_at >= self.cooldown_s:
                self.state = "half-open"
                self.trial_at = now
                return True  # the one trial
            if self.state == "half-open" and now - self.trial_at >= self.cooldown_s:
                self.trial_at = now  # the trial never reported back (its plan was not executed): another one
                return True
            return False

    def success(self) -> None:
        """Record a success."""
        if self.state != "closed" or self.failures:
            with self._lock:
                self.state, self.failures = "closed", 0

    def failure(self, error: str, *, severe: bool = False) -> None:
        """Record a failure; `severe` (a timeout, corrupt data) opens the breaker at once."""
        with self._lock:
            self.failures += 1
            self.last_error = error
            if self.state == "half-open" or severe or self.failures >= self.threshold:
                if self.state != "open":
                    self.trips += 1
                self.state = "open"
                self.opened_at = self._clock()


class Health:
    """The breakers of every tier and transport, created on first use."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._args = (threshold, cooldown_s, clock)
        self._breakers: dict[str, Breaker] = {}

    def breaker(self, name: str) -> Breaker:
        """The breaker of one path (tier or transport name)."""
        b = self._breakers.get(name)
        if b is None:
            b = self._breakers.setdefault(name, Breaker(name, *self._args))
        return b

    def allow(self, name: str) -> bool:
        """True when the path's breaker lets plans use it."""
        b = self._breakers.get(name)
        return True if b is None else b.allow()

    def peek(self, name: str) -> bool:
        """Whether the path is usable now (closed), changing nothing.

        A plan made only to be judged, never executed (the warm-up's, a fallback's hindsight), must not take a
        half-open breaker's one trial.
        """
        b = self._breakers.get(name)
        return b is None or b.state == "closed"

    def judging(self) -> Judging:
        """A view of these breakers whose `allow` only peeks (for plans judged, never executed)."""
        return Judging(self)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """State of every breaker, for observability."""
        return {n: {"state": b.state, "failures": b.failures, "trips": b.trips, "last_error": b.last_error}
                for n, b in sorted(dict(self._breakers).items())}  # fmt: skip (a copy: breakers are added meanwhile)


class Judging:
    """`Health` as a plan that is only judged sees it: `allow` peeks, and nothing changes state."""

    __slots__ = ("_health",)

    def __init__(self, health: Health) -> None:
        self._health = health

    def allow(self, name: str) -> bool:
        """True when the path's breaker is closed (no half-open trial is taken)."""
        return self._health.peek(name)

    def breaker(self, name: str) -> Breaker:
        """The breaker itself (read only, by convention)."""
        return self._health.breaker(name)
