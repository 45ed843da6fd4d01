"""NexusKV TCP transport: stored KV payloads read from the tiers of other nodes over TCP.

`TcpTransport.serve(tiers)` answers peers' reads of this node's tiers; `TcpTransport.fetch_remote(address, tier,
slots)` reads many slots of a peer's tier in one pipelined round trip. Every failure to reach or understand a
peer is a `TransportError` (a `ConnectionError`). The wire protocol is described in `_wire` and the README.
"""

from __future__ import annotations

from nexuskv_transport_tcp.transport import TcpTransport, TransportError

__all__ = ["TcpTransport", "TransportError"]
