"""The Mooncake tier's client of one master: set up lazily, failing fast while the master does not answer.

Mooncake's own client notices a dead master only through its calls, each of which then waits about 4 s (its
`setup` retries for over a minute, its `close` for about 15 s holding the GIL). So nothing is called on it unless
the master's RPC port answers a plain TCP probe: a watcher thread probes it every `probe_interval_s`, and after any
failed call the next one probes first; a master that accepts connections but does not answer (frozen) costs at most
`rpc_timeout_s` per call. The registered buffers a put stages into and a get falls back to live here.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from nexuskv import get_logger
from nexuskv_tier_mooncake.mooncake_client import (
    OBJECT_NOT_FOUND,
    UNREACHABLE,
    RegisteredBuffer,
    master_answers,
    split_address,
)

__all__ = ["MasterLink", "MooncakeTierError", "release_abandoned"]

log = get_logger(__name__)

# Clients closed while their master was unreachable: (master address, client, its buffers). Mooncake's close would
# stall, so they are kept, and their own threads go on pinging that master (its log lines on stderr) until it
# answers again and `release_abandoned` closes them.
_ABANDONED: list[tuple[str, Any, list[RegisteredBuffer]]] = []
_ABANDONED_LOCK = threading.Lock()


def release_abandoned(master: str | None = None, probe_timeout_s: float = 0.2) -> int:
    """Close the clients left behind at close whose master answers again; how many are still left behind (of `master`).

    A client's close is left undone while its master does not answer (it would retry for about 15 s holding the
    GIL); once that master is back on its address (restarted), the close is quick. A new client of a master calls
    this for that master (`master`: its `host:port`, known to answer: nothing is probed); with no `master`, each
    left-behind client's master is probed for up to `probe_timeout_s` first. A client left behind because a reader
    was still in it is never closed (closing under a reader crashes) and is not counted.
    """
    with _ABANDONED_LOCK:
        mine = [entry for entry in _ABANDONED if master in (None, entry[0])]
        ready = mine if master is not None else [
            entry for entry in mine if not master_answers(*split_address(entry[0]), probe_timeout_s)]
        for entry in ready:
            _ABANDONED.remove(entry)
        left = len(mine) - len(ready)
    for address, client, buffers in ready:
        try:
            client.close()
            for b in buffers:
                b.release(None)
        except Exception as exc:  # kept (never destructed: that would stall the same way), not retried
            log.warning("mooncake client left behind at close could not be closed", master=address, error=repr(exc))
            continue
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(client))  # the reference taken when it was left behind
        log.info("mooncake client left behind at close is closed: its master answers again", master=address)
    return left


class MooncakeTierError(ConnectionError):
    """The Mooncake master could not be reached (the kernel counts it on the tier's breaker and recomputes)."""


class MasterLink:
    """One `MooncakeDistributedStore` client of one master, and the fail-fast state around it."""

    def __init__(self, tier: str, mooncake: Any, master: str, address: tuple[str, int], setup_args: tuple[Any, ...],
                 *, down_backoff_s: float, probe_timeout_s: float, probe_interval_s: float, rpc_timeout_s: float,
                 on_recover: Callable[[], object]) -> None:  # fmt: skip
        self.tier = tier
        self.master = master
        self._mooncake = mooncake
        self._host, self._port = address
        self._setup_args = setup_args
        self.down_backoff_s = down_backoff_s
        self.probe_timeout_s = probe_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._on_recover = on_recover
        self.client: Any = None  # None until the master first answered
        self._stage: RegisteredBuffer | None = None  # put: header + payload copied here, then put_from
        self._scratch: RegisteredBuffer | None = None  # get, when the local buffer is exhausted
        self._buffer_lock = threading.Lock()
        self._closed = False
        self._readers = 0  # gets using the client now: close waits for them (closing under a reader crashes)
        self._idle = threading.Condition()
        self._conn_lock = threading.Lock()
        self._down_until = 0.0
        self._suspect = False  # a call failed: probe the master before the next one, then re-check what is held
        self._last_error = ""
        self._master_down = ""  # why the watcher last found the master's port closed ("" while it answers)
        self._stop = threading.Event()
        if probe_interval_s > 0:
            threading.Thread(target=self._watch, args=(probe_interval_s,), name=f"mooncake-watch-{tier}",
                             daemon=True).start()  # fmt: skip

    def _error(self, why: str) -> MooncakeTierError:
        return MooncakeTierError(f"mooncake tier {self.tier!r} at {self.master} unavailable: {why}")

    def failed(self, why: str) -> MooncakeTierError:
        """Record a failure: calls fail at once for `down_backoff_s`, then the master is probed first."""
        self._last_error = why
        self._down_until = time.monotonic() + self.down_backoff_s
        self._suspect = True
        log.warning("mooncake tier call failed", tier=self.tier, master=self.master, error=why)
        return self._error(why)

    def check(self, rc: int, what: str) -> int:
        """`rc`, unless it says the master is unreachable (then `MooncakeTierError`)."""
        if rc in UNREACHABLE:
            raise self.failed(f"{what} failed with Mooncake code {rc}")
        return rc

    def probe(self) -> None:
        """Raise `MooncakeTierError` unless the master's port answers now."""
        why = master_answers(self._host, self._port, self.probe_timeout_s)
        if why:
            raise self.failed(f"master does not answer: {why}")

    def enter(self) -> Any:
        """`connected()` for a reader that does not hold the store's write lock; pair it with `leave()`."""
        with self._idle:
            if self._closed:
                raise self._error("the store is closed")
            self._readers += 1
        try:
            return self.connected()
        except BaseException:
            self.leave()
            raise

    def leave(self) -> None:
        """A reader from `enter()` is done with the client."""
        with self._idle:
            self._readers -= 1
            self._idle.notify_all()

    def connected(self) -> Any:
        """The client, set up on first use; raises `MooncakeTierError` at once while the master does not answer."""
        if self._closed:  # never set up again after close (it would mount a segment nobody closes)
            raise self._error("the store is closed")
        if self._master_down:
            raise self._error(f"master does not answer: {self._master_down}")
        now = time.monotonic()
        if now < self._down_until:
            raise self._error(f"(retrying in {self._down_until - now:.2f} s) {self._last_error}")
        client = self.client
        if client is not None and not self._suspect:
            return client
        with self._conn_lock:
            if self.client is not None and not self._suspect:
                return self.client
            self.probe()
            if self.client is None:
                self._setup()
                client = self.client
            else:
                client = None
                self._suspect = False
        if client is not None:  # a first connection: this master answers, its clients left behind can close
            release_abandoned(f"{self._host}:{self._port}")  # (outside the lock: a close may take a while)
            return client
        self._on_recover()  # the master answers again: it may have restarted and lost every object
        return self.client

    def _setup(self) -> None:
        """Create the client and its registered staging buffer (conn lock held)."""
        # Mooncake's master client reads its per-request deadline from the environment when it is made (30 s when
        # unset: a frozen master would hold a reader that long); a value the process set already is kept.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(self.rpc_timeout_s * 1e3))))
        client = self._mooncake.MooncakeDistributedStore()
        rc = client.setup(*self._setup_args)
        if rc != 0:
            raise self.failed(f"setup failed with Mooncake code {rc}")
        self._stage = RegisteredBuffer(client, 1 << 20)
        self.client = client
        self._suspect = False
        log.info("mooncake tier connected", tier=self.tier, master=self.master, segment_bytes=self._setup_args[2])

    def _watch(self, every_s: float) -> None:
        """Probe the master's port every `every_s` until closed."""
        while not self._stop.wait(every_s):
            why = master_answers(self._host, self._port, self.probe_timeout_s)
            if why and not self._master_down:
                self._suspect = True
                log.warning("mooncake master does not answer", tier=self.tier, master=self.master, error=why)
            elif not why and self._master_down:
                log.info("mooncake master answers again", tier=self.tier, master=self.master)
            self._master_down = why

    # ------------------------------------------------------------------------------------------ data

    def put_object(self, client: Any, key: str, header: bytes, view: memoryview) -> int:
        """Copy header + payload into the registered staging buffer and `put_from` it; Mooncake's code."""
        size = len(header) + view.nbytes
        with self._buffer_lock:
            stage = self._stage
            if stage is None or stage.size < size:
                if stage is not None:
                    stage.release()
                self._stage = stage = RegisteredBuffer(client, 1 << max(20, (size - 1).bit_length()))
            n = len(header)
            stage.view[:n] = header
            stage.view[n:size] = view
            return self.check(client.put_from(key, stage.ptr, size), "put_from")

    def read_copy(self, client: Any, key: str) -> memoryview | None:
        """The object read into the registered scratch buffer and copied out; None when it is not there.

        For when `get_buffer` gave nothing: the object is missing, the master is down, or the local buffer is full.
        """
        self.probe()  # a master that just died would make the calls below wait seconds each
        size = self.check(client.get_size(key), "get_size")
        if size < 0:
            return self._unreadable(key, size)
        with self._buffer_lock:
            scratch = self._scratch
            if scratch is None or scratch.size < size:
                if scratch is not None:
                    scratch.release()
                self._scratch = scratch = RegisteredBuffer(client, 1 << max(20, (size - 1).bit_length()))
            got = self.check(client.get_into(key, scratch.ptr, scratch.size), "get_into")
            if got < 0:
                return self._unreadable(key, got)
            return memoryview(bytes(scratch.view[:got]))

    def _unreadable(self, key: str, rc: int) -> None:
        """A miss: the object is not there, or not readable (REPLICA_IS_NOT_READY: a put cut off half way)."""
        if rc != OBJECT_NOT_FOUND:
            log.info("mooncake object not readable; a miss", tier=self.tier, key=key, code=rc)
        return None

    def close(self) -> None:
        """Close the client; with the master unreachable it is left behind instead (Mooncake's close would stall)."""
        self._stop.set()
        with self._idle:
            self._closed = True
            idle = self._idle.wait_for(lambda: self._readers == 0, timeout=10.0)
        with self._conn_lock, self._buffer_lock:
            client, self.client = self.client, None
            buffers = [b for b in (self._stage, self._scratch) if b is not None]
            self._stage = self._scratch = None
        if client is None:
            return
        why = "" if idle else "a reader still uses the client"
        why = why or master_answers(self._host, self._port, self.probe_timeout_s)
        if why:
            log.warning("mooncake client left behind at close", tier=self.tier, master=self.master, error=why)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))  # its destructor would stall the exit the same way
            if idle:  # a client a reader may still be in is never closed (closing under a reader crashes)
                with _ABANDONED_LOCK:
                    _ABANDONED.append((f"{self._host}:{self._port}", client, buffers))
            return
        client.close()
        for b in buffers:
            b.release(None)
