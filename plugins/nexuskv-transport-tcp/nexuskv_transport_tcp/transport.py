"""The TCP transport: serves this node's tiers to peers and reads slots of theirs, many per round trip.

The wire protocol is described in `nexuskv_transport_tcp._wire`. Every connection is mutually authenticated with
the peer key the kernel hands over (`authenticate`, derived from the deployment secret) and every request carries a
MAC: nothing is served to, or read from, a process that does not hold it. The client never verifies checksums (the
kernel verifies every payload against its sealed descriptor) but it never returns a payload shorter or longer than
announced, nor a descriptor that does not parse: such an answer is a `TransportError`, and the connection is dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

from nexuskv import DescriptorParser, Namespace, StateDescriptor, StoredState, TierStore, get_logger, parse_bytes
from nexuskv_transport_tcp._wire import (
    HIT,
    MAX_SLOT_BYTES,
    MAX_SLOTS,
    MAX_TIER_BYTES,
    SERVER_ERROR,
    UNKNOWN_TIER,
    AuthenticationError,
    PeerClosed,
    ProtocolError,
    encode_request,
    namespace_digest,
    read_answer_head,
)
from nexuskv_transport_tcp.connections import Conn, Pool, connect, format_address, parse_address
from nexuskv_transport_tcp.server import Server
from nexuskv_transport_tcp.tls import tls_contexts

__all__ = ["TcpTransport", "TransportError"]

log = get_logger(__name__)


class TransportError(ConnectionError):
    """A peer could not be read: unreachable, too slow, closed, or it answered something malformed or too big."""


class _UnknownTier(ProtocolError):
    """The peer has no tier of the requested name."""


class _ServerFailed(ProtocolError):
    """The peer failed to read its own tier (its message is the exception's)."""


_STALE = (PeerClosed, ConnectionResetError, BrokenPipeError)  # what a dead pooled connection looks like


class TcpTransport:
    """Moves stored payloads between nodes over TCP.

    `serve(tiers)` answers peers' reads of this node's tiers from background daemon threads; `fetch_remote`
    reads many slots of a peer's tier in one pipelined round trip over a pooled connection (at most
    `connections` idle ones kept per address). `timeout_s` bounds a whole `fetch_remote` call;
    `max_payload_bytes` bounds every payload and descriptor a peer may announce. `tls_cert`, `tls_key` and
    `tls_ca` (all three, or none) wrap every connection in mutual TLS (`nexuskv_transport_tcp.tls`). Thread-safe.
    """

    name = "tcp"
    remote = True

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        timeout_s: float = 1.0,
        connections: int = 4,
        max_payload_bytes: int | str = 1 << 30,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if connections < 0:
            raise ValueError(f"connections must not be negative, got {connections}")
        if not 0 <= int(port) < 65536:
            raise ValueError(f"port must be in [0, 65536), got {port}")
        if advertise is not None:
            parse_address(advertise)  # ValueError now rather than an unreachable node later
        self.host = host
        self.port = int(port)
        self.advertise = advertise
        self.timeout_s = float(timeout_s)
        self.connections = int(connections)
        self.max_payload_bytes = parse_bytes(max_payload_bytes)
        self.tls = tls_contexts(tls_cert, tls_key, tls_ca)  # mutual TLS on every connection, when configured
        self._pool = Pool(self.connections)
        self._descriptors = DescriptorParser()
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._address: str | None = None
        self._closed = False
        self._key: bytes | None = None

    def authenticate(self, key: bytes) -> None:
        """Take the peer key (the kernel derives it from the deployment secret): required to serve and to fetch."""
        if len(key) < 16:
            raise ValueError(f"the peer key must be at least 16 bytes, got {len(key)}")
        self._key = bytes(key[:64])

    @property
    def refused(self) -> int:
        """Connections this node's server refused: no proof of the peer key, or a request whose MAC failed."""
        server = self._server
        return server.refused if server is not None else 0

    # ----------------------------------------------------------------------------------------- local reads

    def fetch(self, store: TierStore, slot: bytes) -> StoredState | None:
        """Read one slot of a store of this process: the store's own `get`, as the `local` transport does."""
        return store.get(slot)

    # ----------------------------------------------------------------------------------------- serving

    def serve(self, tiers: Mapping[str, TierStore]) -> str:
        """Serve reads of `tiers` (looked up live at every request) on host:port; return the address peers use.

        Starts once: a second call returns the same address and keeps serving the first mapping.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("tcp transport is closed")
            if self._address is not None:
                return self._address
            if self._key is None:
                raise RuntimeError("tcp transport: no peer key (the kernel calls authenticate(key) first)")
            server = Server(self.host, self.port, tiers, self._key, self.tls.server if self.tls else None)
            port = server.server_address[1]
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                      name=f"nexuskv-tcp-{port}", daemon=True)  # fmt: skip
            thread.start()
            self._server, self._thread = server, thread
            self._address = self.advertise or format_address(self.host, port)
        if self.advertise is None and self.host in ("0.0.0.0", "::", ""):
            log.warning("tcp_wildcard_address", address=self._address, hint="set advertise to a reachable host")
        log.info("tcp_serving", address=self._address, bound=format_address(self.host, port))
        return self._address

    @property
    def address(self) -> str | None:
        """The address peers use to reach this node's server; None while not serving."""
        return self._address

    # ----------------------------------------------------------------------------------------- remote reads

    def fetch_remote(self, address: str, tier: str, slots: Sequence[bytes], timeout_s: float | None = None, *,
                     namespace: Namespace) -> list[StoredState | None]:  # fmt: skip
        """Read `slots` of `tier` on the peer at `address`: one answer per slot, None where the peer misses.

        Every slot must be of `namespace` (the request's, or the owner's for a shared scope): the peer serves a
        slot whose state is of another namespace as a miss, and a descriptor of another namespace that comes
        back anyway (a peer of an older or broken build) is a miss here too.

        All requests go out before any answer is read (one round trip; more only beyond 65536 slots).
        `timeout_s` (default the constructor's) bounds the whole call. Raises `TransportError` when the peer
        cannot be reached or is too slow, closes the connection, answers something malformed or larger than
        `max_payload_bytes`, or has no tier of that name; ValueError for a tier name or slot too long to send.
        """
        tier_bytes = tier.encode()
        slots = list(slots)
        if len(tier_bytes) > MAX_TIER_BYTES:
            raise ValueError(f"tier name of {len(tier_bytes)} bytes (at most {MAX_TIER_BYTES})")
        for slot in slots:
            if len(slot) > MAX_SLOT_BYTES:
                raise ValueError(f"slot of {len(slot)} bytes (at most {MAX_SLOT_BYTES})")
        if self._closed:
            raise TransportError(f"tcp peer {address}: this transport is closed")
        if self._key is None:
            raise TransportError(f"tcp peer {address}: no peer key (the kernel calls authenticate(key) first)")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + limit
        ns = namespace_digest(namespace.tenant, namespace.scope, namespace.cache_salt)  # 32 bytes, whatever the names
        out: list[StoredState | None] = []
        for start in range(0, len(slots), MAX_SLOTS):
            chunk = slots[start : start + MAX_SLOTS]
            out.extend(self._round_trip(address, tier, encode_request(tier_bytes, chunk, ns), len(chunk), deadline,
                                        limit))  # fmt: skip
        for i, got in enumerate(out):
            if got is not None and got.descriptor.namespace != namespace:
                log.warning("tcp_answer_outside_namespace", peer=address, tier=tier, slot=slots[i].hex())
                out[i] = None
        return out

    def _round_trip(self, address: str, tier: str, request: bytes, count: int, deadline: float,
                    limit: float) -> list[StoredState | None]:  # fmt: skip
        """Send one request frame and read its answers over a pooled (or fresh) connection.

        A connection that saw any error is closed. A pooled one found dead before it answered a byte (the peer
        restarted, or dropped it while idle) is retried on another connection: reads are idempotent.
        """
        while True:
            conn = self._pool.take(address)
            try:
                if conn is None:
                    conn = connect(address, deadline, self._key or b"", self.tls.client if self.tls else None)
                return self._exchange(conn, request, count, deadline)
            except BaseException as e:
                if conn is not None:
                    conn.close()
                    if conn.reused and conn.reader.received == 0 and isinstance(e, _STALE):
                        continue
                if isinstance(e, OSError | ProtocolError | ValueError):
                    raise TransportError(f"tcp peer {address}: {_why(e, tier, limit)}") from e
                raise

    def _exchange(self, conn: Conn, request: bytes, count: int, deadline: float) -> list[StoredState | None]:
        """Write the request, read `count` answers; give the connection back to the pool only when all is well."""
        reader = conn.reader
        reader.received = 0
        reader.deadline = deadline
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        conn.sock.settimeout(left)
        if conn.session is None:  # every connection is authenticated before it is used
            raise AuthenticationError("connection not authenticated")
        conn.sock.sendall(conn.session.seal(request))
        out: list[StoredState | None] = []
        for _ in range(count):
            status, desc_len, payload_len = read_answer_head(reader, self.max_payload_bytes)
            raw = reader.exact(desc_len)
            if status == UNKNOWN_TIER:
                raise _UnknownTier()
            if status == SERVER_ERROR:
                raise _ServerFailed(bytes(raw).decode(errors="replace") or "no reason given")
            if status != HIT:
                out.append(None)
                continue
            payload = bytearray(payload_len)
            reader.into(memoryview(payload))
            out.append(StoredState(memoryview(payload).toreadonly(), self._descriptor(raw)))
        if reader.buffered():
            conn.close()  # the peer sent more than it announced: the stream cannot be trusted for another call
        else:
            self._pool.give(conn)
        return out

    def _descriptor(self, raw: bytes | bytearray) -> StateDescriptor:
        """Parse a descriptor sent by a peer; ProtocolError when it is not a valid `StateDescriptor`."""
        try:
            return self._descriptors.parse(raw)
        except Exception as e:
            raise ProtocolError(f"descriptor does not parse: {e}") from e

    def idle_connections(self, address: str) -> int:
        """How many idle pooled connections to `address` are kept for reuse."""
        return self._pool.idle(address)

    # ----------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop the server (if serving) and close pooled connections; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, thread = self._server, self._thread
            self._server = self._thread = None
            self._address = None
        self._pool.close()
        if server is not None:
            server.shutdown()
            server.stop()
            if thread is not None:
                thread.join(timeout=5.0)


def _why(e: BaseException, tier: str, limit: float) -> str:
    """A short reason for a failed exchange."""
    if isinstance(e, TimeoutError):
        return f"timed out (timeout_s={limit:g})"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, AuthenticationError):
        return f"authentication failed ({e}): is it a node of this deployment (the same secret)?"
    if isinstance(e, _UnknownTier):
        return f"the peer has no tier {tier!r}"
    if isinstance(e, _ServerFailed):
        return f"the peer failed to read tier {tier!r}: {e}"
    if isinstance(e, PeerClosed):
        return f"the peer closed the connection ({e})"
    if isinstance(e, ProtocolError):
        return f"malformed answer: {e}"
    if isinstance(e, ValueError):
        return f"bad address: {e}"
    return f"{type(e).__name__}: {e}"
