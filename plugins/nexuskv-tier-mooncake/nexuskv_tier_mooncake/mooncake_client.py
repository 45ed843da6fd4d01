"""Mooncake Store's client as this tier uses it: the wheel, its error codes, registered buffers, the master probe."""

from __future__ import annotations

import ctypes
import importlib
import mmap
import socket
from typing import Any

# Mooncake Store's error codes (mooncake-store/include/types.h) that this tier treats specially.
OK = 0


BUFFER_OVERFLOW = -10


SEGMENT_NOT_FOUND = -101


NO_AVAILABLE_HANDLE = -200


INVALID_PARAMS = -600


OBJECT_NOT_FOUND = -704


OBJECT_ALREADY_EXISTS = -705


OBJECT_HAS_LEASE = -706


LEASE_EXPIRED = -707


TRANSFER_FAIL = -800


RPC_FAIL = -900


RPC_TIMEOUT = -901


NO_ROOM = frozenset({NO_AVAILABLE_HANDLE, SEGMENT_NOT_FOUND, BUFFER_OVERFLOW})


"""The store has no space for the object: a put that cannot fit, not a failure of the store."""


UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT, TRANSFER_FAIL, -1010, -1011})


"""The master (or the segment's owner) cannot be reached: count it against the tier."""


WHEEL = "mooncake-transfer-engine-non-cuda"


def load_mooncake() -> Any:
    """`mooncake.store`, or ImportError saying precisely what is missing (the wheel, or libibverbs.so.1)."""
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text:
            raise ImportError(f"mooncake.store cannot load: {text} (install Debian's libibverbs1: "
                              "`apt-get install -y libibverbs1`; `make test` does)") from exc  # fmt: skip
        raise ImportError(f"mooncake.store is not importable ({text}): `pip install {WHEEL}` "
                          "(wheels for Linux x86_64 only)") from exc  # fmt: skip


class RegisteredBuffer:
    """Page-aligned anonymous memory registered with a Mooncake client (for `put_from` / `get_into`)."""

    def __init__(self, client: Any, size: int) -> None:
        self.size = max(int(size), mmap.PAGESIZE)
        self._map = mmap.mmap(-1, self.size)
        self._anchor = ctypes.c_char.from_buffer(self._map)  # pins the mapping while registered
        self.ptr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._map)
        rc = client.register_buffer(self.ptr, self.size)
        if rc != 0:
            self.release(None)
            raise MemoryError(f"register_buffer of {self.size} bytes failed with Mooncake code {rc}")
        self._client: Any = client

    def release(self, client: Any = ...) -> None:
        """Unregister (unless `client` is None: the client is gone) and unmap."""
        c = self._client if client is ... else client
        if c is not None:
            c.unregister_buffer(self.ptr)
        self._client = None
        self.view.release()
        del self._anchor
        self._map.close()


def master_answers(host: str, port: int, timeout_s: float) -> str:
    """"" when a TCP connection to the master's RPC port opens within `timeout_s`, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of a `host:port` master address; ValueError naming the problem."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)
