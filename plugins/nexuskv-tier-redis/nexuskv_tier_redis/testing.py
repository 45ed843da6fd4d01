"""A throwaway `redis-server` for tests and benchmarks: a free port on 127.0.0.1, no persistence, kill and restart."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

__all__ = ["RedisServer", "RedisServerMissing"]


class RedisServerMissing(RuntimeError):
    """`redis-server` is not on PATH."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One `redis-server` process this process started and owns (stop it, or use it as a context manager).

    It listens on 127.0.0.1 only, saves nothing (`--save "" --appendonly no`), so a `kill` (SIGKILL) followed by
    `restart` gives an empty server on the same port, as a crashed cache node would come back.
    """

    def __init__(self, port: int | None = None, directory: str | Path | None = None,
                 start_timeout_s: float = 10.0, host: str = "127.0.0.1") -> None:  # fmt: skip
        """`host` is where it listens: 127.0.0.1, or a test network's own address (a veth in a namespace)."""
        self.host = host
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisServerMissing("redis-server is not installed: `apt-get install -y redis-server` "
                                     "(`make test` installs it when missing)")  # fmt: skip
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(prefix="nexuskv-redis-")
        self.directory = Path(directory if directory is not None else self._tmp.name)  # type: ignore[union-attr]
        self.port = port or _free_port()
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:{port}/0`."""
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client of this server."""
        return redis.Redis(host=self.host, port=self.port, socket_connect_timeout=1.0, socket_timeout=5.0,
                           **kwargs)  # type: ignore[arg-type]  # fmt: skip

    def start(self) -> None:
        """Start the server (on the same port as before, if it ran already) and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return
        log = self.directory / "redis.log"
        args = [self.binary or "redis-server", "--port", str(self.port), "--bind", self.host, "--save", "",
                "--appendonly", "no", "--dir", str(self.directory), "--daemonize", "no",
                "--logfile", str(log)]  # fmt: skip
        if self.host != "127.0.0.1":  # a test network of our own (a veth pair): let its other end in
            args += ["--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + self.start_timeout_s
        probe = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}: {text}")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, OSError):
                    if probe.ping():
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING within "
                                       f"{self.start_timeout_s:g} s")  # fmt: skip
                time.sleep(0.02)
        finally:
            probe.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, nothing saved) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """Start again on the same port after `kill` (empty: nothing was persisted)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop the server and remove its directory (if this object made it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
