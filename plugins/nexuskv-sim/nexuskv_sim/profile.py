"""The simulator's own hardware and model profile: iteration times, KV sizes, tier capacities and links.

It shares nothing with NexusKV's cost model on purpose: the simulator is the ground truth strategies are judged
against. A profile is a TOML file (`default_profile.toml` ships in the package); `congested()` scales the NIC and
disk bandwidths down. Times are milliseconds, sizes bytes, bandwidths bytes per second.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
from attrs import define, field

from nexuskv import ConfigError

__all__ = ["LinkProfile", "ModelProfile", "Profile", "default_profile", "load_profile"]

LINK_KINDS = ("pcie", "disk", "nic")


@define(frozen=True)
class ModelProfile:
    """Per-model timing of one engine iteration and the KV size of a token."""

    name: str
    kv_bytes_per_token: int
    overhead_ms: float
    per_token_ms: float
    attn_ms: float
    per_decode_ms: float
    decode_ctx_ms: float

    def chunk_ms(self, tokens: int, ctx_before: int) -> float:
        """Compute time of a prefill chunk of `tokens` following `ctx_before` tokens (no iteration overhead)."""
        return tokens * self.per_token_ms + tokens * (ctx_before + tokens / 2) * self.attn_ms

    def step_ms(self, chunks: list[tuple[int, int]], decodes: int, decode_ctx: int) -> float:
        """One engine iteration: `chunks` as (tokens, ctx_before), `decodes` sequences with `decode_ctx` in all."""
        t = self.overhead_ms + decodes * self.per_decode_ms + decode_ctx * self.decode_ctx_ms
        for tokens, ctx in chunks:
            t += self.chunk_ms(tokens, ctx)
        return t

    def prefill_alone_ms(self, new_tokens: int, cached_tokens: int, chunk_tokens: int) -> float:
        """Prefill time of one request alone on an engine: its chunks one iteration each, nothing else running."""
        t, done = 0.0, cached_tokens
        left = max(1, new_tokens)
        while left > 0:
            take = min(chunk_tokens, left)
            t += self.overhead_ms + self.chunk_ms(take, done)
            done += take
            left -= take
        return t


@define(frozen=True)
class LinkProfile:
    """Bandwidth (bytes/s) and per-transfer latency (ms) of one kind of link."""

    bandwidth: float
    latency_ms: float

    def ms(self, nbytes: float) -> float:
        """Time to move `nbytes` alone on the link, latency excluded."""
        return nbytes / self.bandwidth * 1e3


@define(frozen=True)
class Profile:
    """Models, tier capacities (hbm per node, dram and disk per host) and links of a simulated cluster."""

    models: Mapping[str, ModelProfile]
    links: Mapping[str, LinkProfile]
    hbm_bytes: int
    dram_bytes: int
    disk_bytes: int
    default_model: str
    block_tokens: int = 512
    chunk_tokens: int = 8192
    max_batch: int = 256
    congestion: Mapping[str, float] = field(factory=lambda: {"nic": 0.05, "disk": 0.05})

    def model(self, name: str) -> ModelProfile:
        """The profile of model `name`; "default" (a trace without models) means `default_model`."""
        key = self.default_model if name == "default" else name
        try:
            return self.models[key]
        except KeyError:
            raise ConfigError(f"simulator profile has no model {name!r} (has {sorted(self.models)})") from None

    def block_bytes(self, model: str) -> int:
        """Bytes of one full block of `model`."""
        return self.model(model).kv_bytes_per_token * self.block_tokens

    def congested(self, factors: Mapping[str, float] | None = None) -> Profile:
        """This profile with link bandwidths multiplied by `factors` (default: the profile's `[congested]`)."""
        f = dict(self.congestion if factors is None else factors)
        unknown = set(f) - set(self.links)
        if unknown:
            raise ConfigError(f"congestion names unknown links {sorted(unknown)}")
        links = {k: attrs.evolve(v, bandwidth=v.bandwidth * f.get(k, 1.0)) for k, v in self.links.items()}
        return attrs.evolve(self, links=links)


def _build(d: Mapping[str, Any], where: str) -> Profile:
    try:
        models = {name: ModelProfile(name=name, **m) for name, m in d["models"].items()}
        links = {k: LinkProfile(**d["links"][k]) for k in LINK_KINDS}
        tiers = d["tiers"]
        return Profile(models=models, links=links, hbm_bytes=int(tiers["hbm_bytes"]),
                       dram_bytes=int(tiers["dram_bytes"]), disk_bytes=int(tiers["disk_bytes"]),
                       default_model=d.get("default_model", next(iter(models))),
                       block_tokens=int(d.get("block_tokens", 512)), chunk_tokens=int(d.get("chunk_tokens", 8192)),
                       max_batch=int(d.get("max_batch", 256)),
                       congestion=dict(d.get("congested", {"nic": 0.05, "disk": 0.05})))  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"invalid simulator profile {where}: {type(exc).__name__}: {exc}") from None


def load_profile(path: str | Path) -> Profile:
    """Read a profile TOML file (the format of `default_profile.toml`)."""
    with Path(path).open("rb") as fh:
        return _build(tomllib.load(fh), str(path))


def default_profile() -> Profile:
    """The profile shipped with the package: H100-class nodes, llama-8b / llama-70b / qwen-moe-30b."""
    text = resources.files("nexuskv_sim").joinpath("default_profile.toml").read_text()
    return _build(tomllib.loads(text), "default_profile.toml")
