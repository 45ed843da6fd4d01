"""The strategy protocol: what a routing and loading strategy sees (`ClusterView`) and what it answers (`Decision`).

A strategy gets each request at its arrival, with a delayed view of the cluster, and returns the node to run it
on plus the KV fetches to do first: contiguous block ranges from block 0, each from one node's tier. Everything
after the last fetched block is prefilled. The simulator reports back every completed fetch (`observe_transfer`,
what a real load path measures) and every first token (`observe_done`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from attrs import define, field

__all__ = ["BaseStrategy", "ClusterView", "Decision", "Fetch", "NodeLoad", "Prefetch", "SimRequest", "Strategy",
           "TIERS"]

TIERS = ("hbm", "dram", "disk")  # fastest first


@define(frozen=True)
class SimRequest:
    """One request as strategies see it; `hash_ids[j]` names prefix block j (`block_tokens` tokens, last partial)."""

    rid: int
    arrival_ms: float
    model: str
    tenant: str
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = field(converter=tuple)
    block_tokens: int = 512

    @property
    def blocks(self) -> int:
        """Number of blocks (the last may be partial)."""
        return len(self.hash_ids)

    def tokens_of(self, blocks: int) -> int:
        """Tokens covered by the first `blocks` blocks."""
        return min(blocks * self.block_tokens, self.input_tokens)


@define(frozen=True)
class NodeLoad:
    """A node's load as it reported it at `at_ms` (waiting includes requests still loading KV)."""

    node: str
    at_ms: float
    queued_prefill_tokens: int
    waiting_requests: int
    running_decodes: int
    hbm_used_blocks: int
    hbm_capacity_blocks: int
    model: str


@define(frozen=True)
class Fetch:
    """Load blocks [start, end) of the request from `tier` of `source_node` (the chosen node itself or a peer)."""

    source_node: str
    tier: str
    start: int
    end: int


@define(frozen=True)
class Prefetch:
    """Move blocks [start, end) of the request from the chosen node's host `tier` into its hbm, in the background.

    For the next request of this prefix; the bytes go over the links like any load.
    """

    tier: str
    start: int
    end: int


@define(frozen=True)
class Decision:
    """Where to run a request and what to load first; fetches are contiguous from block 0, in order.

    `node` "" refuses the request (counted in `SimResult.rejected`; it never runs).
    """

    node: str
    fetches: tuple[Fetch, ...] = field(default=(), converter=tuple)
    reason: str = ""
    prefetches: tuple[Prefetch, ...] = field(default=(), converter=tuple)


class ClusterView(Protocol):
    """The cluster as a strategy sees it: loads and holdings as of `now - report_delay_ms`."""

    nodes: Sequence[str]
    tiers: Sequence[str]
    report_delay_ms: float

    @property
    def now(self) -> float:
        """Simulated time (ms)."""
        ...

    def loads(self) -> Mapping[str, NodeLoad]:
        """Each node's last reported load, as of `now - report_delay_ms`."""
        ...

    def prefix_blocks(self, node: str, tier: str, req: SimRequest) -> int:
        """Leading blocks of `req` held at `node` in `tier` or a faster tier (delayed like `loads`)."""
        ...

    def holdings(self, node: str, req: SimRequest) -> tuple[int, int, int]:
        """`prefix_blocks` of every tier at once: (hbm, dram, disk), non-decreasing."""
        ...

    def holders(self, req: SimRequest) -> Sequence[str]:
        """Nodes serving `req`'s model that hold its first block in some tier: the only ones with a prefix."""
        ...

    def block_bytes(self, req: SimRequest) -> int:
        """Bytes of one full block of `req`'s model."""
        ...

    def nodes_for(self, model: str) -> Sequence[str]:
        """Nodes that serve `model`."""
        ...

    def host_of(self, node: str) -> str:
        """The host whose dram, disk and links `node` uses."""
        ...


@runtime_checkable
class Strategy(Protocol):
    """A routing and loading strategy."""

    name: str

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """Choose the node and fetches for `req`."""
        ...

    def observe_transfer(self, link: str, nbytes: int, ms: float, *, source: str = "", tier: str = "",
                         node: str = "") -> None:
        """Called after every completed fetch with its link kind ("pcie", "disk", "nic"), bytes and duration.

        `source` is the node the fetch read from, `tier` the tier it asked for and `node` the node it loaded into
        (what a load path knows).
        """
        ...

    def observe_done(self, req: SimRequest, node: str, ttft_ms: float) -> None:
        """Called when `req` produced its first token on `node`."""
        ...


class BaseStrategy:
    """Strategy base class with no-op observers; subclasses set `name` and implement `decide`."""

    name = "base"

    def decide(self, req: SimRequest, view: ClusterView) -> Decision:
        """Choose the node and fetches for `req`."""
        raise NotImplementedError

    def observe_transfer(self, link: str, nbytes: int, ms: float, *, source: str = "", tier: str = "",
                         node: str = "") -> None:
        """Ignore transfer measurements."""

    def observe_done(self, req: SimRequest, node: str, ttft_ms: float) -> None:
        """Ignore completions."""
