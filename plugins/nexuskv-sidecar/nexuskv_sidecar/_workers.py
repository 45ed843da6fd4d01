"""Private: the sidecar's worker processes, seen from the kernel's process: spawn, answer, restart, stop.

With `workers = N` (N > 1) the kernel's process serves no HTTP itself. It starts N workers
(`nexuskv_sidecar.worker`), each inheriting a listening socket (one each, all on the sidecar's port) and one end of
its own socket pair, and answers
their calls (`_channel.serve_channel`) on one thread per worker. HTTP, authentication, parsing and checking run in
the workers, in parallel on as many cores; the decisions (plan, route, commit, materialize, report) are the one
kernel's, so MACs, tenants, deadlines, breakers, sessions and the report-once rule are exactly the in-process
ones. A worker that dies is started again (past `_RESTARTS` restarts a minute, after a growing pause, never
giving up); the kernel's process going away ends every worker (their channels close).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from nexuskv import get_logger
from nexuskv_sidecar._backend import KernelBackend
from nexuskv_sidecar._channel import Channel, serve_channel

__all__ = ["Workers"]

log = get_logger("nexuskv_sidecar")
_RESTARTS = 10  # restarts of dead workers per minute, all workers together, before restarts back off
_SEND_TIMEOUT_S = 10.0  # a worker that takes no answer for this long is ended (and started again)
_GRACE_S = 7.0  # SIGTERM to kill: the workers' server finishes requests in flight for up to 5 s
_STOP_SIGNALS = frozenset({-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP})  # exit statuses of a stop signal
_STOP_WAIT_S = 2.0  # a worker stopped by such a signal: how long the sidecar waits to be stopped too


class _Worker:
    def __init__(self, index: int, proc: subprocess.Popen[bytes], channel: Channel) -> None:
        self.index = index
        self.proc = proc
        self.channel = channel
        self.ready = threading.Event()
        self.thread: threading.Thread | None = None


class Workers:
    """One worker process per listening socket in `socks` (all on one port), each answered by `kernel`.

    `settings` is what each worker is told at start.
    """

    def __init__(self, kernel: Any, socks: list[socket.socket], settings: dict[str, Any]) -> None:
        self.backend = KernelBackend(kernel)
        self.socks = socks
        self.count = len(socks)
        self.settings = settings
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="nexuskv-sidecar-kernel")
        self.workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._restarts: list[float] = []

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every worker; returns once each accepts connections (`RuntimeError` if one does not)."""
        try:
            for i in range(self.count):
                self.workers.append(self._spawn(i))
        except BaseException:
            self.close()
            raise
        end = time.monotonic() + timeout_s
        for w in self.workers:
            while not w.ready.wait(0.05):
                if w.proc.poll() is not None or time.monotonic() > end:
                    self.close()
                    raise RuntimeError(f"sidecar worker {w.index} did not start (exit status {w.proc.poll()})")

    @property
    def pids(self) -> list[int]:
        """The workers' process ids (those running now)."""
        with self._lock:
            return [w.proc.pid for w in self.workers if w.proc.poll() is None]

    def _spawn(self, index: int) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fds = (self.socks[index].fileno(), theirs.fileno())  # a restarted worker takes its socket's backlog
            proc = subprocess.Popen([sys.executable, "-m", "nexuskv_sidecar.worker", *map(str, fds)], pass_fds=fds)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        worker = _Worker(index, proc, Channel(ours, strict=True, send_timeout_s=_SEND_TIMEOUT_S))
        with contextlib.suppress(OSError):  # it died at once: its thread sees the channel closed, starts it again
            worker.channel.send(self.settings)
        worker.thread = threading.Thread(target=self._serve, args=(worker,), name=f"nexuskv-sidecar-worker-{index}",
                                         daemon=True)  # fmt: skip
        worker.thread.start()
        return worker

    def _serve(self, worker: _Worker) -> None:
        serve_channel(worker.channel, self.backend, self.pool, on_ready=lambda pid: worker.ready.set())
        try:  # the channel is closed: the worker exits by itself (it lost its kernel), or is made to
            status = worker.proc.wait(_SEND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            status = worker.proc.wait()
        if status in _STOP_SIGNALS and self._closing.wait(_STOP_WAIT_S):
            return  # a stop signal to the whole process group (Ctrl-C, a service manager): no successor
        while not self._closing.is_set():
            with self._lock:
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < 60] + [now]
                over = len(self._restarts) - _RESTARTS
            if over > 0:  # a crash loop: back off (never give up: a sidecar without workers serves nothing)
                log.error("sidecar worker died; restarts this minute are over the budget, backing off",
                          worker=worker.index, status=status, wait_s=min(30.0, 0.5 * 2 ** min(over, 6)))  # fmt: skip
                if self._closing.wait(min(30.0, 0.5 * 2 ** min(over, 6))):
                    return
            else:
                log.warning("sidecar worker died; starting it again", worker=worker.index, status=status)
            with self._lock:
                if self._closing.is_set():
                    return
                try:
                    self.workers[worker.index] = self._spawn(worker.index)
                    return
                except Exception as exc:  # tried again after the next pause, never given up
                    log.error("sidecar worker could not be started", worker=worker.index,
                              error=f"{type(exc).__name__}: {exc}")  # fmt: skip

    def close(self, timeout_s: float = _GRACE_S) -> None:
        """Stop every worker (SIGTERM: requests in flight finish; killed after `timeout_s`) and the call pool."""
        self._closing.set()
        with self._lock:
            workers = list(self.workers)
        for w in workers:
            if w.proc.poll() is None:
                w.proc.terminate()
        end = time.monotonic() + timeout_s
        for w in workers:
            try:
                w.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.channel.hangup()  # its reader thread closes it
            if w.thread is not None:
                w.thread.join(timeout_s)
        with contextlib.suppress(Exception):
            self.pool.shutdown(wait=True, cancel_futures=True)
