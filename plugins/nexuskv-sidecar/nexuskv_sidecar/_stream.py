"""Private: answers that are not one JSON document: the decision stream (JSON lines) and raw bytes (metrics).

A stream polls its `Subscription` without blocking (the records come from the kernel's observer thread) and
yields to the event loop between polls, so no thread is held per open stream. Streams per caller are capped
(`MAX_STREAMS`); every stream ends when the caller hangs up, at its `limit`, when the kernel closes, or when the
sidecar stops (`Streams.stop`), so shutdown never waits on a follower.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from nexuskv_sidecar._codec import ApiError

__all__ = ["MAX_STREAMS", "Raw", "Stream", "Streams", "count"]

MAX_STREAMS = 8  # open decision streams per token's tenant (the operator's counted apart)
_POLL_S = 0.05


def count(query: Mapping[str, str], name: str) -> int | None:
    """A non-negative integer query parameter (None when absent); 400 otherwise."""
    raw = query.get(name)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise ApiError(400, f"{name}: expected a non-negative integer, got {raw!r}")
    return int(raw)


class Raw:
    """An answer that is already bytes, with its content type (the Prometheus text format)."""

    __slots__ = ("body", "content_type")

    def __init__(self, body: bytes, content_type: bytes) -> None:
        self.body = body
        self.content_type = content_type


class Streams:
    """The open streams per caller, and the stop signal of them all (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open: dict[str, int] = {}
        self.stopping = threading.Event()

    def enter(self, caller: str) -> None:
        """Count one more stream of `caller`; 429 past `MAX_STREAMS`."""
        with self._lock:
            if self.open.get(caller, 0) >= MAX_STREAMS:
                raise ApiError(429, f"{MAX_STREAMS} decision streams are open for this token already")
            self.open[caller] = self.open.get(caller, 0) + 1

    def leave(self, caller: str) -> None:
        """One stream of `caller` ended."""
        with self._lock:
            self.open[caller] -= 1

    def stop(self) -> None:
        """End every stream (the sidecar is stopping)."""
        self.stopping.set()


class Stream:
    """A streamed answer: one JSON line per decision record of `tenant` (None: all)."""

    def __init__(self, log: Any, streams: Streams, caller: str, tenant: str | None, recent: int | None,
                 limit: int | None) -> None:  # fmt: skip
        streams.enter(caller)  # 429 before the answer starts
        self.log = log
        self.streams = streams
        self.caller = caller
        self.tenant = tenant
        self.recent = recent
        self.limit = limit

    async def serve(self, receive: Callable[[], Awaitable[dict[str, Any]]],
                    send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:  # fmt: skip
        """Send records until the caller hangs up, the limit is reached, the kernel closes or the sidecar stops."""
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await self._run(send, gone)
        finally:
            watcher.cancel()
            self.streams.leave(self.caller)

    async def _run(self, send: Callable[[dict[str, Any]], Awaitable[None]], gone: asyncio.Event) -> None:
        subscribe_for = getattr(self.log, "subscribe_for", None)  # a worker's: filtered where the records are
        sub = subscribe_for(self.tenant) if subscribe_for else self.log.subscribe()
        sent = 0
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})  # fmt: skip
            backlog: list[dict[str, Any]] = []
            if self.recent:  # a worker's log is in another process: asked without blocking the loop
                arecent = getattr(self.log, "arecent", None)
                backlog = list(await arecent(self.recent) if arecent else self.log.recent(self.recent))
            while not gone.is_set() and not self.streams.stopping.is_set() and (
                    self.limit is None or sent < self.limit):  # fmt: skip
                record = backlog.pop(0) if backlog else sub.get(0)
                if record is None:
                    if sub.closed:
                        break
                    await asyncio.sleep(_POLL_S)
                    continue
                if self.tenant is not None and record.get("tenant") != self.tenant:
                    continue
                await send({"type": "http.response.body", "body": orjson.dumps(record) + b"\n", "more_body": True})
                sent += 1
        finally:
            sub.close()
            if not gone.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
