"""A throwaway `etcd` for tests and benchmarks: free ports on 127.0.0.1, its own data directory, kill and restart.

Started with a 10 ms heartbeat and a 100 ms election timeout, so that its minimum lease TTL is 1 s (the
defaults make it 2 s) and tests of lease expiry stay short.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import requests

__all__ = ["EtcdServer", "EtcdServerMissing"]


class EtcdServerMissing(RuntimeError):
    """`etcd` is not on PATH."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One single-member `etcd` process this process started and owns (stop it, or use it as a context manager).

    It listens on 127.0.0.1 only. `kill` (SIGKILL) and `restart` bring it back on the same ports with the same
    data (leases included, as a crashed etcd member would); `pause` / `resume` (SIGSTOP / SIGCONT) freeze it.
    """

    def __init__(self, directory: str | Path | None = None, start_timeout_s: float = 20.0,
                 host: str = "127.0.0.1") -> None:  # fmt: skip
        """`host` is where it listens: 127.0.0.1, or a test network's own address (a veth in a namespace)."""
        self.host = host
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise EtcdServerMissing("etcd is not installed: `apt-get install -y etcd-server` "
                                    "(`make test` installs it when missing)")  # fmt: skip
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(prefix="nexuskv-etcd-")
        self.directory = Path(directory if directory is not None else self._tmp.name)  # type: ignore[union-attr]
        self.port = _free_port()
        self.peer_port = _free_port()
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        """`127.0.0.1:{port}`, what `EtcdControlPlane(endpoint=...)` takes."""
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Start etcd (on the same ports and data as before, if it ran already) and wait until it is healthy."""
        if self.proc is not None and self.proc.poll() is None:
            return
        client, peer = f"http://{self.host}:{self.port}", f"http://{self.host}:{self.peer_port}"
        args = [self.binary or "etcd", "--name", "nexuskv", "--data-dir", str(self.directory / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"nexuskv={peer}", "--heartbeat-interval", "10", "--election-timeout", "100",
                "--log-level", "error", "--logger", "zap"]  # fmt: skip
        log = open(self.directory / "etcd.log", "ab")  # noqa: SIM115 - owned by the child process
        try:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                text = (self.directory / "etcd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"etcd exited with {self.proc.returncode} on port {self.port}: {text}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd on port {self.port} was not healthy within {self.start_timeout_s} s")
            time.sleep(0.05)

    def healthy(self) -> bool:
        """Whether etcd answers `/health` with a leader."""
        with contextlib.suppress(requests.RequestException, ValueError):
            r = requests.get(f"http://{self.host}:{self.port}/health", timeout=0.5)
            return r.ok and r.json().get("health") == "true"
        return False

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill (if running) and start again on the same ports with the same data."""
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the process freezes (connections hang rather than fail)."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop the process and remove its data directory (if this object made it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EtcdServer:
        """The server itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop it."""
        self.stop()
