"""The wire protocol of the TCP transport: framing, bounds, and socket reads and writes without extra copies.

Binary, big-endian, versioned. One request asks for many slots of one tier; the server answers every slot, in
order, on the same connection, then waits for the next request (many requests per connection, until EOF).

Every connection starts with a mutual challenge-response under the peer key (derived by the kernel from the
deployment secret: only nodes of one deployment hold it); nothing else is read or answered before it checks::

    server hello   magic b"NXKA", version u8, server nonce (16 random bytes)
    client proof   client nonce (16 random bytes), BLAKE2b-256(key, "client", server nonce | client nonce)
    server proof   BLAKE2b-256(key, "server", client nonce | server nonce)

A wrong proof closes the connection with no answer at all (no status, no descriptor, no "exists" oracle). Both
sides then derive a session key from the two nonces, and every request frame is followed by its 16-byte MAC under
that key over (its sequence number on the connection | the frame): a changed, reordered or replayed request, or
one from another connection, closes the connection unanswered. Answers carry no MAC: every payload and descriptor
is verified by the reader's kernel against the deployment's keyed MAC of stored state (`StateSeal`).

Every request names the namespace (tenant, scope, cache salt) its slots must be of, and the server answers a slot
only when the descriptor it holds is of that namespace (otherwise a miss): the frame, MACed under the session key,
is the fetch's capability. A bug, or a poisoned index entry, that asks a peer for a slot of another tenant's
namespace gets nothing, even between nodes that hold the key.

Request::

    magic      4 bytes   b"NXKT"
    version    u8        3
    tier_len   u16       <= 255
    count      u32       <= 65536
    ns_len     u16       32
    tier       tier_len bytes (UTF-8 tier name)
    namespace  32 bytes: BLAKE2b-256 of the JSON array [tenant, scope, cache salt] (`namespace_digest`)
    count times:
        slot_len   u16   <= 1024
        slot       slot_len bytes

Answer, one per slot, in request order::

    status     u8        0 miss, 1 hit, 2 unknown tier, 3 server error
    desc_len   u32       <= max_payload_bytes
    payload_len u64      <= max_payload_bytes (0 unless status is hit)
    descriptor desc_len bytes: hit: JSON of `nexuskv.to_dict(StateDescriptor)`; error: a UTF-8 message (may be empty)
    payload    payload_len bytes

Every length read from the wire is bounded before anything is allocated; a frame breaking a bound, a bad magic
or an unknown version is a `ProtocolError` (the server then closes that connection). Payloads go out as
memoryviews through `sendmsg` / `sendall` (no copy) and come in through `recv_into` straight into a preallocated
bytearray.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import ssl
import struct
import time
from collections.abc import Sequence

__all__ = [
    "ANSWER_HEAD",
    "HIT",
    "MAGIC",
    "MAX_SLOT_BYTES",
    "NAMESPACE_BYTES",
    "MAX_SLOTS",
    "MAX_TIER_BYTES",
    "MISS",
    "REQUEST_HEAD",
    "SERVER_ERROR",
    "UNKNOWN_TIER",
    "VERSION",
    "PeerClosed",
    "ProtocolError",
    "Reader",
    "encode_answer",
    "namespace_digest",
    "encode_request",
    "read_answer_head",
    "read_request",
    "read_sealed_request",
    "send_buffers",
    "Session",
    "client_handshake",
    "server_handshake",
    "AuthenticationError",
]

MAGIC = b"NXKT"
VERSION = 3
HELLO_MAGIC = b"NXKA"
NONCE_BYTES = 16
PROOF_BYTES = 32
FRAME_MAC_BYTES = 16
HELLO = struct.Struct(f">4sB{NONCE_BYTES}s")
SEQ = struct.Struct(">Q")
REQUEST_HEAD = struct.Struct(">4sBHIH")  # magic, version, tier length, slot count, namespace length
SLOT_LEN = struct.Struct(">H")
ANSWER_HEAD = struct.Struct(">BIQ")  # status, descriptor length, payload length

MISS, HIT, UNKNOWN_TIER, SERVER_ERROR = 0, 1, 2, 3
STATUSES = frozenset((MISS, HIT, UNKNOWN_TIER, SERVER_ERROR))

MAX_TIER_BYTES = 255
MAX_SLOT_BYTES = 1024
MAX_SLOTS = 65536
NAMESPACE_BYTES = 32

_BUFFER = 64 << 10  # read-ahead buffer of small fields
_IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)


class ProtocolError(Exception):
    """A frame that breaks the protocol: bad magic or version, a length over its bound, an unknown status."""


class AuthenticationError(ProtocolError):
    """The other side does not hold the peer key (or a request's MAC does not check): nothing is answered."""


class PeerClosed(ProtocolError):
    """The peer closed the connection in the middle of a frame (or before the first byte of an answer)."""


class Reader:
    """Exact reads from a socket: small fields through a read-ahead buffer, payloads straight into the caller's.

    `deadline` (a `time.monotonic()` value, or None for blocking reads) bounds every read; past it a read
    raises `TimeoutError`. `received` counts the bytes read from the socket so far.
    """

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        self.sock = sock
        self.deadline = deadline
        self.received = 0
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _recv_into(self, view: memoryview) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self.sock.settimeout(left)
        n = self.sock.recv_into(view)
        self.received += n
        return n

    def _fill(self) -> int:
        """Read more bytes into the read-ahead buffer (compacting it first); 0 at EOF."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf) or self._start > len(self._buf) // 2:
            size = self._end - self._start
            self._buf[:size] = self._buf[self._start : self._end]
            self._start, self._end = 0, size
        n = self._recv_into(self._view[self._end :])
        self._end += n
        return n

    def buffered(self) -> int:
        """Bytes read from the socket and not consumed yet."""
        return self._end - self._start

    def at_eof(self) -> bool:
        """True when the peer closed the connection cleanly at a frame boundary (nothing buffered, EOF)."""
        return self._start == self._end and self._fill() == 0

    def exact(self, n: int) -> bytes | bytearray:
        """The next `n` bytes; raises `PeerClosed` if the connection ends first."""
        if n > len(self._buf):
            out = bytearray(n)
            self.into(memoryview(out))
            return out
        while self._end - self._start < n:
            if self._fill() == 0:
                raise PeerClosed(f"connection closed before a whole frame arrived ({self.received} bytes read)")
        out_b = bytes(self._view[self._start : self._start + n])
        self._start += n
        return out_b

    def into(self, out: memoryview) -> None:
        """Fill `out` completely: whatever is buffered first, then `recv_into` straight into it."""
        pos = min(self._end - self._start, len(out))
        out[:pos] = self._view[self._start : self._start + pos]
        self._start += pos
        while pos < len(out):
            n = self._recv_into(out[pos:])
            if n == 0:
                raise PeerClosed(f"connection closed {len(out) - pos} bytes short of a {len(out)}-byte payload")
            pos += n


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send every buffer, in order, without joining them: vectored `sendmsg` where the platform has it."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):  # TLS has no sendmsg (nor Windows)
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        while sent and i < len(views):
            size = views[i].nbytes
            if sent >= size:
                sent -= size
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def namespace_digest(tenant: str, scope: str, cache_salt: str) -> bytes:
    """The namespace field of a request: a BLAKE2b-256 of `[tenant, scope, cache salt]` as JSON.

    No separator can be smuggled through a name, and however long a tenant's scope or salt, the field is 32 bytes.
    """
    text = json.dumps([tenant, scope, cache_salt], separators=(",", ":")).encode()
    return hashlib.blake2b(text, digest_size=NAMESPACE_BYTES, person=b"nxkt-namespace").digest()


def encode_request(tier: bytes, slots: Sequence[bytes], namespace: bytes) -> bytes:
    """One request frame for `slots` of `tier`, all of `namespace` (the caller checks the bounds)."""
    parts = [REQUEST_HEAD.pack(MAGIC, VERSION, len(tier), len(slots), len(namespace)), tier, namespace]
    for slot in slots:
        parts.append(SLOT_LEN.pack(len(slot)))
        parts.append(slot)
    return b"".join(parts)


def read_request(reader: Reader) -> tuple[str, bytes, list[bytes]]:
    """Read one request frame: (tier name, namespace field, slots). `ProtocolError` on anything out of bounds."""
    magic, version, tier_len, count, ns_len = REQUEST_HEAD.unpack(reader.exact(REQUEST_HEAD.size))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {VERSION})")
    if tier_len > MAX_TIER_BYTES:
        raise ProtocolError(f"tier name of {tier_len} bytes (at most {MAX_TIER_BYTES})")
    if count > MAX_SLOTS:
        raise ProtocolError(f"{count} slots in one request (at most {MAX_SLOTS})")
    if ns_len != NAMESPACE_BYTES:
        raise ProtocolError(f"namespace of {ns_len} bytes (a request names one: its {NAMESPACE_BYTES}-byte digest)")
    try:
        tier = bytes(reader.exact(tier_len)).decode()
    except UnicodeDecodeError as e:
        raise ProtocolError("tier name is not UTF-8") from e
    namespace = bytes(reader.exact(ns_len))
    slots = []
    for _ in range(count):
        (size,) = SLOT_LEN.unpack(reader.exact(SLOT_LEN.size))
        if size > MAX_SLOT_BYTES:
            raise ProtocolError(f"slot of {size} bytes (at most {MAX_SLOT_BYTES})")
        slots.append(bytes(reader.exact(size)))
    return tier, namespace, slots


def read_sealed_request(reader: Reader, session: Session) -> tuple[str, bytes, list[bytes]]:
    """`read_request`, then the frame's MAC, checked: `AuthenticationError` unless it is the session's next one."""
    tier, namespace, slots = read_request(reader)
    session.check(encode_request(tier.encode(), slots, namespace), reader.exact(FRAME_MAC_BYTES))
    return tier, namespace, slots


def encode_answer(status: int, descriptor: bytes = b"", payload_len: int = 0) -> bytes:
    """The head of one answer followed by its descriptor bytes (the payload goes out separately)."""
    return ANSWER_HEAD.pack(status, len(descriptor), payload_len) + descriptor


def read_answer_head(reader: Reader, max_bytes: int) -> tuple[int, int, int]:
    """Read and check the head of one answer: (status, descriptor length, payload length)."""
    status, desc_len, payload_len = ANSWER_HEAD.unpack(reader.exact(ANSWER_HEAD.size))
    if status not in STATUSES:
        raise ProtocolError(f"unknown answer status {status}")
    if desc_len > max_bytes:
        raise ProtocolError(f"descriptor of {desc_len} bytes announced (max_payload_bytes is {max_bytes})")
    if payload_len > max_bytes:
        raise ProtocolError(f"payload of {payload_len} bytes announced (max_payload_bytes is {max_bytes})")
    if payload_len and status != HIT:
        raise ProtocolError(f"payload of {payload_len} bytes announced with status {status} (not a hit)")
    return status, desc_len, payload_len


# ------------------------------------------------------------------------------------------ authentication


def _proof(key: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hashlib.blake2b(first + second, key=key, digest_size=PROOF_BYTES, person=b"nxkt-" + who).digest()


class Session:
    """One authenticated connection's request MACs: a key from both nonces and a sequence number per frame."""

    __slots__ = ("_key", "_seq")

    def __init__(self, key: bytes, server_nonce: bytes, client_nonce: bytes) -> None:
        self._key = _proof(key, b"session", server_nonce, client_nonce)
        self._seq = 0

    def _mac(self, frame: bytes) -> bytes:
        mac = hashlib.blake2b(SEQ.pack(self._seq), key=self._key, digest_size=FRAME_MAC_BYTES)
        mac.update(frame)
        self._seq += 1
        return mac.digest()

    def seal(self, frame: bytes) -> bytes:
        """`frame` followed by its MAC (the client's side; the sequence number moves on)."""
        return frame + self._mac(frame)

    def check(self, frame: bytes, mac: bytes) -> None:
        """Raise `AuthenticationError` unless `mac` is the next frame's MAC of `frame` (the server's side)."""
        if not hmac.compare_digest(self._mac(frame), bytes(mac)):
            raise AuthenticationError("a request's MAC does not check (changed, replayed or out of order)")


def server_handshake(sock: socket.socket, reader: Reader, key: bytes) -> Session:
    """Prove the peer holds `key` (and prove it to the peer); `AuthenticationError` if it does not."""
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(HELLO.pack(HELLO_MAGIC, VERSION, server_nonce))
    client_nonce = bytes(reader.exact(NONCE_BYTES))
    proof = reader.exact(PROOF_BYTES)
    if not hmac.compare_digest(bytes(proof), _proof(key, b"client", server_nonce, client_nonce)):
        raise AuthenticationError("the peer does not hold this deployment's peer key")
    sock.sendall(_proof(key, b"server", client_nonce, server_nonce))
    return Session(key, server_nonce, client_nonce)


def client_handshake(sock: socket.socket, reader: Reader, key: bytes) -> Session:
    """The client's half of the handshake; `AuthenticationError` when the server does not hold `key`."""
    magic, version, server_nonce = HELLO.unpack(reader.exact(HELLO.size))
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"bad hello {bytes(magic)!r} (not a NexusKV tcp transport of this version)")
    if version != VERSION:
        raise ProtocolError(f"the peer speaks protocol version {version} (this side speaks {VERSION})")
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(client_nonce + _proof(key, b"client", server_nonce, client_nonce))
    try:
        proof = reader.exact(PROOF_BYTES)
    except PeerClosed:
        raise AuthenticationError("the peer closed the connection at our proof: it holds another peer key "
                                  "(a node of another deployment?)") from None  # fmt: skip
    if not hmac.compare_digest(bytes(proof), _proof(key, b"server", client_nonce, server_nonce)):
        raise AuthenticationError("the peer does not hold this deployment's peer key")
    return Session(key, server_nonce, client_nonce)
