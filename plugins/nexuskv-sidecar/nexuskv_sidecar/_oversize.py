"""Private: what the sidecar does with a token that keeps sending bodies far over the limit.

A body over twice its limit is refused on its `Content-Length`, unread, and its connection closed (`SidecarApp`).
That costs the event loop an accept, a header parse and an answer, and costs the machine what the sender keeps
pushing until the close reaches it; a tenant doing it flat out, on a two-core host, took a share of both cores
the other tenants' plans needed (bench/sidecar.py, isolation). So a token is given a budget: after `STRIKES`
such refusals within `WINDOW_S`, its next over-limit connections are *held* for `hold_s` before they are answered
(413) and closed. Held, a connection is not read past what uvicorn buffers (64 KiB, then it pauses reading), so
TCP flow control stops the sender: the flood slows to a few connections per `hold_s` and costs nothing while it
waits. Holds are bounded per token (`per_token`) and in all (`MAX_HELD`); past either bound a connection is
refused and closed at once, as before, so holding never costs more than a fixed number of sockets. A client
that sends one oversize body by mistake is answered as before; only repeats within the window are held. Holds end
early when the sidecar stops, so shutdown never waits on them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time

__all__ = ["MAX_HELD", "STRIKES", "WINDOW_S", "OversizeHolds"]

STRIKES = 3  # refusals of one token within WINDOW_S before its next over-limit connections are held
WINDOW_S = 10.0
MAX_HELD = 128  # held connections of all tokens together (each is one socket and at most ~200 KiB of buffers)


class OversizeHolds:
    """Per token: recent over-limit refusals, and the connections held for it (loop thread, but `stop`)."""

    def __init__(self, hold_s: float, per_token: int) -> None:
        self.hold_s = hold_s
        self.per_token = per_token
        self.held: dict[str, int] = {}
        self.total = 0
        self.counts = collections.Counter[str]()  # "held" / "closed": what repeat offenders got (for tests, logs)
        self._strikes: dict[str, collections.deque[float]] = {}
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    def strike(self, caller: str) -> bool:
        """Count one over-limit refusal of `caller`; True when this connection is to be held before its answer."""
        now = time.monotonic()
        seen = self._strikes.get(caller)
        if seen is None:
            if len(self._strikes) >= 4096:  # callers are tokens, so few; a bound all the same
                self._strikes = {c: d for c, d in self._strikes.items() if d and now - d[-1] < WINDOW_S}
            seen = self._strikes[caller] = collections.deque(maxlen=STRIKES)
        repeat = len(seen) == STRIKES and now - seen[0] < WINDOW_S
        seen.append(now)
        if not repeat or self.hold_s <= 0 or self._stopping.is_set():
            return False
        if self.held.get(caller, 0) >= self.per_token or self.total >= MAX_HELD:
            self.counts["closed"] += 1
            return False
        self.counts["held"] += 1
        return True

    async def hold(self, caller: str) -> None:
        """Wait `hold_s` (or until the sidecar stops) without reading the connection; counted against the bounds."""
        if self._wake is None:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self.held[caller] = self.held.get(caller, 0) + 1
        self.total += 1
        try:
            if not self._stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.hold_s)
        finally:
            self.total -= 1
            left = self.held[caller] - 1
            if left:
                self.held[caller] = left
            else:
                del self.held[caller]

    def stop(self) -> None:
        """End every hold now and hold nothing more (any thread: the sidecar is stopping)."""
        self._stopping.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed already: nothing is held
                loop.call_soon_threadsafe(wake.set)
