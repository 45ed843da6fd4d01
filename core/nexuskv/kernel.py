"""The kernel facade a scheduler embeds: config, plugins, identity, index, tiers and control plane wired once.

`Kernel.from_config(path)` builds one from a TOML file; `keys` / `match` answer what a request could reuse;
`put` stores a payload and indexes it; `load` reads one back, verifying its checksum and quarantining it on a
mismatch. The index stays exact across evictions (every tier reports them).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
from attrs import define, field

from nexuskv.contracts import Placement, Request, StateDescriptor, TokenSpan, Usage
from nexuskv.errors import ChecksumError, ConfigError
from nexuskv.identity import BlockKeyer, KeyChain, checksum, load_secret, verify_checksum
from nexuskv.index import Location, Match, Matcher
from nexuskv.interfaces import ControlPlane, StoredState, TierStore, Transport, slot_of
from nexuskv.logs import configure_logging, get_logger
from nexuskv.plugins import PluginManager
from nexuskv.units import parse_bytes

__all__ = ["Kernel", "KernelConfig"]

log = get_logger(__name__)


def _default_tiers() -> dict[str, dict[str, Any]]:
    return {"dram": {"store": "dram", "capacity_bytes": "1GiB"}}


@define(frozen=True)
class KernelConfig:
    """Kernel settings, as read from a TOML file (every key optional)."""

    node: str = "local"
    page_size: int = 16
    secret: str | None = None
    secret_file: str | None = None
    lease_ttl_s: float = 10.0
    matcher: dict[str, Any] = field(factory=dict)
    control_plane: dict[str, Any] = field(factory=dict)
    tiers: dict[str, dict[str, Any]] = field(factory=_default_tiers)
    transports: tuple[str, ...] = ("local",)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], origin: str = "<config>") -> KernelConfig:
        """Build from a mapping; unknown keys and wrong types are a `ConfigError` naming origin and path."""
        conv = cattrs.Converter(forbid_extra_keys=True)
        try:
            return conv.structure(dict(data), cls)
        except cattrs.BaseValidationError as exc:
            msgs = "; ".join(cattrs.transform_error(exc, path=origin))
            raise ConfigError(f"{origin}: {msgs}") from None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> KernelConfig:
        """Read a TOML config file."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: {exc}") from None
        return cls.from_mapping(data, origin=str(p))


class Kernel:
    """One embedded NexusKV kernel: build it once, call it on every request."""

    def __init__(
        self,
        config: KernelConfig | None = None,
        *,
        plugins: PluginManager | None = None,
        secret: bytes | None = None,
    ) -> None:
        configure_logging()
        self.config = config or KernelConfig()
        self.plugins = plugins or PluginManager()
        self.node = self.config.node
        self.keyer = BlockKeyer(
            secret or load_secret(self.config.secret, self.config.secret_file), self.config.page_size
        )
        self.index: Matcher = self.plugins.matcher(self.config.matcher)
        self.control: ControlPlane = self.plugins.control_plane(self.config.control_plane)
        self.lease = self.control.grant(self.config.lease_ttl_s)
        self.epoch = self.control.join(self.node, self.lease.lease_id)
        self.tiers: dict[str, TierStore] = self._build_tiers()
        self.transports: dict[str, Transport] = self._build_transports()
        log.info("kernel started", node=self.node, epoch=self.epoch, tiers=list(self.tiers),
                 plugin_problems=len(self.plugins.problems))  # fmt: skip

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **kwargs: Any) -> Kernel:
        """Build a kernel from a TOML config file."""
        return cls(KernelConfig.from_toml(path), **kwargs)

    def _build_tiers(self) -> dict[str, TierStore]:
        factories = self.plugins.tier_stores()
        tiers: dict[str, TierStore] = {}
        for name, raw in self.config.tiers.items():
            opts = dict(raw)
            kind = opts.pop("store", name)
            if kind not in factories:
                raise ConfigError(f"tiers.{name}: no tier store plugin named {kind!r} (have: {sorted(factories)})")
            if "capacity_bytes" in opts:
                try:
                    opts["capacity_bytes"] = parse_bytes(opts["capacity_bytes"])
                except ValueError as exc:
                    raise ConfigError(f"tiers.{name}.capacity_bytes: {exc}") from None
            try:
                store = factories[kind](name=name, **opts)
            except TypeError as exc:
                raise ConfigError(f"tiers.{name}: {exc}") from None
            store.set_eviction_callback(self._evicted_from(name))
            tiers[name] = store
        return tiers

    def _build_transports(self) -> dict[str, Transport]:
        factories = self.plugins.transports()
        missing = [t for t in self.config.transports if t not in factories]
        if missing:
            raise ConfigError(f"transports: no transport plugin named {missing} (have: {sorted(factories)})")
        return {name: factories[name]() for name in self.config.transports}

    def _evicted_from(self, tier: str) -> Any:
        def on_evict(slot: bytes, descriptor: StateDescriptor) -> None:
            loc = Location(tier, descriptor.placement.node, descriptor.placement.epoch)
            self.index.remove(slot[:-1], loc, 1 << slot[-1])

        return on_evict

    # ------------------------------------------------------------------------------------------ read path

    def keys(self, request: Request) -> list[bytes]:
        """Block keys of every full block of the request."""
        return self.keyer.request_keys(request)

    def session(self, request: Request) -> KeyChain:
        """A key chain for a session that will grow by appending tokens (multi-turn chat, agent loops)."""
        chain = self.keyer.chain(self.keyer.request_root(request))
        chain.extend(request.token_ids)
        return chain

    def match(self, request: Request, keys: Sequence[bytes] | None = None) -> Match:
        """What of the request is held, where: per-block holdings and restore points by kind, tier and node."""
        return self.index.match(self.keys(request) if keys is None else keys, request.layout)

    # ------------------------------------------------------------------------------------------ write path

    def describe(
        self,
        request: Request,
        block: int,
        payload: bytes | memoryview,
        *,
        tier: str,
        group: int = 0,
        keys: Sequence[bytes] | None = None,
        **extra: Any,
    ) -> StateDescriptor:
        """The descriptor of the state covering the request's first `block + 1` blocks (block is 0-based).

        Dense / latent payloads hold one page, `span` = that page; checkpoints hold the state at the end of the
        block, `span` = [0, end).
        """
        keys = self.keys(request) if keys is None else keys
        if not 0 <= block < len(keys):
            raise IndexError(f"block {block} is not a full block of a {len(request.token_ids)}-token request")
        if not 0 <= group < len(request.layout.groups):
            raise IndexError(f"group {group} is not in the layout ({len(request.layout.groups)} groups)")
        page = self.keyer.page_size
        kind = request.layout.groups[group].kind
        start = 0 if kind.checkpointed else block * page
        return StateDescriptor(
            key=keys[block].hex(),
            parent_key=keys[block - 1].hex() if block else None,
            namespace=request.namespace,
            model=request.model,
            tokenizer=request.tokenizer,
            layout=request.layout,
            group=group,
            span=TokenSpan(start, (block + 1) * page),
            nbytes=len(payload),
            checksum=checksum(payload),
            placement=Placement(tier=tier, node=self.node, epoch=self.epoch),
            usage=Usage(),
            **extra,
        )

    def put(self, descriptor: StateDescriptor, payload: bytes | memoryview, priority: float = 0.0) -> bool:
        """Store a payload in its descriptor's tier and index it; False when the tier refused it.

        The payload must match the descriptor's checksum (a `ChecksumError` otherwise): nothing unverifiable
        is ever stored.
        """
        if not verify_checksum(payload, descriptor.checksum):
            raise ChecksumError(f"payload does not match checksum of block {descriptor.key}")
        tier = descriptor.placement.tier
        store = self.tiers.get(tier)
        if store is None:
            raise ConfigError(f"no tier named {tier!r} (have: {sorted(self.tiers)})")
        if descriptor.placement.node != self.node:
            descriptor = attrs.evolve(descriptor, placement=Placement(tier, self.node, self.epoch))
        key = bytes.fromhex(descriptor.key)
        if not store.put(slot_of(key, descriptor.group), payload, descriptor, priority):
            return False
        self.index.insert(key, Location(tier, self.node, descriptor.placement.epoch), 1 << descriptor.group)
        return True

    def load(self, key: bytes, group: int = 0, tier: str | None = None, transport: str = "local") -> StoredState | None:
        """Read a block's payload from `tier` (else the first tier holding it), checksum verified.

        A payload that fails its checksum is quarantined: deleted from the tier, removed from the index, logged,
        and reported as a miss. Wrong state is never returned.
        """
        slot = slot_of(key, group)
        holding = self.index.get(key)
        if holding is None:
            return None
        tiers = [tier] if tier else [t for t in self.tiers if holding.mask_at(tier=t) & (1 << group)]
        mover = self.transports[transport]
        for name in tiers:
            store = self.tiers.get(name)
            if store is None:
                continue
            got = mover.fetch(store, slot)
            if got is None:
                continue
            if got.descriptor.key != key.hex() or not verify_checksum(got.payload, got.descriptor.checksum):
                self.quarantine(key, group, name, reason="checksum mismatch")
                continue
            return got
        return None

    def quarantine(self, key: bytes, group: int, tier: str, reason: str) -> None:
        """Drop a bad payload from its tier and the index, and log why."""
        store = self.tiers.get(tier)
        if store is not None:
            store.delete(slot_of(key, group))
        for loc, _ in list(self._locations(key)):
            if loc.tier == tier:
                self.index.remove(key, loc, 1 << group)
        log.warning("payload quarantined", key=key.hex(), group=group, tier=tier, reason=reason)

    def _locations(self, key: bytes) -> tuple[tuple[Location, int], ...]:
        h = self.index.get(key)
        return () if h is None else h.locations

    def close(self) -> None:
        """Release tiers, transports and the control-plane lease."""
        for store in self.tiers.values():
            store.close()
        for t in self.transports.values():
            t.close()
        self.control.revoke(self.lease.lease_id)
        self.control.close()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
