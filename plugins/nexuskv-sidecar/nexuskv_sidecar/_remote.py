"""Private: a worker's backend, which asks the kernel's process for every decision over the channel (`_channel`).

It lives on the worker's event loop: a plan's call is written and its answer read on the loop, with no thread
between (a thread handoff each way costs about as much as the rest of the round trip). Calls made from the
worker's thread pool (commit, materialize, report, status, metrics) wait on a thread-safe future instead.
A call waits at most its timeout; when the kernel's process is gone or late, a plan fails open to `recompute`
(as the kernel itself does) and every other call is a 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import pickle
import queue
import socket
import threading
import time
from typing import Any

from nexuskv import NodeState, Request, get_logger, to_dict
from nexuskv_sidecar._backend import fail_open
from nexuskv_sidecar._binary import Parsed
from nexuskv_sidecar._channel import FrameTooLarge, frame, take_frame
from nexuskv_sidecar._codec import ApiError

__all__ = ["RemoteBackend"]

log = get_logger("nexuskv_sidecar")
_STREAM_KEPT = 1000  # records a worker's decision stream holds before it drops (as the kernel's own subscriber)
_GONE = (503, "the sidecar's kernel process is gone", [])


class RemoteBackend:
    """The backend of a worker: the kernel of the process at the other end of the channel."""

    def __init__(self, node: str, max_deadline_ms: float) -> None:
        self.node = node
        self.max_deadline_ms = max_deadline_ms
        self.decision_log = _RemoteLog(self)
        self.gone = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, asyncio.Future[Any] | concurrent.futures.Future[Any]] = {}
        self._streams: dict[int, _RemoteSubscription] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._transport: asyncio.Transport | None = None

    async def connect(self, sock: socket.socket) -> None:
        """Use `sock` (the worker's end of the channel) from the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._transport, _ = await self._loop.create_unix_connection(lambda: _Reader(self), sock=sock)

    # ------------------------------------------------------------------------------------------ plumbing

    def _send(self, message: Any) -> None:
        try:
            data = frame(message)
        except FrameTooLarge as exc:
            raise ApiError(413, f"body: too large to hand to the kernel's process ({exc})") from None
        if self._transport is None or self._loop is None or self.gone.is_set():
            raise ApiError(*_GONE)
        if threading.get_ident() == self._loop_thread:
            self._transport.write(data)
        else:
            self._loop.call_soon_threadsafe(self._transport.write, data)

    def _arrived(self, call_id: int, kind: str, value: Any) -> None:
        if kind in ("rec", "end"):
            sub = self._streams.get(call_id)
            if sub is not None:
                sub.offer(value) if kind == "rec" else sub.end()
            return
        with self._lock:
            fut = self._waiting.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_result((kind, value))

    def _lost(self, why: str) -> None:
        if not self.gone.is_set():
            log.warning("sidecar worker lost its kernel process", error=why)
        self.gone.set()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_result(("err", _GONE))
        for sub in list(self._streams.values()):
            sub.end()

    @staticmethod
    def _value(kind: str, value: Any) -> Any:
        if kind == "err":
            raise ApiError(*value)
        return value

    def call(self, op: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """`op(*args)` in the kernel's process, from a thread other than the loop's; `ApiError` as raised there."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._ids)
        with self._lock:
            self._waiting[call_id] = fut
        try:
            self._send((call_id, op, args, time.monotonic() + timeout_s))
            return self._value(*fut.result(timeout_s))
        except concurrent.futures.TimeoutError:
            raise ApiError(503, f"the sidecar's kernel process did not answer {op} within {timeout_s:g} s") from None
        finally:
            with self._lock:
                self._waiting.pop(call_id, None)

    async def acall(self, op: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """`op(*args)` in the kernel's process, from the loop."""
        assert self._loop is not None
        fut = self._loop.create_future()
        call_id = next(self._ids)
        with self._lock:
            self._waiting[call_id] = fut
        try:
            self._send((call_id, op, args, time.monotonic() + timeout_s))
            async with asyncio.timeout(timeout_s):
                return self._value(*await fut)
        except TimeoutError:
            raise ApiError(503, f"the sidecar's kernel process did not answer {op} within {timeout_s:g} s") from None
        finally:
            with self._lock:
                self._waiting.pop(call_id, None)

    def _deadline_s(self, head: Request) -> float:
        asked = head.slo.deadline_ms
        return (asked if asked is not None else self.max_deadline_ms) / 1000 + 1.0

    # ------------------------------------------------------------------------------------------ operations

    async def aplan(self, req: Request | Parsed, session: str | None) -> dict[str, Any]:
        """The kernel's plan; `recompute` (fail-open, with the reason) when its process is gone or late."""
        parts = req if isinstance(req, Parsed) else Parsed.of(req)  # ids as bytes: far cheaper to send than ints
        try:
            return await self.acall("plan", parts, session, timeout_s=self._deadline_s(parts.head))
        except ApiError as exc:
            if exc.status < 500:
                raise
            return to_dict(fail_open(parts, f"sidecar: {exc.detail}"))
        except Exception as exc:  # the loop or the transport closing under the call: still a plan
            return to_dict(fail_open(parts, f"sidecar: {type(exc).__name__}"))

    def plan(self, req: Request | Parsed, session: str | None) -> dict[str, Any]:
        """`aplan` from a thread other than the loop's."""
        parts = req if isinstance(req, Parsed) else Parsed.of(req)
        try:
            return self.call("plan", parts, session, timeout_s=self._deadline_s(parts.head))
        except ApiError as exc:
            if exc.status < 500:
                raise
            return to_dict(fail_open(parts, f"sidecar: {exc.detail}"))

    def route(self, req: Request | Parsed, nodes: list[NodeState]) -> dict[str, Any]:
        """The kernel's route decision."""
        parts = req if isinstance(req, Parsed) else Parsed.of(req)
        return self.call("route", parts, nodes, timeout_s=self._deadline_s(parts.head))

    def commit(self, req: Request, payloads: dict[tuple[int, int], bytes]) -> dict[str, Any]:
        """Hand payloads to the kernel's writer."""
        return self.call("commit", req, payloads)

    def materialize(self, plan: Any, req: Request, with_payloads: bool) -> dict[str, Any]:
        """Load and verify a plan's state in the kernel's process."""
        return self.call("materialize", plan, req, with_payloads)

    def report(self, plan: Any, report: Any, req: Request | None) -> dict[str, Any]:
        """A load report, applied once per plan across every worker (the kernel's process keeps the set)."""
        return self.call("report", plan, report, req)

    def status(self) -> dict[str, Any]:
        """The kernel's status document."""
        return self.call("status")

    def metrics(self) -> bytes:
        """The kernel's Prometheus series."""
        return self.call("metrics")

    def healthz(self) -> dict[str, Any]:
        """Liveness of the kernel's process (a 503 when it is gone)."""
        return self.call("healthz", timeout_s=5.0)

    def subscribe(self, tenant: str | None = None) -> _RemoteSubscription:
        """A decision subscription fed by the kernel's process, of `tenant` (None: all); call on the loop."""
        stream_id = next(self._ids)
        sub = self._streams[stream_id] = _RemoteSubscription(self, stream_id)
        try:
            self._send((stream_id, "subscribe", (tenant,), None))
        except ApiError:
            sub.end()
        return sub

    def unsubscribe(self, stream_id: int) -> None:
        """Stop a decision subscription (call on the loop)."""
        sub = self._streams.pop(stream_id, None)
        if sub is not None and not self.gone.is_set():
            self._send_drops(sub)
            self._send((stream_id, "unsubscribe", (), None))

    def _dropped(self, sub: _RemoteSubscription) -> None:
        """A record was dropped at this worker: the kernel's process counts it within a second (on the loop)."""
        if not sub.drops_pending_sent and self._loop is not None:
            sub.drops_pending_sent = True
            self._loop.call_later(1.0, self._send_drops, sub)

    def _send_drops(self, sub: _RemoteSubscription) -> None:
        sub.drops_pending_sent = False
        n, sub.drops_unsent = sub.drops_unsent, 0
        if n and not self.gone.is_set():
            with contextlib.suppress(ApiError):  # the kernel's process is gone: nothing counts any more
                self._send((sub.stream_id, "dropped", (n,), None))


class _Reader(asyncio.Protocol):
    """Frames in from the kernel's process, on the loop."""

    def __init__(self, backend: RemoteBackend) -> None:
        self.backend = backend
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            try:
                message = take_frame(self.buf)
            except EOFError as exc:
                self.backend._lost(str(exc))
                if self.backend._transport is not None:
                    self.backend._transport.close()
                return
            if message is None:
                return
            self.backend._arrived(*pickle.loads(message))

    def connection_lost(self, exc: Exception | None) -> None:
        self.backend._lost(str(exc) if exc else "the kernel's process closed the channel")


class _RemoteLog:
    """The kernel's decision log as a worker sees it: `subscribe()`, `arecent(n)`."""

    def __init__(self, backend: RemoteBackend) -> None:
        self.backend = backend

    def subscribe(self) -> _RemoteSubscription:
        return self.backend.subscribe()

    def subscribe_for(self, tenant: str | None) -> _RemoteSubscription:
        """A subscription filtered in the kernel's process (only `tenant`'s records cross the channel)."""
        return self.backend.subscribe(tenant)

    async def arecent(self, n: int) -> list[dict[str, Any]]:
        return list(await self.backend.acall("recent", n, timeout_s=5.0))


class _RemoteSubscription:
    """A bounded queue of decision records from the kernel's process (full: newer records are dropped)."""

    def __init__(self, backend: RemoteBackend, stream_id: int) -> None:
        self.backend = backend
        self.stream_id = stream_id
        self._items: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.closed = False
        self.drops = 0
        self.drops_unsent = 0  # not yet counted in the kernel's process
        self.drops_pending_sent = False

    def offer(self, record: dict[str, Any]) -> None:
        if self._items.qsize() >= _STREAM_KEPT:
            self.drops += 1
            self.drops_unsent += 1
            self.backend._dropped(self)
        else:
            self._items.put(record)

    def end(self) -> None:
        self.closed = True

    def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        try:
            return self._items.get(timeout=timeout) if timeout else self._items.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.unsubscribe(self.stream_id)
