"""Private: the channel between a sidecar worker and the kernel's process, and the kernel's side of it.

A worker (`nexuskv_sidecar.worker`) serves HTTP: it authenticates, bounds, parses and checks each body, and asks
the kernel's process for the decision over a Unix socket pair the kernel's process made and handed to it at
spawn (an inherited descriptor: no path, no port, nothing another process or user can connect to). Frames are a
4-byte little-endian length and a pickle; only the two ends of the pair, both this package's code started by the
same sidecar, ever write to it.

Worker -> kernel: `(call_id, op, args, expires)`, unpickled by a loader that makes contract objects only.
Worker -> kernel, no answer: `(stream_id, "dropped", (n,), None)`, records its full stream dropped (counted in
`nexuskv_decision_subscriber_drops_total`).
Kernel -> worker: `(call_id, "ok", value)`, `(call_id, "err", (status, detail, problems))`, and for a decision
stream `(stream_id, "rec", record)` and `(stream_id, "end", None)`. Plans and routes of requests up to 16k tokens
are answered on the channel's reader thread in the kernel's process (CPU-bound and bounded by their deadline);
every other call on a thread pool, so a slow commit never holds a plan up; each decision stream on a thread of its
own (a worker opens at most `_stream.MAX_STREAMS` per token). The worker's side is `nexuskv_sidecar._remote`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import io
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from nexuskv import Request, get_logger
from nexuskv_sidecar._backend import KernelBackend
from nexuskv_sidecar._binary import _parsed
from nexuskv_sidecar._codec import ApiError

__all__ = ["MAX_FRAME", "Channel", "FrameTooLarge", "frame", "serve_channel", "take_frame"]

log = get_logger("nexuskv_sidecar")
_LEN = struct.Struct("<I")
MAX_FRAME = 256 << 20  # a commit's payloads travel as one frame; the HTTP layer bounds bodies below this
_INLINE = frozenset({"plan", "route", "healthz"})
_INLINE_TOKENS = 16_384  # plans and routes of requests up to this many tokens run on the reader thread; larger
# ones on the pool, so one tenant's long requests do not hold up the other tenants' plans on the same worker


class FrameTooLarge(ValueError):
    """A message over `MAX_FRAME` bytes: never sent (the call it answers fails alone)."""


def frame(message: Any) -> bytes:
    """One message as it travels: its length, then its pickle (`FrameTooLarge` past `MAX_FRAME`)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_FRAME:
        raise FrameTooLarge(f"{len(data)} bytes, over the channel's limit of {MAX_FRAME}")
    return _LEN.pack(len(data)) + data


_MODULES = frozenset({"nexuskv.paths.route_types", "nexuskv.paths.load"})  # NodeState, LoadReport


def take_frame(buf: bytearray) -> bytes | None:
    """The first whole frame's pickle in `buf`, taken out of it; None while it is incomplete.

    `EOFError` when the frame announces more than `MAX_FRAME` bytes (it is never waited for). Both ends read with
    it: `Channel.recv` and the worker's loop (`_remote`).
    """
    if len(buf) < 4:
        return None
    (n,) = _LEN.unpack_from(buf)
    if n > MAX_FRAME:
        raise EOFError(f"a frame of {n} bytes is over the channel's limit")
    if len(buf) < 4 + n:
        return None
    data = bytes(buf[4:4 + n])
    del buf[:4 + n]
    return data


class _Contracts(pickle.Unpickler):
    """Unpickles what a worker may send and nothing else.

    That is the kernel's contract classes and their enums, and a request whose ids travel as bytes: a worker
    parses untrusted HTTP, and a bug there must not become code run in the process holding the keys.
    """

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("nexuskv_sidecar._binary", "_parsed"):
            return _checked_parsed
        if "." not in name and (module.startswith("nexuskv.contracts.") or module in _MODULES):
            try:  # a plain name, defined in that module (no re-export either)
                cls = super().find_class(module, name)
            except (AttributeError, ImportError):
                cls = None
            if isinstance(cls, type) and cls.__module__ == module and (attrs.has(cls) or issubclass(cls, enum.Enum)):
                return cls
        raise pickle.UnpicklingError(f"{module}.{name} is not something a worker sends")


def _checked_parsed(head: Any, raw: Any) -> Any:
    if not isinstance(head, Request) or not isinstance(raw, bytes):
        raise pickle.UnpicklingError("a request's head and ids are a Request and bytes")
    return _parsed(head, raw)


class Channel:
    """Framed pickles over a connected socket: `send` from any thread, `recv` from one reader thread.

    `strict`: unpickle contract objects only (the kernel's end). `send_timeout_s`: a send that cannot finish in
    that time (a worker that stopped reading) raises `OSError` instead of blocking the sender for good.
    """

    def __init__(self, sock: socket.socket, *, strict: bool = False, send_timeout_s: float | None = None) -> None:
        self.sock = sock
        self.strict = strict
        self._send_lock = threading.Lock()
        self._buf = bytearray()
        self._closed = False
        if send_timeout_s is not None:
            whole = int(send_timeout_s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", whole, int((send_timeout_s - whole) * 1e6)))  # fmt: skip

    @property
    def closed(self) -> bool:
        """True once hung up: nothing more is sent, and nothing already read is handed out."""
        return self._closed

    def send(self, message: Any) -> None:
        """Send one message (whole, never interleaved with another thread's).

        A send that fails part-way (the other end gone, or not reading within the send timeout) hangs the channel
        up before the lock is released: no frame ever follows half of one.
        """
        data = frame(message)
        with self._send_lock:
            if self._closed:
                raise BrokenPipeError("the channel was hung up")
            try:
                self.sock.sendall(data)
            except BaseException:
                self._hangup()
                raise

    def recv(self) -> Any:
        """The next message; `EOFError` when the other end is gone, breaks the framing, or the channel was hung up.

        Reads in large chunks: frames that arrived together cost one system call (and one wait for the GIL).
        """
        while True:
            if self._closed:
                raise EOFError("the channel was hung up")
            data = take_frame(self._buf)
            if data is not None:
                return _Contracts(io.BytesIO(data)).load() if self.strict else pickle.loads(data)
            self._fill()

    def _fill(self) -> None:
        if self._closed:
            raise EOFError("the channel was hung up")
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise EOFError("the other end closed the channel")
        self._buf += chunk

    def pending(self) -> int:
        """Bytes read but not yet handed out (none after the first message, for a worker's settings)."""
        return len(self._buf)

    def _hangup(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def hangup(self) -> None:
        """End the channel from any thread: the other end's `recv` ends, and so does this end's.

        Its buffered frames are dropped. The descriptor stays open until `close`, on the reader's thread.
        """
        self._hangup()

    def close(self) -> None:
        """Hang up and close the descriptor (on the reader's thread, or once no thread uses the channel)."""
        self._hangup()
        with self._send_lock:
            self._buf.clear()
            self.sock.close()


# ---------------------------------------------------------------------------------------------- kernel's side


def serve_channel(channel: Channel, backend: KernelBackend, pool: concurrent.futures.Executor,
                  on_ready: Callable[[int], None] = lambda pid: None) -> None:  # fmt: skip
    """Answer one worker's calls until it closes the channel (runs on a thread of the kernel's process).

    A call is `(call_id, op, args, expires)`: `expires` is the `time.monotonic()` (one clock for every process of
    the machine) after which the worker has stopped waiting, so a call still queued then is not run at all (a late
    report or commit would act after its caller was told it failed). `on_ready(pid)` is called when the worker
    says it accepts connections. The channel is closed whenever this returns.
    """
    streams: dict[int, Any] = {}

    def answer(call_id: int, op: str, fn: Callable[[], Any], expires: float | None) -> None:
        if channel.closed:  # read before the channel was hung up: its worker is gone, nobody waits for this
            return
        try:
            if expires is not None and time.monotonic() > expires:
                raise ApiError(503, f"{op} expired in the kernel process's queue (the worker stopped waiting)")
            reply: tuple[int, str, Any] = (call_id, "ok", fn())
        except ApiError as exc:
            reply = (call_id, "err", (exc.status, exc.detail, exc.problems))
        except Exception as exc:
            log.error("sidecar worker call failed", op=op, error=f"{type(exc).__name__}: {exc}")
            reply = (call_id, "err", (500, f"internal error: {type(exc).__name__}", []))
        try:
            try:
                channel.send(reply)
            except FrameTooLarge as exc:  # this one answer cannot travel: the call fails, the worker goes on
                channel.send((call_id, "err", (507, f"{op}: the answer is too large for a worker ({exc}); ask for "
                                                    "less (materialize without payloads=1, fewer recent records)",
                                               [])))  # fmt: skip
        except OSError:  # the worker is gone, or stopped reading: the channel was hung up (it is started again)
            pass

    try:
        while True:
            call_id, op, args, expires = channel.recv()
            if op == "ready":
                on_ready(args)
            elif op == "subscribe":
                _subscribe(channel, backend, streams, call_id, *args)
            elif op == "dropped":  # records a worker's full stream dropped: counted with the kernel's own
                if isinstance(args[0], int) and 0 < args[0] <= 1 << 32:
                    backend.decision_log.count_drops(args[0])
            elif op == "unsubscribe":
                sub = streams.pop(call_id, None)
                if sub is not None:
                    sub.close()
            elif op in _INLINE and (op == "healthz" or len(args[0].ids) <= _INLINE_TOKENS):
                answer(call_id, op, _call(backend, op, args), expires)  # no thread handoff: most plans
            else:
                pool.submit(answer, call_id, op, _call(backend, op, args), expires)
    except (EOFError, OSError):
        pass
    except Exception as exc:  # a frame that is not a call of the protocol: this worker is not to be trusted
        log.error("sidecar worker sent a malformed frame; closing its channel", error=f"{type(exc).__name__}: {exc}")
    finally:
        channel.close()
        for sub in streams.values():
            sub.close()


def _subscribe(channel: Channel, backend: KernelBackend, streams: dict[int, Any], stream_id: int,
               tenant: str | None) -> None:  # fmt: skip
    sub = backend.decision_log.subscribe()
    try:
        threading.Thread(target=_pump, args=(channel, stream_id, sub, tenant), name="nexuskv-sidecar-stream",
                         daemon=True).start()  # fmt: skip
    except RuntimeError:  # no thread to be had: this stream ends at once, nothing else does
        sub.close()
        with contextlib.suppress(OSError, FrameTooLarge):
            channel.send((stream_id, "end", None))
        return
    streams[stream_id] = sub


def _call(backend: KernelBackend, op: str, args: tuple[Any, ...]) -> Callable[[], Any]:
    if op == "recent":
        return lambda: backend.decision_log.recent(*args)
    if op not in ("plan", "route", "commit", "materialize", "report", "status", "metrics", "healthz"):

        def unknown() -> Any:
            raise ApiError(500, f"unknown call {op!r}")

        return unknown
    fn = getattr(backend, op)
    return lambda: fn(*args)


def _pump(channel: Channel, stream_id: int, sub: Any, tenant: str | None) -> None:
    """Forward one decision subscription's records (of `tenant`; None: all) to the worker until it is closed."""
    try:
        while not sub.closed:
            record = sub.get(0.25)
            if record is not None and (tenant is None or record.get("tenant") == tenant):
                channel.send((stream_id, "rec", record))
        channel.send((stream_id, "end", None))
    except (OSError, FrameTooLarge):
        sub.close()
