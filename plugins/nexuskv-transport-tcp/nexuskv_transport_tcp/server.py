"""The TCP transport's server: the background thread that answers peers' slot requests from this node's tiers."""

from __future__ import annotations

import contextlib
import hmac
import socket
import socketserver
import ssl
import threading
from collections.abc import Mapping

from nexuskv import DescriptorEncoder, TierStore, get_logger
from nexuskv_transport_tcp._wire import (
    HIT,
    MISS,
    SERVER_ERROR,
    UNKNOWN_TIER,
    AuthenticationError,
    ProtocolError,
    Reader,
    encode_answer,
    namespace_digest,
    read_sealed_request,
    send_buffers,
    server_handshake,
)
from nexuskv_transport_tcp.connections import format_address, nodelay

__all__ = ["Server"]


log = get_logger("nexuskv_transport_tcp.server")


_FLUSH_BYTES = 256 << 10  # answers are sent once this much is pending (or a payload this big comes)


_FLUSH_BUFFERS = 256

HANDSHAKE_S = 5.0
"""How long a new connection has to prove it holds the peer key before it is closed."""

MAX_HANDSHAKES = 64
"""Connections that may be proving themselves at once; past it a new one is closed at once, unanswered (a keyless
process opening connections by the thousand holds at most this many threads, each for at most `HANDSHAKE_S`)."""


class _Handler(socketserver.BaseRequestHandler):
    """Serves one connection: requests, one after another, until EOF or a malformed frame."""

    server: Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        nodelay(sock)
        peer = format_address(*self.client_address[:2]) if self.client_address else "?"
        if not self.server.begin_handshake():
            self.server.refuse()
            log.warning("tcp_handshakes_full", peer=peer, limit=MAX_HANDSHAKES)
            _shut(sock)
            return
        authenticating = True  # the place taken above is given back exactly once, whatever happens from here
        self.server.track(sock, True)
        # The whole handshake (TLS, then the peer key's) has HANDSHAKE_S, however slowly its bytes trickle in:
        # past it the connection is shut down under the reader.
        current = [sock]  # what the timer shuts: the TLS socket once there is one
        late = threading.Timer(HANDSHAKE_S, lambda: _shut(current[0]))
        late.daemon = True
        try:
            late.start()  # inside: a flood that exhausts threads must not leak the place
            sock.settimeout(HANDSHAKE_S)
            if self.server.tls is not None:
                self.server.track(sock, False)
                sock = self.server.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                current[0] = sock
                self.server.track(sock, True)  # the TLS socket owns the connection now: stop() ends that one
                try:
                    sock.do_handshake()
                except (ssl.SSLError, OSError) as e:
                    self.server.refuse()
                    log.warning("tcp_tls_refused", peer=peer, error=str(e))
                    return
            reader = Reader(sock)
            session = server_handshake(sock, reader, self.server.key)
            late.cancel()
            self.server.end_handshake()
            authenticating = False
            sock.settimeout(None)  # an authenticated peer's pooled connection may idle
            while not reader.at_eof():
                tier, namespace, slots = read_sealed_request(reader, session)
                self.server.answer(sock, tier, namespace, slots)
        except AuthenticationError as e:
            self.server.refuse()
            log.warning("tcp_peer_refused", peer=peer, error=str(e))
        except ProtocolError as e:
            log.warning("tcp_malformed_request", peer=peer, error=str(e))
        except OSError as e:
            log.info("tcp_connection_lost", peer=peer, error=str(e))
        except Exception:
            log.exception("tcp_server_failure", peer=peer)
        finally:
            late.cancel()
            if authenticating:
                self.server.end_handshake()
            self.server.track(sock, False)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """Answers authenticated peers' reads of a live tier mapping, one daemon thread per connection."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128  # many workers connect at once: a full backlog drops SYNs, retried only after seconds

    def __init__(self, host: str, port: int, tiers: Mapping[str, TierStore], key: bytes,
                 tls: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.tiers = tiers
        self.key = key
        self.tls = tls
        self.refused = 0  # connections that failed to authenticate (or sent a request whose MAC failed)
        self.outside = 0  # slots held, but of another namespace than the request named: answered as misses
        self.handshaking = 0  # connections proving themselves now (at most MAX_HANDSHAKES)
        self._refused_lock = threading.Lock()
        self.descriptors = DescriptorEncoder()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    def refuse(self) -> None:
        """Count a refused connection (from any handler thread)."""
        with self._refused_lock:
            self.refused += 1

    def begin_handshake(self) -> bool:
        """Take one of the `MAX_HANDSHAKES` places of connections not yet authenticated (False: none is free)."""
        with self._refused_lock:
            if self.handshaking >= MAX_HANDSHAKES:
                return False
            self.handshaking += 1
            return True

    def end_handshake(self) -> None:
        """Give a place back: the connection authenticated, or ended."""
        with self._refused_lock:
            self.handshaking -= 1

    def outside_namespace(self, tier: str, n: int) -> None:
        """Count (and log, once per request) slots asked for under another namespace than their state's."""
        with self._refused_lock:
            self.outside += n
        log.warning("tcp_slots_outside_namespace", tier=tier, slots=n)

    def track(self, sock: socket.socket, live: bool) -> None:
        """Remember (or forget) an open connection, so `stop` can end it."""
        with self._conns_lock:
            if live:
                self._conns.add(sock)
            else:
                self._conns.discard(sock)

    def answer(self, sock: socket.socket, tier: str, namespace: bytes, slots: list[bytes]) -> None:
        """Send one answer per slot, batching small ones into vectored sends; only `namespace`'s state is served.

        `namespace` is the request's digest of it (`namespace_digest`).
        """
        store = self.tiers.get(tier)
        pending: list[bytes | memoryview] = []
        size = 0
        digests: dict[object, bytes] = {}  # a descriptor's namespace -> its digest, for this request
        outside = 0
        for slot in slots:
            if store is None:
                pending.append(encode_answer(UNKNOWN_TIER))
            else:
                head, payload = _answer_slot(store, tier, slot, namespace, digests, self.descriptors)
                outside += head is _OUTSIDE
                pending.append(head)
                size += len(head)
                if payload is not None:
                    pending.append(payload)
                    size += payload.nbytes
            if size >= _FLUSH_BYTES or len(pending) >= _FLUSH_BUFFERS:
                send_buffers(sock, pending)
                pending, size = [], 0
        send_buffers(sock, pending)
        if outside:
            self.outside_namespace(tier, outside)

    def stop(self) -> None:
        """Stop accepting (the caller has ended `serve_forever`), close the listener, end open connections."""
        self.server_close()
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


_OUTSIDE = encode_answer(MISS)  # the answer to a slot of another namespace: a miss like any other (same bytes)


def _answer_slot(store: TierStore, tier: str, slot: bytes, namespace: bytes, digests: dict[object, bytes],
                 encoder: DescriptorEncoder) -> tuple[bytes, memoryview | None]:  # fmt: skip
    """(answer head + descriptor, payload view or None) of one slot; a store failure is a server-error answer.

    State of another namespace than the request names is answered as a miss (`_OUTSIDE`, the same bytes as a
    miss): nothing of it leaves this node.
    """
    try:
        got = store.get(slot)
        if got is None:
            return encode_answer(MISS), None
        ns = got.descriptor.namespace
        digest = digests.get(ns)
        if digest is None:
            digest = digests[ns] = namespace_digest(ns.tenant, ns.scope, ns.cache_salt)
        if not hmac.compare_digest(digest, namespace):
            return _OUTSIDE, None
        payload = memoryview(got.payload).cast("B")
        descriptor = encoder.encode(got.descriptor)
    except Exception as e:
        log.exception("tcp_store_read_failed", tier=tier, slot=slot.hex())
        return encode_answer(SERVER_ERROR, f"{type(e).__name__}: {e}".encode()[:4096]), None
    return encode_answer(HIT, descriptor, payload.nbytes), payload
