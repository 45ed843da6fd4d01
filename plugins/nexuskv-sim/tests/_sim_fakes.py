"""Helpers of the simulator tests: a tiny profile with round numbers, a hand-set cluster view, scripted strategies."""

from __future__ import annotations

from attrs import define, field

from nexuskv_sim.api import BaseStrategy, Decision, NodeLoad, SimRequest
from nexuskv_sim.profile import LinkProfile, ModelProfile, Profile

BLOCK = 512
KV_PER_TOKEN = 2000  # one block = 1,024,000 bytes
BLOCK_BYTES = BLOCK * KV_PER_TOKEN


def tiny_profile(*, hbm_blocks: int = 100, dram_blocks: int = 100, disk_blocks: int = 100, overhead_ms: float = 1.0,
                 per_token_ms: float = 0.01, attn_ms: float = 0.0, per_decode_ms: float = 0.0,
                 decode_ctx_ms: float = 0.0, chunk_tokens: int = 8192, block_ms: dict[str, float] | None = None,
                 latency_ms: float = 0.0) -> Profile:  # fmt: skip
    """Models "m" and "other" (the same numbers); `block_ms`: each link's ms per block (pcie 1, disk 10, nic 5)."""
    per_block = {"pcie": 1.0, "disk": 10.0, "nic": 5.0, **(block_ms or {})}
    links = {k: LinkProfile(bandwidth=BLOCK_BYTES / ms * 1e3, latency_ms=latency_ms) for k, ms in per_block.items()}
    m = ModelProfile("m", KV_PER_TOKEN, overhead_ms, per_token_ms, attn_ms, per_decode_ms, decode_ctx_ms)
    other = ModelProfile("other", KV_PER_TOKEN, overhead_ms, per_token_ms, attn_ms, per_decode_ms, decode_ctx_ms)
    return Profile(models={"m": m, "other": other}, links=links, hbm_bytes=hbm_blocks * BLOCK_BYTES,
                   dram_bytes=dram_blocks * BLOCK_BYTES, disk_bytes=disk_blocks * BLOCK_BYTES, default_model="m",
                   block_tokens=BLOCK, chunk_tokens=chunk_tokens)  # fmt: skip


def request(rid: int, ids: list[int], *, at: float = 0.0, tokens: int | None = None, out: int = 1,
            model: str = "m", tenant: str = "default") -> SimRequest:  # fmt: skip
    """A request over blocks `ids` (full blocks unless `tokens` says otherwise)."""
    return SimRequest(rid, at, model, tenant, tokens or len(ids) * BLOCK, out, ids, BLOCK)


@define
class FakeView:
    """A cluster view with hand-set loads and holdings (node -> (hbm, dram, disk) prefix blocks, per request)."""

    nodes: tuple[str, ...]
    held: dict[str, tuple[int, int, int]] = field(factory=dict)
    load: dict[str, dict[str, int]] = field(factory=dict)
    now: float = 0.0
    reported_at: float = 0.0
    report_delay_ms: float = 0.0
    hbm_capacity: int = 100
    tiers: tuple[str, ...] = ("hbm", "dram", "disk")

    def loads(self) -> dict[str, NodeLoad]:
        out = {}
        for n in self.nodes:
            d = self.load.get(n, {})
            out[n] = NodeLoad(n, self.reported_at, d.get("queued", 0), d.get("waiting", 0), d.get("decodes", 0),
                              d.get("used", 0), self.hbm_capacity, "m")  # fmt: skip
        return out

    def prefix_blocks(self, node: str, tier: str, req: SimRequest) -> int:
        return self.held.get(node, (0, 0, 0))[("hbm", "dram", "disk").index(tier)]

    def holdings(self, node: str, req: SimRequest) -> tuple[int, int, int]:
        return self.held.get(node, (0, 0, 0))

    def holders(self, req: SimRequest) -> tuple[str, ...]:
        return tuple(n for n in self.nodes if any(self.held.get(n, (0, 0, 0))))

    def block_bytes(self, req: SimRequest) -> int:
        return BLOCK_BYTES

    def nodes_for(self, model: str) -> tuple[str, ...]:
        return self.nodes

    def host_of(self, node: str) -> str:
        return node


class Scripted(BaseStrategy):
    """Sends everything to `node`; requests listed in `plans` get those fetches."""

    name = "scripted"

    def __init__(self, node: str = "n0", plans: dict[int, tuple] | None = None) -> None:
        self.node = node
        self.plans = plans or {}
        self.transfers: list[tuple[str, int, float]] = []
        self.done: list[tuple[int, str, float]] = []

    def decide(self, req: SimRequest, view) -> Decision:
        return Decision(self.node, self.plans.get(req.rid, ()), "scripted")

    def observe_transfer(self, link: str, nbytes: int, ms: float, *, source: str = "", tier: str = "",
                         node: str = "") -> None:
        self.transfers.append((link, nbytes, ms))

    def observe_done(self, req: SimRequest, node: str, ttft_ms: float) -> None:
        self.done.append((req.rid, node, ttft_ms))
