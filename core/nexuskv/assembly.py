"""The kernel's parts: built from a config, wired together, closed in order; what `Kernel` is made of.

`KernelParts.__init__` builds every part once: the keyer and index from plugins, the membership (lease, epoch),
the cost model and breakers, the tier hierarchy, the policy operations, the planner, the read, write and load
paths, the prefetcher, the decision log, the router and the metrics. Each part owns its own state; this class
exposes it (tiers, epoch, writer, congestion figures) and closes the parts in reverse order. The operations a
scheduler calls are `Kernel`'s (`nexuskv.kernel`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any, Self

from nexuskv.cel import plugin_functions
from nexuskv.cluster.membership import Membership
from nexuskv.contracts import CostProfile
from nexuskv.contracts.config import KernelConfig, plugin_env
from nexuskv.logs import configure_logging, get_logger
from nexuskv.ops.decision_log import DecisionLog
from nexuskv.ops.metrics import Metrics
from nexuskv.ops.policy_ops import PolicyOps
from nexuskv.ops.replay import Replayer
from nexuskv.paths.load import LoadPath
from nexuskv.paths.read import ReadPath
from nexuskv.paths.route import Router
from nexuskv.paths.write import WritePath
from nexuskv.planning.breakers import Health
from nexuskv.planning.cost import CostModel, default_profile, load_profile
from nexuskv.planning.links import link_estimates
from nexuskv.planning.planner import Planner
from nexuskv.planning.seal import PlanSeal
from nexuskv.plugins.interfaces import ControlPlane, Lease, TierStore, Transport
from nexuskv.plugins.manager import PluginManager
from nexuskv.policy.loader import Policies
from nexuskv.state.identity import BlockKeyer, load_secret
from nexuskv.state.index import Matcher
from nexuskv.state.keys import Keys
from nexuskv.storage.handoff import Handoffs
from nexuskv.storage.hierarchy import Hierarchy
from nexuskv.storage.prefetch import Prefetcher
from nexuskv.storage.state_seal import StateSeal
from nexuskv.storage.write_queue import Writer

__all__ = ["KernelParts"]

log = get_logger("nexuskv.kernel")  # the component name operators filter on: stable


class KernelParts:
    """Every part of one kernel, built and wired; `Kernel` adds the operations. Safe to read from any thread."""

    def __init__(
        self,
        config: KernelConfig | None = None,
        *,
        plugins: PluginManager | None = None,
        secret: bytes | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """Build every part from `config`.

        `clock` is the monotonic clock (seconds) the kernel's decision state ages on: link estimates (their
        `max_age_s`) and circuit breakers (their cooldown). Default `time.monotonic`; a simulator passes its
        simulated time, so one trace gives the same decisions on any host under any load.
        """
        configure_logging()
        self.clock = clock = clock or time.monotonic
        cfg = self.config = config or KernelConfig()
        self.plugins = plugins or PluginManager(plugin_env(cfg))
        self.node = cfg.node
        secret = secret or load_secret(cfg.secret, cfg.secret_file)
        self.keyer: BlockKeyer = self.plugins.keyer(secret, cfg.page_size, cfg.keyer)
        self.plan_seal = PlanSeal(secret)
        self.state_seal = StateSeal(secret)
        self.index: Matcher = self.plugins.matcher(cfg.matcher)
        profile = load_profile(cfg.profile) if cfg.profile else default_profile()
        self.links = link_estimates(cfg.links, profile, clock=clock)
        self.membership = Membership(self.plugins.control_plane(cfg.control_plane), self.node, cfg.lease_ttl_s,
                                     status=self._status)  # fmt: skip
        try:
            self._assemble(cfg, profile, secret)
        except BaseException:
            self._abandon()  # a kernel that failed to start leaves no heartbeat renewing its lease, no threads
            raise
        self.warm_up()
        log.info("kernel started", node=self.node, epoch=self.epoch, tiers=list(self.tier_order),
                 policies=self.policies.tenants() if self.policies else [], policy_revision=self.policy_revision,
                 plugin_problems=len(self.plugins.problems))  # fmt: skip

    def warm_up(self) -> float:
        """Pay once, here, what the first plan would pay on its hot path; seconds spent (the constructor calls it).

        A synthetic request runs every stage of a plan (keys, match, policy, decision, seal) and nothing is kept.
        A failure is logged, never raised: plans then pay their own first call, as before.
        """
        t0 = time.perf_counter()
        try:
            self.reads.warm_up()
        except Exception as exc:
            log.warning("warm-up failed; the first plan pays its own first call", error=f"{type(exc).__name__}: {exc}")
        return time.perf_counter() - t0

    def _assemble(self, cfg: KernelConfig, profile: CostProfile, secret: bytes) -> None:
        """Build the parts after the membership (the tiers, policies, paths), then bind a cluster-wide index."""
        self.cost = CostModel(profile, links=self.links)
        self.health = Health(cfg.breaker_threshold, cfg.breaker_cooldown_s, clock=self.clock)
        self.hierarchy = Hierarchy(cfg, (self.plugins.tier_stores(), self.plugins.transports()), self.index,
                                   self.cost, self.health, self.membership, self.state_seal)  # fmt: skip
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
        self.router = Router(self.reads, self.cost, self.membership, cfg)
        self.handoffs = Handoffs(secret, self.node, self.index, lambda: self.membership.epoch,
                                 lambda: self.hierarchy.addresses, self.hierarchy.remote,
                                 ttl_s=cfg.handoff_ttl_s, peer=self._published_peer)  # fmt: skip
        self.hierarchy.directory = self.handoffs.address
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

    def _published_peer(self, node: str, transport: str) -> tuple[str, int] | None:
        """Where peer `node` serves its tiers on `transport` and its live epoch, from the control plane's view."""
        address = ((self.membership.peer_status(node) or {}).get("addresses") or {}).get(transport)
        view = getattr(self.membership.plane, "view", None)
        try:
            epoch = view.members().get(node) if view is not None else None
        except Exception:  # the control plane's view is away: no grant for another node's state
            return None
        return (address, epoch) if isinstance(address, str) and isinstance(epoch, int) else None

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

    # ------------------------------------------------------------------------------------------ the parts' state

    @property
    def policies(self) -> Policies | None:
        """The policies serving now (None without policies, or while a rollout node waits for its first bundle)."""
        return self.policy_ops.current

    @property
    def policy_revision(self) -> str:
        """The serving policy revision ("" when none serves): what plans name and what rollouts report."""
        return self.policy_ops.revision

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

