"""Entry point of the tcp plugin: registers the `tcp` transport."""

from __future__ import annotations

from nexuskv import hookimpl
from nexuskv_transport_tcp.transport import TcpTransport


@hookimpl
def nexuskv_register_transports(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the TCP transport (reads slots of other nodes' tiers) as `tcp`."""
    register("tcp", TcpTransport)
