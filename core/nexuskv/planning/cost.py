"""The cost model: predicts every term of G = T_recompute(M) - (T_lookup + T_transfer(M) + T_mount) from a profile.

Prefill of L tokens costs base + a*L + b*L^2 (the quadratic term is attention), so skipping the first M tokens
of any request saves a*M + b*M^2. Transfers pay latency plus bytes over bandwidth, after the bytes already queued
on the same link, plus codec decode time; mounting costs a fixed time per block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from attrs import define

from nexuskv.contracts import Calibration, CodecCost, CostProfile, LinkCost, PrefillCost, from_dict
from nexuskv.errors import ContractError
from nexuskv.planning.links import LinkEstimates

__all__ = ["CostModel", "Terms", "default_profile", "gain", "load_profile", "peer_link"]


def peer_link(node: str) -> str:
    """The name under which the link to peer `node` is measured, priced and scaled (`peer:<node>`)."""
    return f"peer:{node}"


def default_profile() -> CostProfile:
    """The documented default: a tiny Llama-style model on this project's CPU machine (DESIGN.md figures).

    Prefill 512 / 2048 / 8192 tokens in about 45 / 270 / 1540 ms (least-squares fit with a 1 ms base), 2048 bytes
    of state per token, and tier costs of a typical host: DRAM, shared memory, a local NVMe disk, Redis over
    loopback TCP.
    `nexuskv calibrate` replaces it with measured numbers.
    """
    return CostProfile(
        name="default-cpu-tiny-llama",
        model="tiny-llama",
        hardware="2-core CPU (documented default, not calibrated)",
        bytes_per_token=2048,
        prefill=PrefillCost(base_ms=1.0, per_token_ms=0.1095, per_token_sq_ms=9.566e-6),
        tiers={
            "dram": LinkCost(bandwidth_bytes_per_s=8e9, latency_ms=0.005),
            "shm": LinkCost(bandwidth_bytes_per_s=8e9, latency_ms=0.02),
            "disk": LinkCost(bandwidth_bytes_per_s=1.5e9, latency_ms=0.1),
            "redis": LinkCost(bandwidth_bytes_per_s=1e9, latency_ms=0.3),
        },
        transports={"local": LinkCost(bandwidth_bytes_per_s=8e9, latency_ms=0.0),
                    "tcp": LinkCost(bandwidth_bytes_per_s=1e9, latency_ms=0.2)},
        codecs={
            "raw": CodecCost(decode_bytes_per_s=1e12, encode_bytes_per_s=1e12, ratio=1.0),
            "zstd": CodecCost(decode_bytes_per_s=1.5e9, encode_bytes_per_s=4e8, ratio=1.3),
        },
        lookup_ms=0.05,
        mount_ms_per_block=0.002,
        calibration=Calibration(method="default"),
    )


def load_profile(path: str | Path) -> CostProfile:
    """Read a cost profile JSON file (validated against `schemas/cost-profile.v1.json`).

    Unreadable files, malformed JSON and schema problems are a `ContractError` naming the file.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ContractError("cost-profile", [(str(path), f"cannot read: {exc.strerror}")]) from None
    except json.JSONDecodeError as exc:
        raise ContractError("cost-profile", [(str(path), f"line {exc.lineno} column {exc.colno}: {exc.msg}")]) from None
    try:
        return from_dict(CostProfile, data)
    except ContractError as exc:
        exc.args = (f"{path}: {exc}",)  # same error, now naming the file
        raise


def gain(t_recompute_ms: float, t_lookup_ms: float, t_transfer_ms: float, t_mount_ms: float) -> float:
    """G = T_recompute - (T_lookup + T_transfer + T_mount), in milliseconds."""
    return t_recompute_ms - (t_lookup_ms + t_transfer_ms + t_mount_ms)


@define(frozen=True)
class Terms:
    """The predicted terms of one candidate, in milliseconds."""

    t_recompute_ms: float
    t_lookup_ms: float
    t_transfer_ms: float
    t_mount_ms: float

    @property
    def gain_ms(self) -> float:
        """G = T_recompute - (T_lookup + T_transfer + T_mount)."""
        return gain(self.t_recompute_ms, self.t_lookup_ms, self.t_transfer_ms, self.t_mount_ms)


class CostModel:
    """Predictions from one profile; `inflight` bytes per link (tier or transport name) model contention.

    With `links`, a link measured often enough is priced by its measured latency and bandwidth instead of the
    profile's (`nexuskv.planning.links`).
    """

    def __init__(self, profile: CostProfile | None = None, links: LinkEstimates | None = None) -> None:
        self.profile = profile or default_profile()
        self.links = links
        p = self.profile.prefill
        self._base, self._a, self._b = p.base_ms, p.per_token_ms, p.per_token_sq_ms
        self.bytes_per_token = self.profile.bytes_per_token

    def prefill_ms(self, tokens: int, cached: int = 0) -> float:
        """Time to prefill `tokens` tokens of which the first `cached` are restored (0 <= cached <= tokens)."""
        if tokens <= cached:
            return 0.0
        return self._base + self._a * (tokens - cached) + self._b * (tokens * tokens - cached * cached)

    def recompute_ms(self, tokens: int) -> float:
        """T_recompute(M): prefill time saved by restoring the first M tokens instead of computing them."""
        return self._a * tokens + self._b * tokens * tokens

    def link(self, name: str) -> LinkCost:
        """Cost of a tier read or a transport hop; an unknown name is a `KeyError` naming what exists."""
        got = self.profile.tiers.get(name) or self.profile.transports.get(name)
        if got is None:
            known = sorted({*self.profile.tiers, *self.profile.transports})
            raise KeyError(f"cost profile {self.profile.name!r} has no tier or transport {name!r} (has: {known})")
        return got

    def transfer_ms(
        self, nbytes: float, tier: str, *, transport: str | None = None, codec: str = "raw",
        inflight: Mapping[str, float] | None = None, bandwidth_scale: Mapping[str, float] | None = None,
    ) -> float:  # fmt: skip
        """Time to move `nbytes` (raw state bytes) from `tier` over `transport`, decoding with `codec`.

        Bytes already in flight on a link are drained first (a FIFO queue: tier devices and links serve requests in
        order, and under sustained load a fair share is no better for the newcomer); `bandwidth_scale` multiplies a
        link's bandwidth (a congested or degraded link < 1; a fault-injection knob once links are measured).
        """
        if nbytes <= 0:
            return 0.0
        c = self.profile.codecs.get(codec)
        stored = nbytes / c.ratio if c is not None else nbytes
        total = 0.0
        for name in (tier, transport) if transport and transport != "local" else (tier,):
            cost = self.link(name)
            measured = self.links.get(name) if self.links is not None else None
            latency, bandwidth = (
                (measured.latency_ms, measured.bandwidth_bytes_per_s) if measured is not None
                else (cost.latency_ms, cost.bandwidth_bytes_per_s)
            )  # fmt: skip
            bw = bandwidth * (bandwidth_scale.get(name, 1.0) if bandwidth_scale else 1.0)
            busy = inflight.get(name, 0.0) if inflight else 0.0
            total += latency + (stored + busy) / bw * 1e3
        if c is not None and codec != "raw":
            total += nbytes / c.decode_bytes_per_s * 1e3
        return total

    def remote_ms(self, nbytes: float, tier: str, node: str, *, transport: str,
                  inflight: Mapping[str, float] | None = None,
                  bandwidth_scale: Mapping[str, float] | None = None) -> float:  # fmt: skip
        """Time to read `nbytes` held in `tier` on peer `node` over `transport`.

        Measured once the link to the peer (`peer:<node>`) has estimates: the whole read, the peer's tier and
        the network together, as the load path times it. Before that, the profile's cost of the tier (when this
        node's profile knows it) plus the transport's. Bytes in flight to the peer queue first;
        `bandwidth_scale["peer:<node>"]` scales the link (fault injection).
        """
        if nbytes <= 0:
            return 0.0
        link = peer_link(node)
        scale = bandwidth_scale.get(link, 1.0) if bandwidth_scale else 1.0
        busy = inflight.get(link, 0.0) if inflight else 0.0
        measured = self.links.get(link) if self.links is not None else None
        if measured is not None:
            return measured.latency_ms + (nbytes + busy) / (measured.bandwidth_bytes_per_s * scale) * 1e3
        hop = self.link(transport)
        total = hop.latency_ms + (nbytes + busy) / (hop.bandwidth_bytes_per_s * scale) * 1e3
        if tier in self.profile.tiers:
            total += self.transfer_ms(nbytes, tier)
        return total

    def mount_ms(self, blocks: int) -> float:
        """Time to mount `blocks` restored blocks into the engine."""
        return self.profile.mount_ms_per_block * blocks

    def lookup_ms(self) -> float:
        """Measured index + policy lookup time."""
        return self.profile.lookup_ms

    def terms(self, tokens: int, transfer_ms: float, blocks: int) -> Terms:
        """All terms of G for restoring `tokens` tokens (`blocks` blocks) whose transfer takes `transfer_ms`."""
        return Terms(self.recompute_ms(tokens), self.lookup_ms() if tokens else 0.0, transfer_ms,
                     self.mount_ms(blocks))  # fmt: skip

    def value_per_byte(self, depth_tokens: int, block_tokens: int, hits: int = 0) -> float:
        """Cost-aware eviction value of a block ending at `depth_tokens`.

        The recompute milliseconds it saves per byte, weighted by observed reuse (1 + hits).
        """
        start = max(0, depth_tokens - block_tokens)
        saved = self.recompute_ms(depth_tokens) - self.recompute_ms(start)
        return saved * (1 + hits) / max(1, block_tokens * self.bytes_per_token)

    def eviction_priority(self, mode: str, floor: float, block_tokens: int, hits: int = 0,
                          tier: str | None = None) -> float:
        """The default eviction priority of a block put into a store whose aging floor is `floor`.

        `mode` "cost": GreedyDual-Size-Frequency, `floor + value * 1e6` with `value` the gain per byte of keeping
        the block in `tier`: the prefill time it saves less the time to read it back from that tier (G of one
        block, per byte; Marconi's saved compute per byte, net of the load), weighted by reuse (the store's
        `Frequency` then adds its reads); "lru": 0 for every block, so the store evicts least recently used first.
        """
        if mode == "lru":
            return 0.0
        value = self.value_per_byte(block_tokens, block_tokens, hits)
        if tier is not None and (tier in self.profile.tiers or tier in self.profile.transports):
            nbytes = max(1, block_tokens * self.bytes_per_token)
            value = max(0.0, value - self.transfer_ms(nbytes, tier) * (1 + hits) / nbytes)
        return floor + value * 1e6
