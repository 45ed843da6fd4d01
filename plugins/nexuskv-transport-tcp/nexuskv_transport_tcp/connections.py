"""The TCP transport's client side: addresses, connections and the per-peer connection pool."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time

from attrs import define, field

from nexuskv_transport_tcp._wire import Reader, Session, client_handshake

__all__ = ["Conn", "Pool", "connect", "format_address", "nodelay", "parse_address"]


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


@define(eq=False)
class Conn:
    """One client connection to a peer, with its read-ahead buffer."""

    address: str
    sock: socket.socket
    reader: Reader = field(init=False)
    session: Session | None = None  # set by the handshake
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
    if isinstance(sock, ssl.SSLSocket):  # no MSG_PEEK through TLS: readable at all means EOF or unasked bytes
        try:
            return not sock.pending() and not select.select([sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False
    try:
        sock.settimeout(0.0)  # a non-blocking peek (the exchange sets its own timeout afterwards)
        sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False  # EOF, or bytes nobody asked for


def connect(address: str, deadline: float, key: bytes, tls: ssl.SSLContext | None = None) -> Conn:
    """A fresh connection to `address` (in TLS with `tls`), both sides proven to hold `key`.

    Raises OSError (ssl.SSLError included) / ValueError / ProtocolError.
    """
    host, port = parse_address(address)
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    sock = socket.create_connection((host, port), timeout=left)
    nodelay(sock)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock)
        except BaseException:
            sock.close()
            raise
    conn = Conn(address, sock)
    conn.reader.deadline = deadline
    try:
        conn.session = client_handshake(sock, conn.reader, key)
    except BaseException:
        conn.close()
        raise
    return conn
