"""What a config's `[tiers]` and `transports` build: tier options parsed, plugins found, transports checked.

Every mistake is a `ConfigError` naming the key: a tier store or transport no plugin provides, a size that does not
parse, transport options for a transport not listed, a remote transport listed first, a tier the cost profile has
no cost for, a shared tier that cannot take the name key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexuskv.contracts.config import KernelConfig
from nexuskv.errors import ConfigError
from nexuskv.logs import get_logger
from nexuskv.planning.cost import CostModel
from nexuskv.planning.planner import RESIDENT_TIER
from nexuskv.plugins.interfaces import TierStore, Transport
from nexuskv.units import parse_bytes

__all__ = ["build_transports", "hand_name_key", "remote_transport", "tier_options", "unpriced"]

log = get_logger("nexuskv.hierarchy")  # the component name operators filter on: stable


def tier_options(name: str, raw: Mapping[str, Any], factories: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """`(store plugin name, options)` of tier `name` (sizes written like "4GiB" become bytes)."""
    if name.lower() == RESIDENT_TIER:  # any case: engines' event media are matched in any case
        raise ConfigError(f"tiers.{name}: the name {RESIDENT_TIER!r} is reserved for the engine's own cache "
                          "(RESIDENT_TIER: routes price it, plans never read it); name the tier otherwise")
    opts = dict(raw)
    kind = opts.pop("store", name)
    if kind not in factories:
        raise ConfigError(f"tiers.{name}: no tier store plugin named {kind!r} (have: {sorted(factories)})")
    for opt in [o for o in opts if o.endswith("_bytes")]:  # sizes may be written "4GiB"
        try:
            opts[opt] = parse_bytes(opts[opt])
        except ValueError as exc:
            raise ConfigError(f"tiers.{name}.{opt}: {exc}") from None
    return kind, opts


def hand_name_key(name: str, store: TierStore, name_key: bytes) -> None:
    """Give tier `name`'s store the deployment's name key (`StateSeal.name_key`) before it stores, reads or lists.

    Every store with a `use_name_key(key)` gets it, as remote transports get `authenticate(key)`: it names what it
    stores in shared places by `store_name(key, slot)`, never by slot. A store that holds other processes' or
    nodes' state (`shared = True`) must have the method: a shared place named by raw slots is a `ConfigError`.
    """
    use = getattr(store, "use_name_key", None)
    if callable(use):
        use(name_key)
    elif getattr(store, "shared", False) is True:
        raise ConfigError(f"tiers.{name}: the store is shared with other processes or nodes but cannot take the name "
                          f"key (it has no use_name_key(key)); names in a shared store must be keyed")  # fmt: skip


def build_transports(config: KernelConfig, factories: Mapping[str, Any], peer_key: bytes) -> dict[str, Transport]:
    """The transports `config.transports` names, built from their plugins with `transport_options`.

    Every transport that reaches other nodes (`remote = True`) gets `peer_key` (derived from the deployment secret)
    through its `authenticate(key)`, and must have one: a node-to-node edge nobody authenticates is a `ConfigError`.
    """
    missing = [t for t in config.transports if t not in factories]
    if missing:
        raise ConfigError(f"transports: no transport plugin named {missing} (have: {sorted(factories)})")
    stray = sorted(set(config.transport_options) - set(config.transports))
    if stray:
        raise ConfigError(f"transport_options: {stray} not in transports {list(config.transports)}")
    out: dict[str, Transport] = {}
    for name in config.transports:
        try:
            out[name] = factories[name](**config.transport_options.get(name, {}))
        except Exception as exc:
            raise ConfigError(f"transport_options.{name}: {type(exc).__name__}: {exc}") from None
    for name, mover in out.items():
        if getattr(mover, "remote", False) is not True:
            continue
        authenticate = getattr(mover, "authenticate", None)
        if not callable(authenticate):
            raise ConfigError(f"transports: {name!r} reaches other nodes but cannot authenticate them (it has no "
                              f"authenticate(key)); every node-to-node edge must be keyed")  # fmt: skip
        authenticate(peer_key)
    first = config.transports[0]
    if getattr(out[first], "remote", False) is True:
        raise ConfigError(f"transports: the first transport reads this node's own tiers; {first!r} reaches other "
                          f"nodes (list it after 'local': {['local', *config.transports]})")  # fmt: skip
    return out


def remote_transport(transports: Mapping[str, Transport], cost: CostModel) -> str:
    """The first transport that reaches other nodes and has a cost in the profile ("" when none)."""
    for name, mover in transports.items():
        if getattr(mover, "remote", False) is True:
            if name in cost.profile.transports:
                return name
            log.warning("transport has no cost in the profile; peers' state will not be planned", transport=name)
    return ""


def unpriced(config: KernelConfig, cost: CostModel, tiers: list[str]) -> str:
    """Why tiers the cost profile has no cost for are refused, and how to fix it (docs/tiers.md#tier-costs)."""
    which = f"{cost.profile.name!r} ({config.profile})" if config.profile else \
        f"{cost.profile.name!r} (the built-in default: `profile` is not set)"  # fmt: skip
    names = ", ".join(f"tiers.{t}" for t in tiers)
    entries = ", ".join(f'"{t}": {{"bandwidth_bytes_per_s": ..., "latency_ms": ...}}' for t in tiers)
    return (f"{names}: the cost profile {which} has no cost for {'this tier' if len(tiers) == 1 else 'these tiers'},"
            f" so no plan would ever read what it stores; add {entries} to the profile's \"tiers\" (a profile JSON"
            f" named by `profile`; `nexuskv calibrate --config` measures one), or use a tier name the profile"
            f" prices ({', '.join(sorted(cost.profile.tiers))})")
