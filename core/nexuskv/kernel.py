"""The kernel facade a scheduler embeds: config, plugins, identity, index, tiers, policies, cost and control plane.

`Kernel.from_config(path)` builds one from a TOML file. On the hot path, `plan(request)` returns a `Plan` within
the deadline whatever the plugins do; after prefill, `commit(request, payloads)` hands state to the bounded
writer (admit and place rules, tier put, index insert). `materialize(plan)` loads planned state with checksums
and timeouts, `report_load_result` feeds the circuit breakers and quarantines bad entries. The index stays exact
across evictions (every tier reports them).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
from attrs import define, field

from nexuskv.contracts import (
    Namespace,
    Placement,
    Plan,
    PlanAction,
    Request,
    StateDescriptor,
    TensorSpec,
    TokenSpan,
    Usage,
    to_dict,
)
from nexuskv.cost import CostModel, load_profile
from nexuskv.errors import ChecksumError, ConfigError
from nexuskv.health import Health
from nexuskv.identity import BlockKeyer, KeyChain, checksum, load_secret, verify_checksum
from nexuskv.index import DictIndex, Location, Match, Matcher
from nexuskv.interfaces import ControlPlane, PersistentTierStore, StoredState, TierStore, Transport, slot_of
from nexuskv.kinds import group_masks
from nexuskv.logs import configure_logging, get_logger
from nexuskv.planner import Planner, decide, to_plan
from nexuskv.plugins import PluginManager
from nexuskv.policy.loader import Policies
from nexuskv.policy.model import Candidate
from nexuskv.policy.types import plugin_functions
from nexuskv.prefetch import Prefetcher
from nexuskv.units import parse_bytes
from nexuskv.writer import WriteItem, Writer

__all__ = ["CommitResult", "Kernel", "KernelConfig", "LoadReport", "Materialized"]

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
    plugins: tuple[str, ...] | None = None  # allow list of entry-point plugins (as NEXUSKV_PLUGINS)
    disable_plugins: tuple[str, ...] = ()  # block list, builtins included (as NEXUSKV_DISABLE_PLUGINS)
    policies: str | None = None
    profile: str | None = None
    deadline_ms: float = 1.0
    load_timeout_ms: float = 200.0
    writer_max_bytes: int = 256 << 20
    writer_max_items: int = 4096
    prefetch_max_bytes: int = 512 << 20
    prefetch_max_tasks: int = 64
    prefetch_tenant_share: float = 0.5
    prefetch_deadline_s: float = 5.0
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    session_cache: int = 1024
    bandwidth_scale: dict[str, float] = field(factory=dict)
    demote: bool = True
    promote_on_hit: bool = True  # a hit in a slower tier is copied to the tier the `place` rules choose
    eviction: str = field(default="cost", validator=attrs.validators.in_(("cost", "lru")))

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
        cfg = cls.from_mapping(data, origin=str(p))
        # Relative paths in a config file are relative to the file.
        for key in ("policies", "profile", "secret_file"):
            value = getattr(cfg, key)
            if value and not Path(value).is_absolute():
                cfg = attrs.evolve(cfg, **{key: str(p.parent / value)})
        tiers = {name: ({**opts, "path": str(p.parent / opts["path"])}
                        if isinstance(opts.get("path"), str) and not Path(opts["path"]).is_absolute() else opts)
                 for name, opts in cfg.tiers.items()}  # fmt: skip
        return attrs.evolve(cfg, tiers=tiers)


@define(frozen=True)
class CommitResult:
    """What `commit` accepted into the writer queue; the rest was refused by backpressure (never blocks)."""

    accepted: int
    refused: int

    @property
    def backpressure(self) -> bool:
        """True when the writer's bounds refused part of the commit."""
        return self.refused > 0


@define(frozen=True)
class Materialized:
    """State loaded for a plan: payloads of blocks [0, blocks) by (block, group); recompute from `tokens` on."""

    plan: Plan
    blocks: int
    tokens: int
    states: dict[tuple[int, int], StoredState]
    reason: str = ""

    @property
    def complete(self) -> bool:
        """True when everything the plan asked for was loaded and verified."""
        return self.tokens == self.plan.tokens_reused


@define(frozen=True)
class LoadReport:
    """What a connector reports after restoring a plan: success, or where and why it failed."""

    ok: bool
    failed_block: int | None = None
    tier: str = ""
    reason: str = ""
    corrupt: bool = False
    timeout: bool = False


@define(frozen=True)
class _Promotion:
    """A writer item: state read from `source` on a hit, to be copied to the tier its place rules choose."""

    request: Request
    descriptor: StateDescriptor
    payload: bytes | memoryview
    source: str


def _gain(plan: Plan) -> float:
    return plan.predicted.gain_ms if plan.action == PlanAction.MATERIALIZE else 0.0


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
        self.plugins = plugins or PluginManager(self._plugin_env())
        self.node = self.config.node
        self.keyer = BlockKeyer(
            secret or load_secret(self.config.secret, self.config.secret_file), self.config.page_size
        )
        self.index: Matcher = self.plugins.matcher(self.config.matcher)
        self.control: ControlPlane = self.plugins.control_plane(self.config.control_plane)
        self.epoch = 0
        self.lease = None
        self._control_error = ""
        self._control_seen = time.monotonic()
        try:
            self.lease = self.control.grant(self.config.lease_ttl_s)
            self.epoch = self.control.join(self.node, self.lease.lease_id)
        except Exception as exc:  # fail open: plans recompute until the control plane answers
            self._control_error = f"{type(exc).__name__}: {exc}"
            log.error("control plane unavailable at start", error=self._control_error)
        self.tiers: dict[str, TierStore] = self._build_tiers()
        self.transports: dict[str, Transport] = self._build_transports()
        self.cost = CostModel(load_profile(self.config.profile) if self.config.profile else None)
        self.health = Health(self.config.breaker_threshold, self.config.breaker_cooldown_s)
        self.policies: Policies | None = None
        if self.config.policies:
            decls, problems = plugin_functions(self.plugins.cel_functions())
            for problem in problems:
                log.error("plugin CEL function unusable", problem=problem)
            self.policies = Policies.load(self.config.policies, decls)
        known = [t for t in self.tiers if t in self.cost.profile.tiers]
        for t in self.tiers:
            if t not in self.cost.profile.tiers:
                log.warning("tier has no cost in the profile; plans will not read from it", tier=t)
        known.sort(key=lambda t: (-self.cost.profile.tiers[t].bandwidth_bytes_per_s, t))
        self.tier_order = tuple(known)
        self.planner = Planner(self.cost, self.health, self.tier_order, transport=self.config.transports[0])
        self.writer = Writer(self._write, self.config.writer_max_bytes, self.config.writer_max_items)
        self.prefetcher = Prefetcher(self._move, max_bytes=self.config.prefetch_max_bytes,
                                     max_tasks=self.config.prefetch_max_tasks,
                                     tenant_share=self.config.prefetch_tenant_share)  # fmt: skip
        self._loader = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="nexuskv-load")
        self._sessions: collections.OrderedDict[str, tuple[KeyChain, tuple[int, ...]]] = collections.OrderedDict()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="nexuskv-heartbeat", daemon=True)
        self._heartbeat.start()
        self.bandwidth_scale: dict[str, float] = dict(self.config.bandwidth_scale)
        self.link_load: dict[str, float] = {}
        self._recent_prefetch: dict[tuple[bytes, int, str], float] = {}
        self.decisions = 0
        self._inline_matcher = type(self.index) is DictIndex  # the builtin is pure, bounded Python
        self._watchdog = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nexuskv-watchdog")
        self._observers = bool(self.plugins.pm.hook.nexuskv_observe_decision.get_hookimpls())
        self._observed: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=10_000)
        self.observer_drops = 0
        self._observer_thread = threading.Thread(target=self._observe, name="nexuskv-observers", daemon=True)
        self._observer_thread.start()
        log.info("kernel started", node=self.node, epoch=self.epoch, tiers=list(self.tier_order),
                 policies=self.policies.tenants() if self.policies else [],
                 plugin_problems=len(self.plugins.problems))  # fmt: skip

    def _plugin_env(self) -> dict[str, str]:
        """The environment the plugin manager reads, with the config's allow / block lists applied on top."""
        env = dict(os.environ)
        if self.config.plugins is not None:
            env["NEXUSKV_PLUGINS"] = ",".join(self.config.plugins)
        if self.config.disable_plugins:
            extra = [n for n in env.get("NEXUSKV_DISABLE_PLUGINS", "").split(",") if n.strip()]
            env["NEXUSKV_DISABLE_PLUGINS"] = ",".join([*extra, *self.config.disable_plugins])
        return env

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
            for opt in [o for o in opts if o.endswith("_bytes")]:  # sizes may be written "4GiB"
                try:
                    opts[opt] = parse_bytes(opts[opt])
                except ValueError as exc:
                    raise ConfigError(f"tiers.{name}.{opt}: {exc}") from None
            try:
                store = factories[kind](name=name, **opts)
            except TypeError as exc:
                raise ConfigError(f"tiers.{name}: {exc}") from None
            store.set_eviction_callback(self._evicted_from(name))
            tiers[name] = store
            if isinstance(store, PersistentTierStore):
                self._reindex(name, store)
        return tiers

    def reindex(self, tier: str) -> int:
        """Index what a persistent tier holds now (a host-wide tier another process writes to); returns the count."""
        store = self.tiers.get(tier)
        if not isinstance(store, PersistentTierStore):
            raise ConfigError(f"tier {tier!r} is not a persistent tier (have: {sorted(self.tiers)})")
        return self._reindex(tier, store)

    def _reindex(self, name: str, store: PersistentTierStore) -> int:
        """Index what a persistent tier already holds (written by an earlier run of this node)."""
        n = 0
        for slot, desc in store.descriptors():
            self.index.insert(slot[:-1], Location(name, desc.placement.node, desc.placement.epoch), 1 << slot[-1])
            n += 1
        if n:
            log.info("tier re-indexed", tier=name, payloads=n)
        return n

    def _build_transports(self) -> dict[str, Transport]:
        factories = self.plugins.transports()
        missing = [t for t in self.config.transports if t not in factories]
        if missing:
            raise ConfigError(f"transports: no transport plugin named {missing} (have: {sorted(factories)})")
        return {name: factories[name]() for name in self.config.transports}

    def _evicted_from(self, tier: str) -> Any:
        def on_evict(slot: bytes, descriptor: StateDescriptor, payload: bytes | memoryview | None = None) -> None:
            loc = Location(tier, descriptor.placement.node, descriptor.placement.epoch)
            self.index.remove(slot[:-1], loc, 1 << slot[-1])
            if payload is not None and self.config.demote:
                self._demote(tier, descriptor, payload)

        return on_evict

    def default_priority(self, descriptor: StateDescriptor) -> float:
        """Eviction priority when no `place` rule gives one: cost-aware (GreedyDual-Size-Frequency), leaf first.

        The tier's aging floor (the priority of the most valuable state it has evicted, so recent state outlives
        old state), plus the recompute time the model saves per byte weighted by reuse (so state that is expensive
        to prefill outlives cheap state), minus a tiny amount per token of depth (so within one prefix the deepest
        blocks go first and a prefix is never broken in the middle).
        """
        if self.config.eviction == "lru":
            return 0.0  # equal priorities: the tier evicts least recently used first
        page = self.keyer.page_size
        floor = getattr(self.tiers.get(descriptor.placement.tier), "floor", 0.0)
        value = self.cost.value_per_byte(page, page, descriptor.usage.hits) * 1e6
        return floor + value - descriptor.span.end * 1e-9

    def _demote(self, tier: str, descriptor: StateDescriptor, payload: bytes | memoryview) -> None:
        """Move an evicted payload one tier down (in cost order) instead of losing it, where it fits."""
        order = getattr(self, "tier_order", ())
        if tier not in order or order.index(tier) + 1 >= len(order):
            return
        lower = order[order.index(tier) + 1]
        desc = attrs.evolve(descriptor, placement=Placement(lower, self.node, self.epoch))
        try:
            self.put(desc, payload, priority=self.default_priority(desc))
        except Exception as exc:  # a failing lower tier loses the payload, never the request
            self.health.breaker(lower).failure(f"demotion put failed: {exc!r}")

    # ------------------------------------------------------------------------------------------ read path

    def keys(self, request: Request) -> list[bytes]:
        """Block keys of every full block of the request (its layout's page size must be the kernel's)."""
        if request.layout.page_size != self.keyer.page_size:
            raise ConfigError(f"request {request.request_id}: layout page_size {request.layout.page_size} "
                              f"is not the kernel's page_size {self.keyer.page_size}")  # fmt: skip
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
        return self._store(descriptor, payload, priority)

    def _store(self, descriptor: StateDescriptor, payload: bytes | memoryview, priority: float,
               ttl_s: float | None = None) -> bool:  # fmt: skip
        """`put` for payloads whose checksum was computed or verified a moment ago (not hashed twice)."""
        tier = descriptor.placement.tier
        store = self.tiers.get(tier)
        if store is None:
            raise ConfigError(f"no tier named {tier!r} (have: {sorted(self.tiers)})")
        if descriptor.placement.node != self.node:
            descriptor = attrs.evolve(descriptor, placement=Placement(tier, self.node, self.epoch))
        key = bytes.fromhex(descriptor.key)
        slot = slot_of(key, descriptor.group)
        if not (store.put(slot, payload, descriptor, priority, ttl_s) if ttl_s is not None else
                store.put(slot, payload, descriptor, priority)):  # fmt: skip
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

    # ------------------------------------------------------------------------------------------ control plane

    def _beat(self) -> None:
        """Keep the lease alive off the hot path; plans only read the outcome."""
        every = max(0.05, self.config.lease_ttl_s / 3)
        while not self._stop.wait(every):
            try:
                if self.lease is None:
                    self.lease = self.control.grant(self.config.lease_ttl_s)
                    self.epoch = self.control.join(self.node, self.lease.lease_id)
                elif not self.control.keepalive(self.lease.lease_id):
                    self.lease = self.control.grant(self.config.lease_ttl_s)
                    self.epoch = self.control.join(self.node, self.lease.lease_id)  # a new fencing token
                self._control_seen = time.monotonic()
                self._control_error = ""
            except Exception as exc:
                self._control_error = f"{type(exc).__name__}: {exc}"
                log.warning("control plane heartbeat failed", error=self._control_error)

    def control_ok(self) -> bool:
        """True while the lease is known to be alive (last heartbeat within the lease TTL, no error since)."""
        return not self._control_error and time.monotonic() - self._control_seen < self.config.lease_ttl_s

    # ------------------------------------------------------------------------------------------ planning

    def keys_for(self, request: Request, session: str | None = None) -> list[bytes]:
        """Block keys of a request; with `session`, continue that session's cached chain (multi-turn chat).

        The cached chain is reused only when the request's tokens start with every token it has seen, under
        the same identity; otherwise the keys are computed afresh and replace it.
        """
        if session is None:
            return self.keys(request)
        toks = request.token_ids
        root = self.keyer.request_root(request)
        got = self._sessions.get(session)
        if got is not None:
            chain, seen = got
            if chain.root == root and len(seen) <= len(toks) and toks[: len(seen)] == seen:
                chain.extend(toks[len(seen):])
                self._sessions[session] = (chain, toks)
                self._sessions.move_to_end(session)
                return list(chain.keys)  # a copy: the chain keeps growing
        chain = self.keyer.chain(root)
        chain.extend(toks)
        self._sessions[session] = (chain, toks)
        while len(self._sessions) > self.config.session_cache:
            self._sessions.popitem(last=False)
        return list(chain.keys)

    def plan(
        self,
        request: Request,
        *,
        keys: Sequence[bytes] | None = None,
        session: str | None = None,
        deadline_ms: float | None = None,
    ) -> Plan:
        """Decide what of `request` to restore, from where, and what to prefetch; never later than the deadline.

        Any failure on the way (a plugin raising, the deadline passing, the control plane down) gives a
        `recompute` plan whose reasons say why.
        """
        t0 = time.perf_counter()
        budget = (deadline_ms if deadline_ms is not None else
                  (request.slo.deadline_ms if request.slo.deadline_ms is not None else self.config.deadline_ms))
        decision_id = os.urandom(8).hex()
        stage = "start"
        try:
            if not self.control_ok():
                return self._fallback(request, decision_id, t0,
                                      f"control plane unavailable ({self._control_error or 'lease not renewed'})")
            mover = f"transport:{self.planner.transport}"
            if not self.health.allow(mover):
                return self._fallback(request, decision_id, t0, f"{mover} circuit open "
                                      f"({self.health.breaker(mover).last_error})")  # fmt: skip
            stage = "keys"
            if keys is None:
                keys = self.keys_for(request, session)
            if time.perf_counter() - t0 > budget / 1e3:
                return self._fallback(request, decision_id, t0, f"deadline {budget:g} ms passed after {stage}")
            stage = "match"
            if self._inline_matcher:
                match = self.index.match(keys, request.layout)
            else:  # a plugin matcher runs under a watchdog: a hung plugin costs the deadline, never more
                left = budget / 1e3 - (time.perf_counter() - t0)
                future = self._watchdog.submit(self.index.match, keys, request.layout)
                try:
                    match = future.result(timeout=max(left, 0.0))
                except concurrent.futures.TimeoutError:
                    return self._fallback(request, decision_id, t0, f"deadline {budget:g} ms passed in the matcher")
            stage = "policy"
            policy = self.policies.for_tenant(request.tenant) if self.policies is not None else None
            stage = "plan"
            decide_args = dict(node=request.node or self.node, decision_id=decision_id, epoch=self.epoch,
                               inflight=self._inflight(), bandwidth_scale=self.bandwidth_scale,
                               prefetch_target=self.tier_order[0] if len(self.tier_order) > 1 else "")  # fmt: skip
            decision = decide(self.planner, request, match, policy, **decide_args)  # type: ignore[arg-type]
            stage = "shared state"
            for owner, scope in self.policies.readable_by(request.tenant) if self.policies is not None else ():
                if time.perf_counter() - t0 > budget / 1e3:
                    break  # the own plan stands: shared candidates are an optimisation on top
                got = self._shared_decision(request, owner, scope, policy, decide_args)
                if got is not None and _gain(got[0].plan) > _gain(decision.plan):
                    decision, keys = got
        except Exception as exc:
            log.exception("planning failed", stage=stage, request_id=request.request_id)
            return self._fallback(request, decision_id, t0, f"{stage} failed: {type(exc).__name__}: {exc}")
        if decision.plan.prefetch:
            self._schedule_prefetch(request, keys, decision.plan)
        self._log_decision(decision.plan, t0)
        return decision.plan

    def _shared_decision(self, request: Request, owner: str, scope: str, policy: Any,
                         decide_args: dict[str, Any]) -> tuple[Any, list[bytes]] | None:  # fmt: skip
        """A decision over another tenant's shared scope, if its `share` rule grants this request anything."""
        ns = Namespace(tenant=owner, scope=scope, cache_salt=request.cache_salt)
        root = self.keyer.root(ns, request.model, request.tokenizer, request.layout)
        keys = self._held_prefix_keys(root, request)
        match = self.index.match(keys, request.layout)
        blocks = match.longest()
        if not blocks or self.policies is None:
            return None
        view = Candidate(tokens=blocks * request.layout.page_size, blocks=blocks, owner=owner, scope=scope,
                         shared=True, kind=request.layout.kind)  # fmt: skip
        grant = self.policies.for_tenant(owner).evaluate("share", {"request": request, "match": view})
        if not grant.allowed:
            return None
        return decide(self.planner, request, match, policy, shared_from=ns, **decide_args), keys

    def _held_prefix_keys(self, root: bytes, request: Request, chunk: int = 8) -> list[bytes]:
        """Keys from `root` over the request, in doubling chunks, stopping at the first block nobody holds.

        Looking for shared state costs one small chunk of hashing when there is none. Checkpointed layouts can restore
        past a gap, so they get every key.
        """
        if request.extra_inputs or group_masks(request.layout.groups)[1]:
            return self.keyer.keys(root, request.token_ids, request.extra_inputs)
        page = request.layout.page_size
        toks = request.token_ids
        keys: list[bytes] = []
        get = self.index.get
        while len(keys) * page + page <= len(toks):
            start = len(keys) * page
            new = self.keyer.extend(keys[-1] if keys else root, toks[start : start + chunk * page], offset=start)
            keys.extend(new)
            if not new or any(get(k) is None for k in new):
                break
            chunk *= 2
        return keys

    def _inflight(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.link_load)
        for tier, n in self.prefetcher.inflight_bytes().items():
            out[tier] = out.get(tier, 0.0) + n
        return out

    async def aplan(self, request: Request, **kwargs: Any) -> Plan:
        """`plan` for asyncio callers (it is CPU-bound and bounded by the deadline, so it runs inline)."""
        return self.plan(request, **kwargs)

    def _fallback(self, request: Request, decision_id: str, t0: float, reason: str) -> Plan:
        plan = to_plan(request, None, action=PlanAction.RECOMPUTE, decision_id=decision_id,
                       page=request.layout.page_size, transport="", reasons=[f"fail-open: {reason}"],
                       epoch=self.epoch, cost=self.cost)  # fmt: skip
        self._log_decision(plan, t0, fallback=True)
        return plan

    def _log_decision(self, plan: Plan, t0: float, fallback: bool = False) -> None:
        self.decisions += 1
        record = {"decision_id": plan.decision_id, "request_id": plan.request_id, "tenant": plan.tenant,
                  "action": plan.action.value, "tokens_total": plan.tokens_total,
                  "tokens_reused": plan.tokens_reused, "policy_revision": plan.policy_revision,
                  "epoch": plan.epoch, "rules": list(plan.rules), "reasons": list(plan.reasons),
                  "predicted": to_dict(plan.predicted), "plan_ms": round((time.perf_counter() - t0) * 1e3, 4),
                  "fallback": fallback}  # fmt: skip
        # Rendered here: a background renderer competes for the GIL and stalls plans by whole switch intervals.
        log.info("decision", **record)
        if self._observers:  # plugin observers are arbitrary code: they run on their own thread
            try:
                self._observed.put_nowait(record)
            except queue.Full:
                self.observer_drops += 1  # observers are slower than decisions: drop and count, never wait

    def _observe(self) -> None:
        while True:
            record = self._observed.get()
            if record is None:
                return
            self.plugins.observe_decision(record)

    # ------------------------------------------------------------------------------------------ write path

    def commit(
        self,
        request: Request,
        payloads: Mapping[tuple[int, int], bytes | memoryview] | Sequence[bytes | memoryview],
        *,
        keys: Sequence[bytes] | None = None,
        tensors: Mapping[tuple[int, int], Sequence[TensorSpec]] | None = None,
    ) -> CommitResult:
        """Hand produced state to the bounded writer: `payloads[block]` (group 0) or `payloads[(block, group)]`.

        `tensors[(block, group)]` names the raw tensors of a payload (dtype and shape), recorded in its descriptor
        so a connector can check them before restoring. Returns at once. The writer applies the tenant's `admit`
        and `place` rules, stores accepted state in its tier and indexes it; what the writer's bounds cannot take
        is refused (backpressure), never queued without bound.
        """
        keys = self.keys(request) if keys is None else keys
        items = payloads.items() if isinstance(payloads, Mapping) else (((b, 0), p) for b, p in enumerate(payloads))
        specs = tensors or {}
        work = []
        for (block, group), payload in items:
            data = bytes(payload)  # the engine may reuse its buffer; the queue owns a copy
            spec = tuple(specs.get((block, group), ()))
            work.append(WriteItem(len(data), (request, keys, block, group, data, spec)))
        accepted = self.writer.submit(work)
        return CommitResult(accepted=accepted, refused=len(work) - accepted)

    async def acommit(self, request: Request, payloads: Any, **kwargs: Any) -> CommitResult:
        """`commit` for asyncio callers."""
        return await asyncio.to_thread(self.commit, request, payloads, **kwargs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has stored everything queued, and tiers that write behind (disk) have written it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = self.writer.flush(timeout)
        for store in self.tiers.values():
            tier_flush = getattr(store, "flush", None)
            if callable(tier_flush):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ok = bool(tier_flush(left)) and ok
        return ok

    def _write(self, item: tuple[Request, Sequence[bytes], int, int, bytes, tuple[TensorSpec, ...]] | _Promotion,
               ) -> None:  # fmt: skip
        if isinstance(item, _Promotion):
            self._promote(item)
            return
        request, keys, block, group, data, spec = item
        first = self.tier_order[0] if self.tier_order else next(iter(self.tiers))
        desc = self.describe(request, block, data, tier=first, group=group, keys=keys, tensors=spec)
        policy = self.policies.for_tenant(request.tenant) if self.policies is not None else None
        priority: float | None = None
        ttl_s: float | None = None
        tier = first
        if policy is not None:
            admit = policy.evaluate("admit", {"state": desc, "request": request, "node": self.node})
            if not admit.allowed:
                log.info("state not admitted", tenant=request.tenant, request_id=request.request_id, block=block,
                         rules=list(admit.deciding), messages=list(admit.messages))  # fmt: skip
                return
            tier, priority, ttl_s = self._placement(policy, desc, request, tier)
        if tier not in self.tiers:
            log.warning("place rule names an unknown tier; using the fastest", tier=tier, fallback=first)
            tier = first
        # The placed tier first; if it refuses (full of more valuable state), the next lower tier with room.
        order = list(self.tier_order) or list(self.tiers)
        candidates = order[order.index(tier):] if tier in order else [tier]
        for where in candidates:
            if where != desc.placement.tier:
                desc = attrs.evolve(desc, placement=Placement(where, self.node, self.epoch))
            breaker = self.health.breaker(where)
            prio = priority if priority is not None else self.default_priority(desc)
            try:
                ok = self._store(desc, data, prio, ttl_s)  # describe() just computed the checksum of `data`
            except Exception as exc:
                breaker.failure(f"put failed: {exc!r}")
                raise
            breaker.success()
            if ok:
                return

    def _placement(self, policy: Any, desc: StateDescriptor, request: Request,
                   tier: str) -> tuple[str, float | None, float | None]:  # fmt: skip
        """(tier, priority, ttl_s) the tenant's `place` rules choose for `desc`; `tier` and no bounds if none fires."""
        place = policy.evaluate("place", {"state": desc, "request": request, "node": self.node})
        if place.placement is None:
            return tier, None, None
        return place.placement.tier or tier, place.placement.priority, place.placement.ttl_s

    def _promote(self, item: _Promotion) -> None:
        """Copy state that was just read from a slower tier to the tier the tenant's `place` rules choose for it.

        Runs on the writer thread. Without policies the target is the fastest tier. Nothing happens when the
        target is not faster than where the state was read, or the target already holds it.
        """
        desc, source = item.descriptor, item.source
        order = list(self.tier_order)
        target, priority, ttl_s = (order[0] if order else source), None, None
        policy = self.policies.for_tenant(item.request.tenant) if self.policies is not None else None
        if policy is not None:
            target, priority, ttl_s = self._placement(policy, desc, item.request, target)
        if target not in order or source not in order or order.index(target) >= order.index(source):
            return
        slot = slot_of(bytes.fromhex(desc.key), desc.group)
        if slot in self.tiers[target]:
            return
        usage = attrs.evolve(desc.usage, hits=desc.usage.hits + 1, last_access_s=time.time())
        promoted = attrs.evolve(desc, placement=Placement(target, self.node, self.epoch), usage=usage)
        prio = priority if priority is not None else self.default_priority(promoted)
        try:
            self._store(promoted, item.payload, prio, ttl_s)  # verified by the load that read it
        except Exception as exc:  # a failing faster tier loses the copy, never the state
            self.health.breaker(target).failure(f"promotion put failed: {exc!r}")

    # ------------------------------------------------------------------------------------------ load path

    def materialize(self, plan: Plan, request: Request, *, keys: Sequence[bytes] | None = None,
                    timeout_ms: float | None = None) -> Materialized:  # fmt: skip
        """Load the plan's spans (checksums verified, each tier read bounded by a timeout).

        Stops at the first block that is missing, corrupt (quarantined), or slow (its tier's breaker opens):
        the caller restores blocks [0, blocks) and recomputes from `tokens` on. Never returns wrong state.
        """
        if plan.action != PlanAction.MATERIALIZE or not plan.spans:
            return Materialized(plan, 0, 0, {}, "nothing to load")
        if plan.namespace is not None:  # state another tenant shares: its keys, whatever the caller passed
            root = self.keyer.root(plan.namespace, request.model, request.tokenizer, request.layout)
            keys = self.keyer.keys(root, request.token_ids, request.extra_inputs)
        keys = self.keys(request) if keys is None else keys
        page = request.layout.page_size
        paged, ckpt = group_masks(request.layout.groups)
        limit = timeout_ms if timeout_ms is not None else self.config.load_timeout_ms
        states: dict[tuple[int, int], StoredState] = {}
        last = plan.tokens_reused // page
        for span in plan.spans:
            jobs = []
            for b in range(span.start // page, span.end // page):
                need = paged | (ckpt if b == last - 1 else 0)
                jobs.extend((b, g) for g in range(len(request.layout.groups)) if need & (1 << g))
            future = self._loader.submit(self._load_many, keys, jobs, span.tier, span.transport)
            try:
                got, bad = future.result(timeout=limit / 1e3)
            except concurrent.futures.TimeoutError:
                self.health.breaker(span.tier).failure(f"load timed out after {limit:g} ms", severe=True)
                self.health.breaker(f"transport:{span.transport}").failure(f"load from {span.tier} timed out")
                first_bad = span.start // page
                return self._partial(plan, states, first_bad, page, f"tier {span.tier} timed out")
            except Exception as exc:
                self.health.breaker(span.tier).failure(repr(exc))
                return self._partial(plan, states, span.start // page, page, f"tier {span.tier} failed: {exc!r}")
            states.update(got)
            if self.config.promote_on_hit and self.tier_order and span.tier != self.tier_order[0]:
                promote = [_Promotion(request, st.descriptor, st.payload, span.tier) for st in got.values()]
                self.writer.submit([WriteItem(len(p.payload), p) for p in promote])  # best effort: may be refused
            if bad is not None:
                b, why = bad
                return self._partial(plan, states, b, page, why)
            self.health.breaker(span.tier).success()
            self.health.breaker(f"transport:{span.transport}").success()
        return Materialized(plan, last, last * page, states)

    async def amaterialize(self, plan: Plan, request: Request, **kwargs: Any) -> Materialized:
        """`materialize` for asyncio callers."""
        return await asyncio.to_thread(self.materialize, plan, request, **kwargs)

    def _load_many(self, keys: Sequence[bytes], jobs: list[tuple[int, int]], tier: str,
                   transport: str) -> tuple[dict[tuple[int, int], StoredState], tuple[int, str] | None]:  # fmt: skip
        got: dict[tuple[int, int], StoredState] = {}
        for b, g in jobs:
            st = self.load(keys[b], g, tier=tier, transport=transport)
            if st is None:
                return got, (b, f"block {b} group {g} missing or corrupt in {tier}")
            got[(b, g)] = st
        return got, None

    def _partial(self, plan: Plan, states: dict[tuple[int, int], StoredState], first_bad: int, page: int,
                 reason: str) -> Materialized:  # fmt: skip
        keep = {k: v for k, v in states.items() if k[0] < first_bad}
        log.warning("materialize stopped early; recompute from the last good block", request_id=plan.request_id,
                    tenant=plan.tenant, good_tokens=first_bad * page, reason=reason)  # fmt: skip
        return Materialized(plan, first_bad, first_bad * page, keep, reason)

    def report_load_result(self, plan: Plan, report: LoadReport, *, keys: Sequence[bytes] | None = None,
                           group: int = 0) -> int:  # fmt: skip
        """A connector tells how restoring a plan went; returns the token to recompute from.

        Success closes the breakers of the tiers read; a failure counts against the tier's breaker (a timeout or
        corrupt data opens it at once) and corrupt data is quarantined so no later plan uses it.
        """
        tiers = {s.tier for s in plan.spans}
        if report.ok:
            for t in tiers:
                self.health.breaker(t).success()
            return plan.tokens_reused
        tier = report.tier or (next(iter(tiers)) if len(tiers) == 1 else "")
        if tier:
            self.health.breaker(tier).failure(report.reason or "load failed", severe=report.corrupt or report.timeout)
        block = report.failed_block if report.failed_block is not None else 0
        if report.corrupt and keys is not None and block < len(keys) and tier:
            self.quarantine(keys[block], group, tier, reason=report.reason or "reported corrupt by connector")
        log.warning("load failed; recompute from the last good block", request_id=plan.request_id,
                    tenant=plan.tenant, tier=tier, block=block, reason=report.reason)  # fmt: skip
        return min(plan.tokens_reused, block * self.keyer.page_size)

    # ------------------------------------------------------------------------------------------ prefetch

    def _schedule_prefetch(self, request: Request, keys: Sequence[bytes], plan: Plan) -> None:
        page = request.layout.page_size
        block_bytes = self.cost.bytes_per_token * page
        now = time.monotonic()
        if len(self._recent_prefetch) > 10_000:
            self._recent_prefetch = {k: v for k, v in self._recent_prefetch.items() if v > now}
        for span in plan.prefetch:
            first = (keys[span.start // page], span.end, span.target_tier)
            if self._recent_prefetch.get(first, 0.0) > now:
                continue  # asked for moments ago (the same session's next turn, a shared prefix): deduplicated
            self._recent_prefetch[first] = now + self.config.prefetch_deadline_s
            slots = [slot_of(keys[b], g) for b in range(span.start // page, span.end // page)
                     for g in range(len(request.layout.groups))]  # fmt: skip
            self.prefetcher.submit(request.tenant, slots, span.tier, span.target_tier, block_bytes,
                                   self.config.prefetch_deadline_s)  # fmt: skip

    def _move(self, slot: bytes, source: str, target: str) -> bool:
        """Copy one slot from `source` to `target` (the index gains the target location); False on a miss."""
        src, dst = self.tiers.get(source), self.tiers.get(target)
        if src is None or dst is None or not self.health.allow(source):
            return False
        got = src.get(slot)
        if got is None:
            return False
        if not verify_checksum(got.payload, got.descriptor.checksum):
            self.quarantine(slot[:-1], slot[-1], source, reason="checksum mismatch during prefetch")
            return False
        desc = attrs.evolve(got.descriptor, placement=Placement(target, self.node, self.epoch))
        return self._store(desc, got.payload, 0.0)  # verified just above

    def close(self) -> None:
        """Stop the workers, then release tiers, transports and the control-plane lease."""
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._observed.put_nowait(None)
        self._observer_thread.join(2.0)
        self._watchdog.shutdown(wait=False, cancel_futures=True)
        self.prefetcher.close()
        self.writer.close()
        self._loader.shutdown(wait=False, cancel_futures=True)
        for store in self.tiers.values():
            store.close()
        for t in self.transports.values():
            t.close()
        with contextlib.suppress(Exception):
            if self.lease is not None:
                self.control.revoke(self.lease.lease_id)
            self.control.close()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
