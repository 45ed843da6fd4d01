"""Helpers of the TCP transport: address parsing, the client's connection pool, and the background server."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Mapping

from attrs import define, field

from nexuskv import DescriptorEncoder, TierStore, get_logger
from nexuskv_transport_tcp._wire import (
    HIT,
    MISS,
    SERVER_ERROR,
    UNKNOWN_TIER,
    ProtocolError,
    Reader,
    encode_answer,
    read_request,
    send_buffers,
)

__all__ = [
    "Conn",
    "Pool",
    "Server",
    "connect",
    "format_address",
    "parse_address",
]

log = get_logger(__name__)

_FLUSH_BYTES = 256 << 10  # answers are sent once this much is pending (or a payload this big comes)
_FLUSH_BUFFERS = 256


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6 host]:port` -> (host, port); ValueError when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """(host, port) -> `host:port`, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def nodelay(sock: socket.socket) -> None:
    """Turn Nagle off: requests and answer heads must not wait for more data."""
    with contextlib.suppress(OSError):  # not a TCP socket (a test double): nothing to tune
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# --------------------------------------------------------------------------------------------- client side


@define(eq=False)
class Conn:
    """One client connection to a peer, with its read-ahead buffer."""

    address: str
    sock: socket.socket
    reader: Reader = field(init=False)
    reused: bool = False  # True once it came back from the pool

    def __attrs_post_init__(self) -> None:
        self.reader = Reader(self.sock)

    def close(self) -> None:
        """Close the socket (never to be used again)."""
        with contextlib.suppress(OSError):
            self.sock.close()


class Pool:
    """Idle connections per address, at most `per_address` of them kept; thread-safe."""

    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self._idle: dict[str, list[Conn]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, address: str) -> Conn | None:
        """A healthy idle connection to `address`, or None (the caller then connects).

        Idle connections the peer closed meanwhile, or on which it sent something unasked, are closed on the way.
        """
        while True:
            with self._lock:
                idle = self._idle.get(address)
                if not idle:
                    return None
                conn = idle.pop()
            if _quiet(conn.sock):
                conn.reused = True
                return conn
            conn.close()

    def give(self, conn: Conn) -> None:
        """Return a healthy connection after a complete exchange; closed if the pool is full or closed."""
        with self._lock:
            idle = self._idle.setdefault(conn.address, [])
            if not self._closed and len(idle) < self.per_address:
                idle.append(conn)
                return
        conn.close()

    def idle(self, address: str) -> int:
        """How many idle connections to `address` are kept."""
        with self._lock:
            return len(self._idle.get(address, ()))

    def close(self) -> None:
        """Close every idle connection; connections given back later are closed too."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()


def _quiet(sock: socket.socket) -> bool:
    """True when nothing is waiting on an idle connection: no EOF, no bytes the peer sent unasked."""
    try:
        sock.settimeout(0.0)  # a non-blocking peek (the exchange sets its own timeout afterwards)
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False  # EOF, or bytes nobody asked for


def connect(address: str, deadline: float) -> Conn:
    """A fresh connection to `address` (OSError / ValueError on failure)."""
    host, port = parse_address(address)
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    sock = socket.create_connection((host, port), timeout=left)
    nodelay(sock)
    return Conn(address, sock)


# --------------------------------------------------------------------------------------------- server side


class _Handler(socketserver.BaseRequestHandler):
    """Serves one connection: requests, one after another, until EOF or a malformed frame."""

    server: Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        nodelay(sock)
        peer = format_address(*self.client_address[:2]) if self.client_address else "?"
        reader = Reader(sock)
        self.server.track(sock, True)
        try:
            while not reader.at_eof():
                tier, slots = read_request(reader)
                self.server.answer(sock, tier, slots)
        except ProtocolError as e:
            log.warning("tcp_malformed_request", peer=peer, error=str(e))
        except OSError as e:
            log.info("tcp_connection_lost", peer=peer, error=str(e))
        except Exception:
            log.exception("tcp_server_failure", peer=peer)
        finally:
            self.server.track(sock, False)


class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """Answers reads of a live tier mapping, one daemon thread per connection."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, host: str, port: int, tiers: Mapping[str, TierStore]) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.tiers = tiers
        self.descriptors = DescriptorEncoder()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    def track(self, sock: socket.socket, live: bool) -> None:
        """Remember (or forget) an open connection, so `stop` can end it."""
        with self._conns_lock:
            if live:
                self._conns.add(sock)
            else:
                self._conns.discard(sock)

    def answer(self, sock: socket.socket, tier: str, slots: list[bytes]) -> None:
        """Send one answer per slot, batching small ones into vectored sends."""
        store = self.tiers.get(tier)
        pending: list[bytes | memoryview] = []
        size = 0
        for slot in slots:
            if store is None:
                pending.append(encode_answer(UNKNOWN_TIER))
            else:
                head, payload = _answer_slot(store, tier, slot, self.descriptors)
                pending.append(head)
                size += len(head)
                if payload is not None:
                    pending.append(payload)
                    size += payload.nbytes
            if size >= _FLUSH_BYTES or len(pending) >= _FLUSH_BUFFERS:
                send_buffers(sock, pending)
                pending, size = [], 0
        send_buffers(sock, pending)

    def stop(self) -> None:
        """Stop accepting (the caller has ended `serve_forever`), close the listener, end open connections."""
        self.server_close()
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _answer_slot(store: TierStore, tier: str, slot: bytes,
                 encoder: DescriptorEncoder) -> tuple[bytes, memoryview | None]:  # fmt: skip
    """(answer head + descriptor, payload view or None) of one slot; a store failure is a server-error answer."""
    try:
        got = store.get(slot)
        if got is None:
            return encode_answer(MISS), None
        payload = memoryview(got.payload).cast("B")
        descriptor = encoder.encode(got.descriptor)
    except Exception as e:
        log.exception("tcp_store_read_failed", tier=tier, slot=slot.hex())
        return encode_answer(SERVER_ERROR, f"{type(e).__name__}: {e}".encode()[:4096]), None
    return encode_answer(HIT, descriptor, payload.nbytes), payload
