"""The node's storage hierarchy: its tiers and transports, and every way state enters, moves and leaves them.

`Hierarchy` builds the tier stores (each that names payloads handed the deployment's name key first:
`hand_name_key`) and transports the config names, orders the tiers by the cost profile
(fastest first; a tier it has no cost for is a `ConfigError`), re-indexes persistent tiers, stores and loads
payloads (each sealed with the deployment's keyed MAC when stored and checked when read: `StateSeal`; bad
payloads quarantined), and keeps the index exact: every eviction a tier reports
removes exactly that group at that location, and the evicted payload is demoted one tier down where it fits.
Prefetch moves go through `move`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs

from nexuskv.cluster.membership import Membership
from nexuskv.contracts import Layout, Namespace, Placement, StateDescriptor
from nexuskv.contracts.checksums import CHECKSUMS, checksum_known, verify_checksum
from nexuskv.contracts.config import KernelConfig
from nexuskv.errors import ChecksumError, ConfigError
from nexuskv.logs import get_logger
from nexuskv.ops.counters import Tally
from nexuskv.planning.breakers import Health
from nexuskv.planning.cost import CostModel
from nexuskv.plugins.interfaces import PersistentTierStore, StoredState, TierStore, Transport, slot_of
from nexuskv.state.index import Location, Matcher
from nexuskv.storage.state_seal import StateSeal
from nexuskv.storage.tier_config import build_transports, hand_name_key, remote_transport, tier_options, unpriced

__all__ = ["Hierarchy"]

log = get_logger("nexuskv.hierarchy")  # the component name operators filter on: stable


_UNKNOWN_CHECKSUM = "unknown checksum algorithm"
_UNSEALED = "no MAC"


def _payload_problem(key: bytes, group: int, got: StoredState, seal: StateSeal) -> str:
    """Why a payload read back for block `key`, group `group`, must not be used ("" when it may).

    Not the block's (its key or its group: another group's sealed state moved into this slot), a checksum this
    version cannot compute (`_UNKNOWN_CHECKSUM`: written by a newer one), no MAC (`_UNSEALED`: written before
    stored state was sealed, or by something that is not a kernel of this deployment), or a MAC that does not check
    (corrupt, or forged: the checksum tells which).
    """
    desc = got.descriptor
    if desc.key != key.hex() or desc.group != group:
        return "not the block's"
    if not checksum_known(desc.checksum):
        return _UNKNOWN_CHECKSUM
    if not desc.mac:
        return _UNSEALED
    if not seal.check(desc, got.payload):
        if not verify_checksum(got.payload, desc.checksum):
            return "checksum mismatch"
        return "MAC does not check (not sealed with this deployment's secret, or changed since)"
    return ""


def _persistent(store: TierStore) -> bool:
    """Whether `store` is a `PersistentTierStore`: it has `descriptors()`, found as plain attribute access finds it.

    Not `isinstance` with the protocol: from Python 3.12 that ignores what a store forwards through `__getattr__`
    (a wrapping store), so the same plugin would be re-indexed on 3.11 and not on 3.12.
    """
    return callable(getattr(store, "descriptors", None))


def _nbytes(payload: bytes | memoryview) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


class Hierarchy:
    """Tier stores and transports of one node, ordered fastest first, with the index kept exact across them."""

    def __init__(self, config: KernelConfig, factories: tuple[dict[str, Any], dict[str, Any]], index: Matcher,
                 cost: CostModel, health: Health, membership: Membership, seal: StateSeal) -> None:  # fmt: skip
        """`factories` are the plugin manager's (tier stores, transports) by name; `seal` the deployment's MAC."""
        self.config = config
        self.seal = seal
        self.node = config.node
        self.index = index
        self.cost = cost
        self.health = health
        self.membership = membership
        self.counts = Tally()  # per tier: hits, misses, read_bytes, written_bytes, evictions, quarantined (metrics)
        self.tier_order: tuple[str, ...] = ()  # set below; evictions during re-indexing see no lower tier
        tier_factories, transport_factories = factories
        self.tiers: dict[str, TierStore] = self._build_tiers(tier_factories)
        self.transports: dict[str, Transport] = build_transports(config, transport_factories, seal.peer_key)
        known = [t for t in self.tiers if t in cost.profile.tiers]
        if len(known) < len(self.tiers):  # it would store blocks no plan ever reads (closing the built tiers first)
            self.close()
            raise ConfigError(unpriced(config, cost, [t for t in self.tiers if t not in cost.profile.tiers]))
        known.sort(key=lambda t: (-cost.profile.tiers[t].bandwidth_bytes_per_s, t))
        self.tier_order = tuple(known)
        # Tiers that hold other nodes' payloads too (a host-wide shm tier, a Redis server), as their stores declare
        # (`shared = True`): read here, never fetched from a peer. A disk tier is this node's own.
        self.shared_tiers = tuple(n for n, st in self.tiers.items() if getattr(st, "shared", False) is True)
        self.remote = remote_transport(self.transports, cost)
        self.addresses: dict[str, str] = {}  # transport -> address this node serves its tiers on (for peers)
        # peers' addresses learned from accepted handoff grants, where the control plane publishes none
        self.directory: Callable[[str, str], str | None] | None = None
        for name, mover in self.transports.items():
            serve = getattr(mover, "serve", None)
            if callable(serve):
                try:
                    self.addresses[name] = serve(self.tiers)
                except Exception as exc:
                    raise ConfigError(f"transport_options.{name}: cannot serve this node's tiers: "
                                      f"{type(exc).__name__}: {exc}") from None  # fmt: skip
                log.info("serving tiers to peers", transport=name, address=self.addresses[name])

    @property
    def fastest(self) -> str:
        """The fastest tier with a cost (any tier when none has one)."""
        return self.tier_order[0] if self.tier_order else next(iter(self.tiers))

    def placement(self, tier: str) -> Placement:
        """Where state stored now in `tier` is: this node, at its current epoch."""
        return Placement(tier, self.node, self.membership.epoch)

    # ------------------------------------------------------------------------------------------ building

    def _build_tiers(self, factories: dict[str, Any]) -> dict[str, TierStore]:
        tiers: dict[str, TierStore] = {}
        for name, raw in self.config.tiers.items():
            kind, opts = tier_options(name, raw, factories)
            try:
                store = factories[kind](name=name, **opts)
            except TypeError as exc:
                raise ConfigError(f"tiers.{name}: {exc}") from None
            try:  # before anything is stored, read or listed: names in shared stores are keyed
                hand_name_key(name, store, self.seal.name_key)
            except BaseException:
                store.close()
                raise
            store.set_eviction_callback(self._evicted_from(name))
            tiers[name] = store
            if _persistent(store):
                self._reindex(name, store)
        return tiers

    def reindex(self, tier: str) -> int:
        """Index what a persistent tier holds now (a host-wide tier another process writes to); returns the count."""
        store = self.tiers.get(tier)
        if not _persistent(store):
            raise ConfigError(f"tier {tier!r} is not a persistent tier (have: {sorted(self.tiers)})")
        return self._reindex(tier, store)

    def _reindex(self, name: str, store: PersistentTierStore) -> int:
        n = unknown = unsealed = misfiled = 0
        for slot, desc in store.descriptors():
            if desc.key != slot[:-1].hex() or desc.group != slot[-1]:  # listed under another slot than its own
                misfiled += 1
                continue
            if not checksum_known(desc.checksum):  # written by a newer version: never planned here
                unknown += 1
                continue
            if not desc.mac:  # written before state was sealed, or planted: never planned (loads check the MAC)
                unsealed += 1
                continue
            self.index.insert(slot[:-1], Location(name, desc.placement.node, desc.placement.epoch), 1 << slot[-1])
            n += 1
        if n or unknown or unsealed or misfiled:
            log.info("tier re-indexed", tier=name, payloads=n, unknown_checksum=unknown, unsealed=unsealed,
                     misfiled=misfiled)  # fmt: skip
        return n

    # ------------------------------------------------------------------------------------------ evictions

    def _evicted_from(self, tier: str) -> Callable[..., None]:
        def on_evict(slot: bytes, descriptor: StateDescriptor, payload: bytes | memoryview | None = None) -> None:
            loc = Location(tier, descriptor.placement.node, descriptor.placement.epoch)
            self.index.remove(slot[:-1], loc, 1 << slot[-1])
            self.counts.add(("evictions", tier))
            if payload is not None and self.config.demote:
                self._demote(tier, descriptor, payload)

        return on_evict

    def default_priority(self, descriptor: StateDescriptor) -> float:
        """Eviction priority when no `place` rule gives one: the tier's floor plus `CostModel.eviction_priority`."""
        tier = descriptor.placement.tier
        floor = getattr(self.tiers.get(tier), "floor", 0.0)
        return self.cost.eviction_priority(self.config.eviction, floor, self.config.page_size, descriptor.usage.hits,
                                           tier=tier)  # fmt: skip

    def priority_for(self, descriptor: StateDescriptor, explicit: float | None = None) -> tuple[float, float | None]:
        """(priority, value) to store a payload with: a `place` rule's `explicit` priority as given, else the default.

        Computed once: a tier that counts reads (`counts_reads`) takes the value and adds its own floor under its
        lock; others take the floor plus it (`default_priority`).
        """
        if explicit is not None:
            return explicit, None
        tier = descriptor.placement.tier
        store = self.tiers.get(tier)
        if not getattr(store, "counts_reads", False):
            return self.default_priority(descriptor), None
        value = self.cost.eviction_priority(self.config.eviction, 0.0, self.config.page_size, tier=tier)
        return getattr(store, "floor", 0.0) + value, value

    def _demote(self, tier: str, descriptor: StateDescriptor, payload: bytes | memoryview) -> None:
        """Move an evicted payload one tier down (in cost order) instead of losing it, where it fits."""
        order = self.tier_order
        if tier not in order or order.index(tier) + 1 >= len(order):
            return
        lower = order[order.index(tier) + 1]
        if not self.seal.check(descriptor, payload):  # what a tier evicts is sealed again below: it must be ours
            log.warning("evicted payload not demoted: its MAC does not check", tier=tier, key=descriptor.key)
            return
        desc = attrs.evolve(descriptor, placement=self.placement(lower))
        try:
            priority, value = self.priority_for(desc)
            self.put(desc, payload, priority=priority, value=value)
        except Exception as exc:  # a failing lower tier loses the payload, never the request
            self.health.breaker(lower).failure(f"demotion put failed: {exc!r}")

    # ------------------------------------------------------------------------------------------ store / load

    def put(self, descriptor: StateDescriptor, payload: bytes | memoryview, priority: float = 0.0,
            value: float | None = None) -> bool:
        """Store a payload in its descriptor's tier and index it; False when the tier refused it.

        The payload must match the descriptor's checksum (a `ChecksumError` otherwise): nothing unverifiable
        is ever stored. A paged block whose prefix no tier holds is refused (`orphan`).
        """
        if not verify_checksum(payload, descriptor.checksum):
            unknown = "" if checksum_known(descriptor.checksum) else (
                f"has an unknown checksum algorithm {descriptor.checksum.partition(':')[0]!r} "
                f"(known: {', '.join(CHECKSUMS)}): it ")  # fmt: skip
            raise ChecksumError(f"payload {unknown}does not match checksum of block {descriptor.key}")
        parent = bytes.fromhex(descriptor.parent_key) if descriptor.parent_key else None
        if self.orphan(parent, descriptor.layout, descriptor.group):
            return False
        return self.store(descriptor, payload, priority, value=value)

    def orphan(self, parent: bytes | None, layout: Layout, group: int) -> bool:
        """True for a paged block (of `group`, continuing block `parent`) whose prefix no tier holds.

        Such a block would restore nothing and push out state that would. Checkpoints and first blocks never are.
        """
        if parent is None or layout.groups[group].kind.checkpointed:
            return False
        held = self.index.get(parent)
        return held is None or not held.mask_at() & (1 << group)

    def faster(self, tier: str, than: str) -> bool:
        """True when both tiers have a cost and `tier` comes before `than` in the tier order."""
        order = self.tier_order
        if than.startswith("peer:"):  # state fetched from another node: any tier of this node is nearer
            return tier in order
        return tier in order and than in order and order.index(tier) < order.index(than)

    def store(self, descriptor: StateDescriptor, payload: bytes | memoryview, priority: float,
              ttl_s: float | None = None, value: float | None = None) -> bool:  # fmt: skip
        """`put` for payloads whose checksum was computed or verified a moment ago (not hashed twice).

        `value` (from `priority_for`) goes to stores that count reads; others get `priority` alone.
        """
        tier = descriptor.placement.tier
        store = self.tiers.get(tier)
        if store is None:
            raise ConfigError(f"no tier named {tier!r} (have: {sorted(self.tiers)})")
        if descriptor.placement.node != self.node:
            descriptor = attrs.evolve(descriptor, placement=self.placement(tier))
        descriptor = self.seal.seal(descriptor, payload)  # every stored payload carries the deployment's MAC
        key = bytes.fromhex(descriptor.key)
        slot = slot_of(key, descriptor.group)
        if value is not None:
            ok = store.put(slot, payload, descriptor, priority, ttl_s, value=value)  # type: ignore[call-arg]
        elif ttl_s is not None:
            ok = store.put(slot, payload, descriptor, priority, ttl_s)
        else:
            ok = store.put(slot, payload, descriptor, priority)
        if not ok:
            return False
        self.counts.add(("written_bytes", tier), _nbytes(payload))
        self.index.insert(key, Location(tier, self.node, descriptor.placement.epoch), 1 << descriptor.group)
        return True

    def load(self, key: bytes, group: int = 0, tier: str | None = None, transport: str = "local") -> StoredState | None:
        """Read a block's payload from `tier` (else the first tier holding it), checksum verified.

        A payload that fails its checksum is quarantined: deleted from the tier, removed from the index, logged,
        and reported as a miss. A payload the index says is held but the tier no longer has (gone behind the
        kernel's back, or evicted while this load ran) loses its index entry: what the index says is held, is.
        Wrong state is never returned.
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
                self.counts.add(("misses", name))
                self._forget(key, group, name, store)
                continue
            if not self.verified(key, group, name, got, "checksum mismatch"):
                self.counts.add(("misses", name))
                continue
            self.counts.add(("hits", name))
            self.counts.add(("read_bytes", name), _nbytes(got.payload))
            return got
        return None

    def load_peer(self, node: str, tier: str, transport: str, blocks: list[tuple[bytes, int]],
                  timeout_s: float | None = None, *, namespace: Namespace) -> list[StoredState | None]:  # fmt: skip
        """Fetch (key, group) payloads held in `tier` on peer `node`, each checksum verified (None: not usable).

        Every block is of `namespace` (the request's, or the owner's of a shared scope): the fetch names it, and
        the peer serves nothing of another namespace.

        The peer's address is what it published to the control plane, else what a live handoff grant from it
        says (`nexuskv.storage.handoff`). A payload that is missing, not the
        block's or fails its checksum loses the peer's entry in this node's index (nothing is deleted on the
        peer); a peer that cannot be reached raises (the caller's breaker counts it).
        """
        status = self.membership.peer_status(node) or {}
        address = (status.get("addresses") or {}).get(transport)
        if not address and self.directory is not None:
            address = self.directory(node, transport)
        if not address:
            raise LookupError(f"node {node!r} has published no {transport} address")
        got = self.transports[transport].fetch_remote(address, tier, [slot_of(k, g) for k, g in blocks],  # type: ignore[attr-defined]
                                                      timeout_s=timeout_s, namespace=namespace)  # fmt: skip
        out: list[StoredState | None] = []
        for (key, group), st in zip(blocks, got, strict=True):
            problem = "missing" if st is None else _payload_problem(key, group, st, self.seal)
            if problem:
                self.forget_peer(key, group, tier, node)
                log.warning("peer state refused", node=node, tier=tier, key=key.hex(), group=group, why=problem)
            out.append(None if problem else st)
        return out

    def forget_peer(self, key: bytes, group: int, tier: str, node: str) -> int:
        """Drop peer `node`'s entry for a block group in `tier` from this node's index (its payload was bad)."""
        return self._unindex(key, group, tier, node=node)

    def _forget(self, key: bytes, group: int, tier: str, store: TierStore) -> None:
        """Drop the index entries of a slot `tier` turned out not to hold (unless it was stored again since)."""
        gone = self._unindex(key, group, tier)
        got = store.get(slot_of(key, group)) if gone else None
        if got is not None:  # a writer stored it again meanwhile: its entry stands
            p = got.descriptor.placement
            self.index.insert(key, Location(tier, p.node, p.epoch), 1 << group)
        elif gone:
            log.info("index entry dropped: the tier no longer holds the payload", key=key.hex(), group=group,
                     tier=tier)  # fmt: skip

    def verified(self, key: bytes, group: int, tier: str, got: StoredState, reason: str) -> bool:
        """True when a payload read from `tier` is the block's and its MAC (over it and its descriptor) checks.

        A mismatch (corrupt or forged) is quarantined. A checksum this version cannot compute (written by a newer
        one) or a descriptor with no MAC (written before state was sealed) is refused without deleting anything: the
        entry leaves this kernel's index, the payload stays for whoever can read it.
        """
        problem = _payload_problem(key, group, got, self.seal)
        if problem in (_UNKNOWN_CHECKSUM, _UNSEALED):
            self._unindex(key, group, tier)
            log.warning("payload refused", why=problem, key=key.hex(), group=group, tier=tier,
                        checksum=got.descriptor.checksum.partition(":")[0])  # fmt: skip
            return False
        if problem:
            self.quarantine(key, group, tier, reason=f"{reason}: {problem}" if problem != reason else reason)
            return False
        return True

    def quarantine(self, key: bytes, group: int, tier: str, reason: str) -> None:
        """Drop a bad payload from its tier and the index, and log why."""
        store = self.tiers.get(tier)
        dropped = bool(store.delete(slot_of(key, group))) if store is not None else False
        if self._unindex(key, group, tier) or dropped:  # counted once, and only for a payload that was held
            self.counts.add(("quarantined", tier))
        log.warning("payload quarantined", key=key.hex(), group=group, tier=tier, reason=reason)

    def _unindex(self, key: bytes, group: int, tier: str, node: str | None = None) -> int:
        """Forget `group` of `key` at every location in `tier` (of `node` only when given, any epoch); returns how many.

        Without `node`, only locations this node reads itself: its own, and other nodes' in a shared tier.
        """
        h = self.index.get(key)
        return sum(self.index.remove(key, loc, 1 << group) for loc, _ in (() if h is None else h.locations)
                   if loc.tier == tier and (loc.node == node if node is not None else
                                            loc.node == self.node or tier in self.shared_tiers))  # fmt: skip

    def move(self, slot: bytes, source: str, target: str,
             choose: Callable[[StateDescriptor], str | None] | None = None) -> bool:  # fmt: skip
        """Copy one slot from `source` to `target` (the index gains the target location); False on a miss.

        `choose(descriptor)`, when given, sees the state before it moves and names the tier it goes to instead
        (None: it stays where it is).
        """
        src = self.tiers.get(source)
        if src is None or target not in self.tiers or not self.health.allow(source):
            return False
        got = src.get(slot)
        if got is None:
            self._forget(slot[:-1], slot[-1], source, src)
            return False
        if not self.verified(slot[:-1], slot[-1], source, got, "checksum mismatch during prefetch"):
            return False
        self.counts.add(("read_bytes", source), _nbytes(got.payload))
        where = target if choose is None else choose(got.descriptor)
        if where is None or where not in self.tiers:
            return False
        desc = attrs.evolve(got.descriptor, placement=self.placement(where))
        priority, value = self.priority_for(desc)
        return self.store(desc, got.payload, priority, value=value)

    # ------------------------------------------------------------------------------------------ lifecycle

    def flush(self, deadline: float | None) -> bool:
        """Wait (until the monotonic `deadline`, or for ever) for tiers that write behind (disk) to write."""
        ok = True
        for store in self.tiers.values():
            tier_flush = getattr(store, "flush", None)
            if callable(tier_flush):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ok = bool(tier_flush(left)) and ok
        return ok

    def close(self) -> None:
        """Close every tier store and transport."""
        for store in self.tiers.values():
            store.close()
        for t in self.transports.values():
            t.close()
