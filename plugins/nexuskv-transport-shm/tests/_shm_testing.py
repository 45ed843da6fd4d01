"""Helpers the shm tests share: the segment directory, waiting for a condition, and spawning a peer process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHM = Path("/dev/shm")
PEER = str(Path(__file__).with_name("_shm_peer.py"))


def eventually(cond: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Poll `cond` until it is true or `timeout` seconds passed; the last answer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def ours(ns: str) -> list[str]:
    """The files of namespace `ns` in /dev/shm."""
    return sorted(n for n in os.listdir(SHM) if n.startswith(ns + "-"))


def spawn(mode: str, **args: Any) -> tuple[subprocess.Popen[str], Any]:
    """Start `_shm_peer.py` in `mode` and read its first (JSON) line."""
    proc = subprocess.Popen([sys.executable, PEER, mode, json.dumps(args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line:
        proc.kill()
        raise AssertionError(f"peer {mode} failed: {proc.stderr.read() if proc.stderr is not None else ''}")
    return proc, json.loads(line)
