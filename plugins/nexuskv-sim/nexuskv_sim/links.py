"""Links that share their bandwidth among concurrent transfers: block-sized chunks taking turns.

Each link (a host's PCIe, disk, NIC out, NIC in) is a simpy `Resource` of capacity 1. A transfer moves one chunk
at a time: it queues for the link (or, on the network, for the source's NIC out and then the destination's NIC
in, always in that order so two transfers can never wait on each other), holds it for `bytes / bandwidth`, and
releases it before queueing for the next chunk. The queue is FIFO, so concurrent transfers interleave chunk by
chunk: n equal transfers each take about n times as long as one alone. Latency is paid once per transfer.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import simpy

from nexuskv_sim.profile import LinkProfile

__all__ = ["Link", "hold"]


class Link:
    """One direction of one link of one host."""

    def __init__(self, env: simpy.Environment, name: str, kind: str, profile: LinkProfile) -> None:
        self.env = env
        self.name = name
        self.kind = kind
        self.bytes_per_ms = profile.bandwidth / 1e3
        self.latency_ms = profile.latency_ms
        self.resource = simpy.Resource(env, capacity=1)
        self.busy_ms = 0.0
        self.bytes = 0


def hold(env: simpy.Environment, links: Sequence[Link], nbytes: int) -> Generator[Any, Any, None]:
    """Move one chunk of `nbytes` over `links` at once (e.g. NIC out and NIC in): the slowest one sets the pace."""
    reqs = []
    try:
        for link in links:
            r = link.resource.request()
            reqs.append((link, r))
            yield r
        ms = nbytes / min(link.bytes_per_ms for link in links)
        yield env.timeout(ms)
        for link in links:
            link.busy_ms += ms
            link.bytes += nbytes
    finally:
        for link, r in reqs:
            link.resource.release(r)
