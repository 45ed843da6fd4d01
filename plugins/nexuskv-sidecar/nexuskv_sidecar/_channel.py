"""Private: the channel between a sidecar worker and the kernel's process, and the kernel's side of it.

A worker (`nexuskv_sidecar.worker`) serves HTTP: it authenticates, bounds, parses and checks each body, and asks
the kernel's process for the decision over a Unix socket pair the kernel's process made and handed to it at
spawn (an inherited descriptor: no path, no port, nothing another process or user can connect to). Frames are a
4-byte little-endian length and a pickle; only the two ends of the pair, both this package's code started by the
same sidecar, ever write to it.

Worker -> kernel: `(call_id, op, args)`. Kernel -> worker: `(call_id, "ok", value)`, `(call_id, "err", (status,
detail, problems))`, and for a decision stream `(stream_id, "rec", record)` and `(stream_id, "end", None)`.
Plans and routes are answered on the channel's reader thread in the kernel's process (they are CPU-bound and
bounded by their deadline); every other call on a thread pool, so a slow commit never holds a plan up; each
decision stream on a thread of its own (a worker opens at most `_stream.MAX_STREAMS` per token). The worker's
side is `nexuskv_sidecar._remote`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from nexuskv import get_logger
from nexuskv_sidecar._backend import KernelBackend
from nexuskv_sidecar._codec import ApiError

__all__ = ["MAX_FRAME", "Channel", "frame", "serve_channel"]

log = get_logger("nexuskv_sidecar")
_LEN = struct.Struct("<I")
MAX_FRAME = 256 << 20  # a commit's payloads travel as one frame; the HTTP layer bounds bodies below this
_INLINE = frozenset({"plan", "route"})


def frame(message: Any) -> bytes:
    """One message as it travels: its length, then its pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


class Channel:
    """Framed pickles over a connected socket: `send` from any thread, `recv` from one reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        """Send one message (whole, never interleaved with another thread's)."""
        data = frame(message)
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> Any:
        """The next message; `EOFError` when the other end is gone."""
        (n,) = _LEN.unpack(self._exact(4))
        if n > MAX_FRAME:
            raise EOFError(f"a frame of {n} bytes is over the channel's limit")
        return pickle.loads(self._exact(n))

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the other end closed the channel")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        """Close the socket (the other end's `recv` ends with `EOFError`)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# ---------------------------------------------------------------------------------------------- kernel's side


def serve_channel(channel: Channel, backend: KernelBackend, pool: concurrent.futures.Executor,
                  on_ready: Callable[[int], None] = lambda pid: None) -> None:  # fmt: skip
    """Answer one worker's calls until it closes the channel (runs on a thread of the kernel's process).

    `on_ready(pid)` is called when the worker says it accepts connections.
    """
    streams: dict[int, Any] = {}

    def answer(call_id: int, fn: Callable[[], Any]) -> None:
        try:
            reply: tuple[int, str, Any] = (call_id, "ok", fn())
        except ApiError as exc:
            reply = (call_id, "err", (exc.status, exc.detail, exc.problems))
        except Exception as exc:
            log.error("sidecar worker call failed", error=f"{type(exc).__name__}: {exc}")
            reply = (call_id, "err", (500, f"internal error: {type(exc).__name__}", []))
        with contextlib.suppress(OSError):  # the worker is gone: its reader ends the loop
            channel.send(reply)

    try:
        while True:
            call_id, op, args = channel.recv()
            if op == "ready":
                on_ready(args)
            elif op == "subscribe":
                streams[call_id] = sub = backend.decision_log.subscribe()
                threading.Thread(target=_pump, args=(channel, call_id, sub), name="nexuskv-sidecar-stream",
                                 daemon=True).start()  # fmt: skip
            elif op == "unsubscribe":
                sub = streams.pop(call_id, None)
                if sub is not None:
                    sub.close()
            elif op in _INLINE:
                answer(call_id, _call(backend, op, args))
            else:
                pool.submit(answer, call_id, _call(backend, op, args))
    except (EOFError, OSError):
        pass
    except Exception as exc:  # a frame that does not unpickle to a call: this worker is not speaking the protocol
        log.error("sidecar worker sent a malformed frame; closing its channel", error=f"{type(exc).__name__}: {exc}")
        channel.close()
    finally:
        for sub in streams.values():
            sub.close()


def _call(backend: KernelBackend, op: str, args: tuple[Any, ...]) -> Callable[[], Any]:
    if op == "recent":
        return lambda: backend.decision_log.recent(*args)
    if op not in ("plan", "route", "commit", "materialize", "report", "status", "metrics", "healthz"):

        def unknown() -> Any:
            raise ApiError(500, f"unknown call {op!r}")

        return unknown
    fn = getattr(backend, op)
    return lambda: fn(*args)


def _pump(channel: Channel, stream_id: int, sub: Any) -> None:
    """Forward one decision subscription's records to the worker until it is closed."""
    try:
        while not sub.closed:
            record = sub.get(0.25)
            if record is not None:
                channel.send((stream_id, "rec", record))
        channel.send((stream_id, "end", None))
    except OSError:
        sub.close()
