"""The kernel facade a scheduler embeds: every operation, each delegated to the part that owns it.

`Kernel.from_config(path)` builds one from a TOML file (the parts are built by `nexuskv.assembly`). On the hot
path, `plan(request)` returns a `Plan` within the deadline whatever the plugins do (`paths/read.py`); after
prefill, `commit(request, payloads)` hands state to the bounded writer (`paths/write.py`); `materialize(plan)`
loads planned state with checksums and timeouts and `report_load_result` takes a connector's word on a load
(`paths/load.py`); `route` picks a node (`paths/route.py`). The tiers, their transports and the index across them
are `storage/hierarchy.py`; keys and sessions `state/keys.py`; the lease and epoch `cluster/membership.py`.
This class holds no state of its own beyond the parts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

from nexuskv.assembly import KernelParts
from nexuskv.contracts import Plan, Request, StateDescriptor, TensorSpec
from nexuskv.contracts.config import KernelConfig
from nexuskv.errors import ConfigError
from nexuskv.ops.shadow import ShadowReport
from nexuskv.paths.load import LoadReport, Materialized
from nexuskv.paths.route import NodeState, RouteDecision
from nexuskv.paths.write import CommitResult
from nexuskv.plugins.interfaces import StoredState
from nexuskv.policy.bundle import PolicyBundle
from nexuskv.policy.loader import Policies
from nexuskv.policy.serving.live import ReloadResult
from nexuskv.state.identity import KeyChain
from nexuskv.state.index import Match
from nexuskv.storage.handoff import HandoffResult

__all__ = ["CommitResult", "Kernel", "KernelConfig", "LoadReport", "Materialized"]


class Kernel(KernelParts):
    """One embedded NexusKV kernel: build it once, call it on every request, from any thread.

    `Kernel(config, plugins=..., secret=..., clock=...)` builds the parts (`nexuskv.assembly`); the methods below
    are what a scheduler calls, each delegating to the part that owns the work.
    """

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
              keys: Sequence[bytes] | None = None, all_options: bool = False) -> RouteDecision:  # fmt: skip
        """Which of `nodes` should run `request`, with each node's predicted TTFT and the reasons.

        The prediction is the node's queue plus the plan that node would make from its own tiers and its peers';
        the tenant's `route` rules exclude or weight nodes. The options are the nodes that could win (the
        chosen one, ties, the next best); `all_options` prices every node into one (route rules judge each).

        Deterministic; any failure inside fails open to the least-loaded node (`RouteDecision.fail_open`). See
        `nexuskv.paths.route`.
        """
        return self.router.route(request, nodes, deadline_ms=deadline_ms, keys=keys, all_options=all_options)

    async def aroute(self, request: Request, nodes: Sequence[NodeState], **kwargs: Any) -> RouteDecision:
        """`route` for asyncio callers (CPU-bound and bounded by the deadline, so it runs inline)."""
        return self.router.route(request, nodes, **kwargs)

    # ------------------------------------------------------------------------------------------ P/D handoffs

    def handoff(self, request: Request, *, keys: Sequence[bytes] | None = None, blocks: int | None = None,
                holder: str | None = None) -> dict[str, Any] | None:  # fmt: skip
        """A sealed grant saying where `holder` (this node by default) holds the request's first blocks, for a peer.

        A prefill node returns it to the decode node (through a proxy); it names the holder, its epoch, its peer
        address and tiers, and carries no key. A router whose index follows the fleet (a cluster index) grants
        the node it routed to what another node holds (`holder=`, the node of the chosen option's first span),
        so that node needs no fleet view of its own. None when the holder holds none of the request (at most
        `blocks`), has published no address, or this node serves no peer transport. See
        `nexuskv.storage.handoff`.
        """
        return self.handoffs.issue(request, self.keys(request) if keys is None else keys, blocks=blocks,
                                   holder=holder)  # fmt: skip

    def accept_handoff(self, request: Request, grant: Any, *, keys: Sequence[bytes] | None = None) -> HandoffResult:
        """Take a peer's grant for `request`: checked against this request's own keys, never trusted.

        When its MAC checks (same deployment, same tenant, model and prompt, unexpired), the producer's blocks are
        indexed as the producer's for the grant's lifetime, and the next `plan` prices fetching them over the
        measured link against recomputing. Anything else is refused with the reason (`HandoffResult.reason`).
        """
        return self.handoffs.accept(request, grant, self.keys(request) if keys is None else keys)

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
                           group: int = 0, request: Request | None = None) -> int:  # fmt: skip
        """A connector tells how restoring a plan went; returns the token to recompute from.

        Checked, not trusted (`LoadPath.report_load_result`): pass `request` to have it authorised as `materialize`
        is; a block reported corrupt is quarantined only when the kernel's own checks on it fail.
        """
        return self.loads.report_load_result(plan, report, keys=keys, group=group, request=request)

    def load(self, key: bytes, group: int = 0, tier: str | None = None, transport: str = "local") -> StoredState | None:
        """Read a block's payload, checksum verified; a corrupt payload is quarantined and reported as a miss."""
        return self.hierarchy.load(key, group, tier, transport)

    def quarantine(self, key: bytes, group: int, tier: str, reason: str) -> None:
        """Drop a bad payload from its tier and the index, and log why."""
        self.hierarchy.quarantine(key, group, tier, reason)
