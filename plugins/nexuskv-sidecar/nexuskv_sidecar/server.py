"""Run the sidecar: a kernel, the API app, and uvicorn on one socket (`nexuskv serve CONFIG`, or embedded).

`Sidecar(config).start()` serves from a background thread (tests, benches, embedding) and returns the bound port;
`serve_forever()` blocks until SIGINT / SIGTERM. Either way the kernel is closed after the server stops.
With `config.workers` above 1, HTTP is served by that many worker processes sharing the socket, and this process
answers their kernel calls (`nexuskv_sidecar._workers`).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading

import attrs
import uvicorn

from nexuskv import ConfigError, Kernel, KernelConfig, get_logger
from nexuskv_sidecar._config import SidecarConfig
from nexuskv_sidecar._workers import Workers
from nexuskv_sidecar.app import Limits, create_app

__all__ = ["Sidecar"]

log = get_logger("nexuskv_sidecar")


class Sidecar:
    """One kernel served over HTTP on `config.host:config.port` (port 0: a free one, see `port`)."""

    def __init__(self, config: SidecarConfig, kernel: Kernel | None = None) -> None:
        self.config = config
        self.kernel = kernel or (Kernel.from_config(config.kernel) if config.kernel else Kernel(KernelConfig()))
        self._own_kernel = kernel is None
        most = self.kernel.config.max_deadline_ms  # the most the kernel's budget rule gives a plan, stretched or not
        if most > config.max_deadline_ms:  # ... and never more than this server allows a request to ask for
            if self._own_kernel:
                self.kernel.close()
            raise ConfigError(f"the kernel's max_deadline_ms {most:g} is over the sidecar's max_deadline_ms "
                              f"{config.max_deadline_ms:g}: lower the kernel's or raise the sidecar's")  # fmt: skip
        self.limits = Limits(plan_body_bytes=config.max_plan_body_bytes, tokens=config.max_tokens,
                             deadline_ms=config.max_deadline_ms, tenant_concurrency=config.tenant_concurrency,
                             oversize_hold_s=config.oversize_hold_s,
                             oversize_holds_per_token=config.oversize_holds_per_token)  # fmt: skip
        self.app = create_app(self.kernel, config.tokens, max_body_bytes=config.max_body_bytes, limits=self.limits)
        if config.workers > 1:
            if not sys.platform.startswith("linux"):  # elsewhere SO_REUSEPORT does not spread connections
                if self._own_kernel:
                    self.kernel.close()
                raise ConfigError(f"workers = {config.workers} needs Linux (this is {sys.platform}); use workers = 1")
            if config.port:  # the port must be free: SO_REUSEPORT would otherwise share it with any socket of this
                self._listen(config.port, reuse_port=False).close()  # user's that has the option (another sidecar)
        self._sock = self._listen(config.port, reuse_port=config.workers > 1)
        self.port: int = self._sock.getsockname()[1]
        self._socks = [self._sock]
        self.workers: Workers | None = None
        if config.workers > 1:
            # one listening socket per worker on the same port (SO_REUSEPORT: the kernel spreads new connections
            # over them, and only sockets of this user may join): a burst of connections is shared, not taken
            # by whichever worker wakes first
            self._socks += [self._listen(self.port, reuse_port=True) for _ in range(config.workers - 1)]
            self.workers = Workers(self.kernel, self._socks, {
                "node": self.kernel.node, "max_deadline_ms": self.kernel.config.max_deadline_ms,
                "tokens": dict(config.tokens), "max_body_bytes": config.max_body_bytes,
                "limits": attrs.asdict(self.limits)})  # fmt: skip
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, http="httptools", loop="uvloop", log_level="warning", access_log=False, lifespan="off",
            proxy_headers=False, server_header=False, date_header=False, timeout_keep_alive=30,
            timeout_graceful_shutdown=5))  # fmt: skip
        self._thread: threading.Thread | None = None
        self._started = False

    def _listen(self, port: int, reuse_port: bool) -> socket.socket:
        host = self.config.host
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            for other in getattr(self, "_socks", ()):
                other.close()
            if self._own_kernel:
                self.kernel.close()
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
        sock.listen(2048)  # connections made before the server runs wait in the backlog, not refused
        return sock

    @property
    def tenants(self) -> list[str]:
        """The tenants some token acts for."""
        return sorted(set(self.config.tokens.values()))

    @property
    def url(self) -> str:
        """The base URL clients use."""
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    def start(self) -> int:
        """Serve from a background thread (or the workers); returns the port once connections are accepted.

        Once per sidecar (`with Sidecar(...)` calls it): a second start is a `RuntimeError`.
        """
        if self._started:
            raise RuntimeError("this sidecar was started already")
        self._started = True
        if self.workers is not None:
            self.workers.start()
            log.info("sidecar serving", url=self.url, node=self.kernel.node, tenants=self.tenants,
                     workers=self.workers.pids)  # fmt: skip
            return self.port
        self._thread = threading.Thread(target=self._run, name="nexuskv-sidecar", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the sidecar server stopped while starting (see the log)")
            self._thread.join(0.01)
        log.info("sidecar serving", url=self.url, node=self.kernel.node, tenants=self.tenants)
        return self.port

    def _run(self) -> None:
        self.server.run(sockets=[self._sock])

    def serve_forever(self) -> None:
        """Serve until SIGINT / SIGTERM, then stop gracefully and close the kernel (exit status 0).

        The server runs on its own thread and this (main) thread waits for the signal: uvicorn's own handling
        would re-raise the signal after its shutdown, killing the process before the kernel flushed its writer
        and released its lease.
        """
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            while not stop.wait(1.0):
                if self._thread is not None and not self._thread.is_alive():
                    break  # the server died on its own (logged by uvicorn)
            log.info("sidecar stopping", url=self.url)
        finally:
            self.close()  # a second signal meanwhile only sets the event again: the flush is never cut short
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def close(self) -> None:
        """Stop serving (requests in flight finish, streams end) and close the kernel if the sidecar built it."""
        if self.workers is not None:
            self.workers.close()
        self.app.close_streams()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
        self.app.close()
        self._close_kernel()

    def _close_kernel(self) -> None:
        if self._own_kernel:
            self.kernel.close()

    def __enter__(self) -> Sidecar:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
