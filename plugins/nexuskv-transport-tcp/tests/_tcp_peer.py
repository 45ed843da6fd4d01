"""Helpers of the tcp tests (descriptors, payloads, a scripted fake peer) and a serving peer process.

Run as `python _tcp_peer.py JSON-ARGS`, the peer puts `n` payloads of `size` bytes (`payload_of(i, size)` at
`slot_n(i)`) into a DRAM tier, serves it, prints one JSON line `{"address": ..., "pid": ...}` and serves until
stdin closes (or it is killed).
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import sys
import threading

from nexuskv import (
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    StateDescriptor,
    StateGroup,
    TierStore,
    TokenizerIdentity,
    TokenSpan,
    checksum,
    configure_logging,
)

TIER = "dram"
NS = Namespace("acme")
"""The namespace of every test descriptor (what each fetch names)."""
PEER_KEY = bytes(range(100, 132))
"""The peer key every transport of these tests holds (a kernel derives its own from the deployment secret)."""


def tcp(**options):  # type: ignore[no-untyped-def]
    """A `TcpTransport` holding `PEER_KEY`, as a kernel would hand it over."""
    from nexuskv_transport_tcp import TcpTransport

    t = TcpTransport(**options)
    t.authenticate(PEER_KEY)
    return t


def authenticated(address: str, key: bytes = PEER_KEY, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    """A raw socket to `address` past the handshake, and its session (frames sent on it need `session.seal`)."""
    from nexuskv_transport_tcp._wire import Reader, client_handshake

    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    return sock, client_handshake(sock, Reader(sock), key)


def descriptor(slot: bytes, payload: bytes | memoryview, tier: str = TIER) -> StateDescriptor:
    """A minimal valid descriptor of `payload` stored at `slot`."""
    return StateDescriptor(
        key=slot[:-1].hex(), namespace=NS, model=ModelIdentity(name="m"),
        tokenizer=TokenizerIdentity(name="t"), layout=Layout(groups=[StateGroup(kind="dense", layers=1)]),
        group=slot[-1], span=TokenSpan(0, 16), nbytes=len(payload), checksum=checksum(payload),
        placement=Placement(tier, "peer"),
    )  # fmt: skip


def slot_n(i: int, group: int = 0) -> bytes:
    """The test slot number `i`."""
    return i.to_bytes(16, "big") + bytes((group,))


def payload_of(i: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes: payload number `i` of `size` bytes."""
    return random.Random(i).randbytes(size)


def put(store: TierStore, i: int, size: int) -> bytes:
    """Put payload `i` of `size` bytes at `slot_n(i)`; return it."""
    payload = payload_of(i, size)
    assert store.put(slot_n(i), payload, descriptor(slot_n(i), payload))
    return payload


class FakePeer:
    """A raw server answering each request (parsed independently of the transport) with the next scripted bytes.

    `answers` are `(data, close)` pairs, used in order across connections; `close` ends the connection after
    sending. `accepted` counts the connections it was opened.
    """

    def __init__(self, answers: list[tuple[bytes, bool]]) -> None:
        self.answers = list(answers)
        self.accepted = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _serve(self, conn: socket.socket) -> None:
        from nexuskv_transport_tcp._wire import Reader, server_handshake

        try:
            server_handshake(conn, Reader(conn), PEER_KEY)  # its reads are exact: nothing of a request is buffered
            while True:
                magic, version, tier_len, count, ns_len = struct.unpack(">4sBHIH", self._read(conn, 13))
                assert (magic, version) == (b"NXKT", 3)
                self._read(conn, tier_len + ns_len)
                for _ in range(count):
                    self._read(conn, struct.unpack(">H", self._read(conn, 2))[0])
                self._read(conn, 16)  # the frame's MAC (this fake does not check it)
                data, close = self.answers.pop(0)
                conn.sendall(data)
                if close:
                    conn.close()
                    return
        except (EOFError, OSError, Exception):
            conn.close()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._stop.set()
        self.listener.close()
        for c in self._conns:
            c.close()


def main() -> None:
    """Serve a DRAM tier until stdin closes."""
    args = json.loads(sys.argv[1])
    configure_logging(stream=sys.stderr)  # stdout carries the JSON line
    from nexuskv.builtins.dram import DramStore
    store = DramStore(1 << 28, name=TIER)
    for i in range(args["n"]):
        put(store, i, args["size"])
    t = tcp()
    address = t.serve({TIER: store})
    sys.stdout.write(json.dumps({"address": address, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()
    t.close()


if __name__ == "__main__":
    main()
