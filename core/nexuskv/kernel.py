"""The kernel facade a scheduler embeds: it wires the kernel's parts together and delegates to them.

`Kernel.from_config(path)` builds one from a TOML file. On the hot path, `plan(request)` returns a `Plan` within
the deadline whatever the plugins do (`readpath`); after prefill, `commit(request, payloads)` hands state to the
bounded writer (`writepath`); `materialize(plan)` loads planned state with checksums and timeouts and
`report_load_result` takes a connector's word on a load (`loadpath`). The tiers, their transports and the index
across them are the `hierarchy`; keys and sessions are `keying`; the lease and epoch are `control`.
Every part owns its own state; this class holds no state of its own beyond the parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from nexuskv.config import KernelConfig, plugin_env
from nexuskv.contracts import CostProfile, Plan, Request, StateDescriptor, TensorSpec
from nexuskv.control import Membership
from nexuskv.cost import CostModel, default_profile, load_profile
from nexuskv.decisions import DecisionLog
from nexuskv.errors import ConfigError
from nexuskv.health import Health
from nexuskv.hierarchy import Hierarchy
from nexuskv.identity import BlockKeyer, KeyChain, PlanSeal, load_secret
from nexuskv.index import Match, Matcher
from nexuskv.interfaces import ControlPlane, Lease, StoredState, TierStore, Transport
from nexuskv.keying import Keys
from nexuskv.links import link_estimates
from nexuskv.loadpath import LoadPath, LoadReport, Materialized
from nexuskv.logs import configure_logging, get_logger
from nexuskv.metrics import Metrics
from nexuskv.planner import Planner
from nexuskv.plugins import PluginManager
from nexuskv.policy.bundle import PolicyBundle
from nexuskv.policy.live import ReloadResult
from nexuskv.policy.loader import Policies
from nexuskv.policy.types import plugin_functions
from nexuskv.policyops import PolicyOps
from nexuskv.prefetch import Prefetcher
from nexuskv.readpath import ReadPath
from nexuskv.replay import Replayer
from nexuskv.routing import NodeState, RouteDecision, Router
from nexuskv.shadow import ShadowReport
from nexuskv.writepath import CommitResult, WritePath
from nexuskv.writer import Writer

__all__ = ["CommitResult", "Kernel", "KernelConfig", "LoadReport", "Materialized"]

log = get_logger(__name__)


class Kernel:
    """One embedded NexusKV kernel: build it once, call it on every request, from any thread."""

    def __init__(
        self,
        config: KernelConfig | None = None,
        *,
        plugins: PluginManager | None = None,
        secret: bytes | None = None,
    ) -> None:
        configure_logging()
        cfg = self.config = config or KernelConfig()
        self.plugins = plugins or PluginManager(plugin_env(cfg))
        self.node = cfg.node
        secret = secret or load_secret(cfg.secret, cfg.secret_file)
        self.keyer: BlockKeyer = self.plugins.keyer(secret, cfg.page_size, cfg.keyer)
        self.plan_seal = PlanSeal(secret)
        self.index: Matcher = self.plugins.matcher(cfg.matcher)
        profile = load_profile(cfg.profile) if cfg.profile else default_profile()
        self.links = link_estimates(cfg.links, profile)
        self.membership = Membership(self.plugins.control_plane(cfg.control_plane), self.node, cfg.lease_ttl_s,
                                     status=self._status)  # fmt: skip
        try:
            self._assemble(cfg, profile)
        except BaseException:
            self._abandon()  # a kernel that failed to start leaves no heartbeat renewing its lease, no threads
            raise
        log.info("kernel started", node=self.node, epoch=self.epoch, tiers=list(self.tier_order),
                 policies=self.policies.tenants() if self.policies else [], policy_revision=self.policy_revision,
                 plugin_problems=len(self.plugins.problems))  # fmt: skip

    def _assemble(self, cfg: KernelConfig, profile: CostProfile) -> None:
        """Build the parts after the membership (the tiers, policies, paths), then bind a cluster-wide index."""
        self.cost = CostModel(profile, links=self.links)
        self.health = Health(cfg.breaker_threshold, cfg.breaker_cooldown_s)
        self.hierarchy = Hierarchy(cfg, (self.plugins.tier_stores(), self.plugins.transports()), self.index,
                                   self.cost, self.health, self.membership)  # fmt: skip
        wanted = cfg.policies or cfg.policy_rollout or cfg.policy_shadow
        decls, problems = plugin_functions(self.plugins.cel_functions()) if wanted else ({}, [])
        for problem in problems:
            log.error("plugin CEL function unusable", problem=problem)
        self.policy_ops = PolicyOps(cfg, decls)  # a broken policy directory at start is a PolicyError
        self.live = self.policy_ops.live
        self.planner = Planner(self.cost, self.health, self.tier_order, transport=cfg.transports[0],
                               remote_transport=self.hierarchy.remote,
                               shared_tiers=self.hierarchy.shared_tiers)  # fmt: skip
        self.keyring = Keys(self.keyer, cfg.session_cache)
        self.writes = WritePath(cfg, self.keyring, self.hierarchy, self.health, self.live)
        self.loads = LoadPath(cfg, self.keyring, self.hierarchy, self.health, self.writes, self.plan_seal,
                              self.live)
        self.prefetcher = Prefetcher(self.writes.prefetch_move, max_bytes=cfg.prefetch_max_bytes,
                                     max_tasks=cfg.prefetch_max_tasks, tenant_share=cfg.prefetch_tenant_share)
        self.decision_log = DecisionLog(self.plugins, file=cfg.decision_file, inputs_for=cfg.decision_inputs,
                                        context=Replayer.of(self.planner), node=self.node,
                                        sample=cfg.decision_log_sample, level=cfg.decision_log_level,
                                        recent=cfg.decision_log_recent)  # fmt: skip
        self.reads = ReadPath(cfg, self.keyring, self.index, self.planner, self.live, self.membership,
                              self.health, self.cost, self.prefetcher, self.decision_log, self.plan_seal)  # fmt: skip
        self.router = Router(self.reads, self.cost, self.membership, cfg.deadline_ms)
        self.policy_ops.start(self.node, self.planner, self.decision_log, self.control)
        self.metrics = Metrics.start(self)  # kernel.metrics: the registry, status(), the HTTP port when configured
        bind = getattr(self.index, "bind", None)
        if callable(bind):  # a cluster-wide index follows this kernel's membership and publishes its holdings
            bind(self)
        if self.hierarchy.addresses:
            self.membership.publish_now()  # peers learn where to fetch from without waiting for a heartbeat
            loopback = {t: a for t, a in self.hierarchy.addresses.items() if a.startswith(("127.", "localhost"))}
            if loopback and getattr(self.control, "view", None) is not None:
                log.warning("serving tiers on a loopback address: peers on other machines cannot reach it "
                            "(set transport_options.<name>.host or advertise)", addresses=loopback)  # fmt: skip

    def _abandon(self) -> None:
        """Close what a failed start had built, in reverse (errors ignored: the start's own error is raised)."""
        for part in ("metrics", "policy_ops", "reads", "decision_log", "prefetcher", "loads", "writes", "hierarchy"):
            obj = getattr(self, part, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        close_index = getattr(self.index, "close", None)
        if callable(close_index):
            with contextlib.suppress(Exception):
                close_index()
        self.membership.close()

    def _status(self) -> dict[str, Any]:
        """What this node publishes to the cluster view each heartbeat.

        Link estimates (`links`), where peers reach it (`addresses`), its backpressure (the writer's queue and
        refusals, prefetch bytes in flight), the paths it has stopped using (`breakers` not closed) and the policy
        revision it serves (`policy_revision`, with policies).
        """
        out: dict[str, Any] = {}
        if getattr(self, "links", None) is not None:
            out["links"] = dict(self.links.snapshot())  # type: ignore[union-attr]
        hierarchy = getattr(self, "hierarchy", None)  # not built yet during the first join
        if hierarchy is not None and hierarchy.addresses:
            out["addresses"] = dict(hierarchy.addresses)
        if getattr(self, "reads", None) is not None:  # every part is built
            w = self.writes.writer
            items, nbytes = w.queued()
            inflight = sum(self.prefetcher.inflight_bytes().values())
            fill = round(max(items / w.max_items, nbytes / w.max_bytes), 4)
            out["backpressure"] = {"writer_items": items, "writer_bytes": nbytes, "writer_fill": fill,
                                   "writer_refused": w.stats["refused"], "prefetch_inflight_bytes": inflight}
            out["breakers"] = {n: b["state"] for n, b in self.health.snapshot().items() if b["state"] != "closed"}
            if self.policy_ops.live is not None:  # the cluster view shows which policy revision each node serves
                out["policy_revision"] = self.policy_revision
        return out

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **kwargs: Any) -> Kernel:
        """Build a kernel from a TOML config file (a `ConfigError` at start names the file)."""
        config = KernelConfig.from_toml(path)
        try:
            return cls(config, **kwargs)
        except ConfigError as exc:
            if str(exc).startswith(f"{path}:"):
                raise
            raise ConfigError(f"{path}: {exc}") from None

    # ------------------------------------------------------------------------------------------ the parts' state

    @property
    def policies(self) -> Policies | None:
        """The policies serving now (None without policies, or while a rollout node waits for its first bundle)."""
        return self.policy_ops.current

    @property
    def policy_revision(self) -> str:
        """The serving policy revision ("" when none serves): what plans name and what rollouts report."""
        return self.policy_ops.revision

    def reload_policies(self) -> ReloadResult:
        """Load the policy directory again and swap it in atomically, or refuse it whole and keep serving.

        The new revision is parsed, type-checked and compiled on the calling thread (not on any plan's); plans
        already running finish on the revision they started with. Problems are logged with file, rule, line and
        column and returned in the result. Raises `ValueError` when the config names no policy directory, or
        when this node follows a fleet rollout (publish a bundle instead).
        """
        return self.policy_ops.reload()

    def shadow_policies(self, candidate: str | os.PathLike[str] | PolicyBundle | Policies | None) -> str | None:
        """Evaluate a candidate revision beside the live one on every plan from now on, without changing any plan.

        `candidate` is a policy directory, a bundle or compiled `Policies` (a `PolicyError` when it does not
        load: nothing changes then); `None` stops shadowing. Each plan's inputs are decided again under the live
        revision and the candidate on a thread of its own; `shadow_report()` counts the disagreements (action,
        tokens reused, tier, deciding rules) per rule, and a sample of them is logged. Returns the candidate's
        revision (None when stopped).
        """
        return self.policy_ops.shadow(candidate)

    def shadow_report(self, wait_s: float = 0.0) -> ShadowReport | None:
        """Disagreements of the shadowed revision so far (None when none is shadowed).

        With `wait_s`, first wait up to that long for the plans made so far to be compared.
        """
        return self.policy_ops.shadow_report(wait_s)

    @property
    def tiers(self) -> dict[str, TierStore]:
        """The tier stores by name."""
        return self.hierarchy.tiers

    @property
    def transports(self) -> dict[str, Transport]:
        """The transports by name."""
        return self.hierarchy.transports

    @property
    def tier_order(self) -> tuple[str, ...]:
        """Tiers with a cost in the profile, fastest first."""
        return self.hierarchy.tier_order

    @property
    def control(self) -> ControlPlane:
        """The control plane plugin."""
        return self.membership.plane

    @property
    def epoch(self) -> int:
        """This node's current epoch (its fencing token)."""
        return self.membership.epoch

    @property
    def lease(self) -> Lease | None:
        """This node's lease in the control plane (None until one was granted)."""
        return self.membership.lease

    @property
    def writer(self) -> Writer:
        """The bounded asynchronous writer."""
        return self.writes.writer

    @property
    def decisions(self) -> int:
        """How many plans were made (fallbacks included)."""
        return self.decision_log.decisions

    @property
    def observer_drops(self) -> int:
        """Decision records dropped because plugin observers fell behind."""
        return self.decision_log.observer_drops

    @property
    def bandwidth_scale(self) -> dict[str, float]:
        """Per-tier bandwidth factors plans use (congestion the caller knows of; 1.0 when absent)."""
        return self.reads.bandwidth_scale

    @bandwidth_scale.setter
    def bandwidth_scale(self, value: Mapping[str, float]) -> None:
        self.reads.bandwidth_scale = dict(value)

    @property
    def link_load(self) -> dict[str, float]:
        """Bytes in flight per tier the caller reports; plans add the prefetcher's own."""
        return self.reads.link_load

    @link_load.setter
    def link_load(self, value: Mapping[str, float]) -> None:
        self.reads.link_load = dict(value)

    def control_ok(self) -> bool:
        """True while the lease is known to be alive (last heartbeat within the lease TTL, no error since)."""
        return self.membership.ok()

    # ------------------------------------------------------------------------------------------ keys

    def keys(self, request: Request) -> list[bytes]:
        """Block keys of every full block of the request (its layout's page size must be the kernel's)."""
        return self.keyring.keys(request)

    def keys_for(self, request: Request, session: str | None = None) -> list[bytes]:
        """Block keys of a request; with `session`, continue that session's cached chain (multi-turn chat)."""
        return self.keyring.keys_for(request, session)

    def session(self, request: Request) -> KeyChain:
        """A key chain for a session that will grow by appending tokens (multi-turn chat, agent loops)."""
        return self.keyring.session(request)

    # ------------------------------------------------------------------------------------------ read path

    def match(self, request: Request, keys: Sequence[bytes] | None = None) -> Match:
        """What of the request is held, where: per-block holdings and restore points by kind, tier and node."""
        return self.reads.match(request, keys)

    def plan(self, request: Request, *, keys: Sequence[bytes] | None = None, session: str | None = None,
             deadline_ms: float | None = None) -> Plan:  # fmt: skip
        """Decide what of `request` to restore, from where, and what to prefetch; never later than the deadline.

        Any failure on the way (a plugin raising, the deadline passing, the control plane down) gives a
        `recompute` plan whose reasons say why.
        """
        return self.reads.plan(request, keys=keys, session=session, deadline_ms=deadline_ms)

    def seal(self, plan: Plan) -> Plan:
        """`plan` with this deployment's MAC: for plans a connector builds itself (plans from `plan` have one)."""
        return self.plan_seal.seal(plan)

    async def aplan(self, request: Request, **kwargs: Any) -> Plan:
        """`plan` for asyncio callers (it is CPU-bound and bounded by the deadline, so it runs inline)."""
        return self.reads.plan(request, **kwargs)

    def route(self, request: Request, nodes: Sequence[NodeState], *, deadline_ms: float | None = None,
              keys: Sequence[bytes] | None = None) -> RouteDecision:  # fmt: skip
        """Which of `nodes` should run `request`, with each node's predicted TTFT and the reasons.

        The prediction is the node's queue plus the plan that node would make from its own tiers and its peers';
        the tenant's `route` rules exclude or weight nodes.

        Deterministic; any failure inside fails open to the least-loaded node (`RouteDecision.fail_open`). See
        `nexuskv.routing`.
        """
        return self.router.route(request, nodes, deadline_ms=deadline_ms, keys=keys)

    async def aroute(self, request: Request, nodes: Sequence[NodeState], **kwargs: Any) -> RouteDecision:
        """`route` for asyncio callers (CPU-bound and bounded by the deadline, so it runs inline)."""
        return self.router.route(request, nodes, **kwargs)

    # ------------------------------------------------------------------------------------------ write path

    def commit(self, request: Request,
               payloads: Mapping[tuple[int, int], bytes | memoryview] | Sequence[bytes | memoryview], *,
               keys: Sequence[bytes] | None = None,
               tensors: Mapping[tuple[int, int], Sequence[TensorSpec]] | None = None) -> CommitResult:  # fmt: skip
        """Hand produced state to the bounded writer: `payloads[block]` (group 0) or `payloads[(block, group)]`.

        `tensors[(block, group)]` names each payload's raw tensors (recorded in its descriptor). Returns at once;
        what the writer's bounds cannot take is refused (backpressure). See `WritePath.commit`.
        """
        return self.writes.commit(request, payloads, keys=keys, tensors=tensors)

    async def acommit(self, request: Request, payloads: Any, **kwargs: Any) -> CommitResult:
        """`commit` for asyncio callers."""
        return await asyncio.to_thread(self.writes.commit, request, payloads, **kwargs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has stored everything queued, and tiers that write behind (disk) have written it."""
        return self.writes.flush(timeout)

    def describe(self, request: Request, block: int, payload: bytes | memoryview, *, tier: str, group: int = 0,
                 keys: Sequence[bytes] | None = None, **extra: Any) -> StateDescriptor:  # fmt: skip
        """The descriptor of the state covering the request's first `block + 1` blocks (block is 0-based)."""
        return self.writes.describe(request, block, payload, tier=tier, group=group, keys=keys, **extra)

    def put(self, descriptor: StateDescriptor, payload: bytes | memoryview, priority: float = 0.0) -> bool:
        """Store a checksum-verified payload in its descriptor's tier and index it; False when the tier refused it."""
        return self.hierarchy.put(descriptor, payload, priority)

    def default_priority(self, descriptor: StateDescriptor) -> float:
        """Eviction priority when no `place` rule gives one (cost-aware, leaf first; 0 with `eviction = "lru"`)."""
        return self.hierarchy.default_priority(descriptor)

    def reindex(self, tier: str) -> int:
        """Index what a persistent tier holds now (a host-wide tier another process writes to); returns the count."""
        return self.hierarchy.reindex(tier)

    # ------------------------------------------------------------------------------------------ load path

    def materialize(self, plan: Plan, request: Request, *, keys: Sequence[bytes] | None = None,
                    timeout_ms: float | None = None) -> Materialized:  # fmt: skip
        """Load the plan's spans (checksums verified, each tier read bounded by a timeout).

        Stops at the first block that is missing, corrupt (quarantined), or slow (its tier's breaker opens):
        the caller restores blocks [0, blocks) and recomputes from `tokens` on. Never returns wrong state.
        """
        return self.loads.materialize(plan, request, keys=keys, timeout_ms=timeout_ms)

    async def amaterialize(self, plan: Plan, request: Request, **kwargs: Any) -> Materialized:
        """`materialize` for asyncio callers."""
        return await asyncio.to_thread(self.loads.materialize, plan, request, **kwargs)

    def report_load_result(self, plan: Plan, report: LoadReport, *, keys: Sequence[bytes] | None = None,
                           group: int = 0) -> int:  # fmt: skip
        """A connector tells how restoring a plan went; returns the token to recompute from."""
        return self.loads.report_load_result(plan, report, keys=keys, group=group)

    def load(self, key: bytes, group: int = 0, tier: str | None = None, transport: str = "local") -> StoredState | None:
        """Read a block's payload, checksum verified; a corrupt payload is quarantined and reported as a miss."""
        return self.hierarchy.load(key, group, tier, transport)

    def quarantine(self, key: bytes, group: int, tier: str, reason: str) -> None:
        """Drop a bad payload from its tier and the index, and log why."""
        self.hierarchy.quarantine(key, group, tier, reason)

    # ------------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the workers, then release tiers, transports and the control-plane lease."""
        self.metrics.close()
        self.membership.stop()
        self.policy_ops.close()
        self.decision_log.close()
        self.reads.close()
        self.prefetcher.close()
        self.writes.close()
        self.loads.close()
        close_index = getattr(self.index, "close", None)
        if callable(close_index):
            close_index()
        self.hierarchy.close()
        self.membership.close()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
