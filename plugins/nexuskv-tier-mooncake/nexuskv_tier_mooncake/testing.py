"""A throwaway `mooncake_master` for tests and benchmarks: free 127.0.0.1 ports, nothing persisted, kill, restart."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nexuskv_tier_mooncake.mooncake_client import WHEEL, load_mooncake, master_answers

__all__ = ["MooncakeMaster", "MooncakeMissing", "find_master", "usable"]


class MooncakeMissing(RuntimeError):
    """The Mooncake wheel (its `mooncake_master` binary and `mooncake.store`) cannot be used here."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_master() -> str:
    """Path of the `mooncake_master` binary the wheel ships (inside the `mooncake` package), or MooncakeMissing."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        binary = Path(folder) / "mooncake_master"
        if binary.is_file():
            return str(binary)
    found = shutil.which("mooncake_master") or shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
    if found:
        return found
    raise MooncakeMissing(f"mooncake_master not found: `pip install {WHEEL}` (Linux x86_64 wheels) provides it")


def usable() -> str:
    """"" when Mooncake can run here, else the precise reason it cannot (for a test skip)."""
    try:
        find_master()
        load_mooncake()
    except (MooncakeMissing, ImportError) as exc:
        return str(exc)
    return ""


class MooncakeMaster:
    """One `mooncake_master` process this process started and owns (stop it, or use it as a context manager).

    It listens on 127.0.0.1 only (RPC and metrics ports picked free), keeps nothing on disk, so a `kill` (SIGKILL)
    followed by `restart` gives an empty master on the same ports: every object it knew is gone, as after a crash.
    `lease_ttl_ms` is its `--default_kv_lease_ttl` (how long a read blocks a removal).
    """

    def __init__(self, port: int | None = None, lease_ttl_ms: int = 10000, start_timeout_s: float = 20.0,
                 extra_args: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.binary = find_master()
        self.host = "127.0.0.1"
        self.port = port or _free_port()
        self.metrics_port = _free_port()
        self.lease_ttl_ms = int(lease_ttl_ms)
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)
        self._tmp = tempfile.TemporaryDirectory(prefix="nexuskv-mooncake-")
        self.directory = Path(self._tmp.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def address(self) -> str:
        """`127.0.0.1:{port}`, the `master` option of the tier."""
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        """The master's own log (stdout and stderr)."""
        return self.directory / "master.log"

    def start(self) -> None:
        """Start the master (on the same ports as before, if it ran already) and wait until its RPC port answers."""
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [self.binary, f"--rpc_port={self.port}", f"--rpc_address={self.host}", "--rpc_thread_num=2",
                f"--metrics_port={self.metrics_port}", f"--metrics_host={self.host}",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}", "--enable_metric_reporting=false",
                *self.extra_args]  # fmt: skip
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(args, cwd=self.directory, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + self.start_timeout_s
        while master_answers(self.host, self.port, 0.2):
            if self.proc.poll() is not None:
                text = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} on port {self.port}: {text}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master on port {self.port} did not listen within "
                                   f"{self.start_timeout_s:g} s")  # fmt: skip
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the master (a crash: nothing saved) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        """Start again on the same ports after `kill` (empty: nothing was persisted)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Stop the master and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None  # type: ignore[assignment]

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
