"""Policies in production, for one kernel: the serving revision, its reloads, a fleet rollout and a shadow.

`PolicyOps` owns the kernel's `LivePolicies` (the revision every operation reads once), the opt-in watcher on
the policy directory, the `Rollout` that applies bundles a fleet publishes (through the control plane's policy
channel, or a shared directory), and the shadow revision evaluated beside the live one. The kernel facade
delegates its policy methods here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nexuskv.contracts.config import KernelConfig
from nexuskv.errors import ConfigError
from nexuskv.logs import get_logger
from nexuskv.ops.decision_log import DecisionLog
from nexuskv.ops.replay import Replayer
from nexuskv.ops.shadow import Shadow, ShadowReport
from nexuskv.planning.planner import Planner
from nexuskv.plugins.interfaces import ControlPlane
from nexuskv.policy.bundle import PolicyBundle
from nexuskv.policy.loader import Policies
from nexuskv.policy.serving.live import LivePolicies, ReloadResult
from nexuskv.policy.serving.rollout import PolicyChannel, Rollout

__all__ = ["PolicyOps"]

log = get_logger("nexuskv.policyops")  # the component name operators filter on: stable


class PolicyOps:
    """The policy lifecycle of one kernel (see the module docstring)."""

    def __init__(self, config: KernelConfig, functions: Mapping[str, Any]) -> None:
        """Load the policy directory (a `PolicyError` when it does not load) and start watching it if asked."""
        self.config = config
        self.functions = dict(functions)
        self.live: LivePolicies | None = None
        self.rollout: Rollout | None = None
        self._planner: Planner | None = None
        self._decisions: DecisionLog | None = None
        if config.policy_rollout and config.policy_watch:
            raise ConfigError("policy_watch and policy_rollout exclude each other: a node that follows the fleet's "
                              "rollout serves the published revision, not its local directory's")  # fmt: skip
        if config.policies or config.policy_rollout:
            self.live = LivePolicies(config.policies, self.functions)
            if config.policy_watch:
                self.live.watch()

    def start(self, node: str, planner: Planner, decisions: DecisionLog, control: ControlPlane) -> None:
        """Once the kernel's parts exist: shadow the configured candidate, and follow the fleet's rollout."""
        self._planner, self._decisions = planner, decisions
        if self.config.policy_shadow:
            self.shadow(self.config.policy_shadow)
        if self.config.policy_rollout and self.live is not None:
            channel = self._channel(self.config.policy_rollout, control)
            self.rollout = Rollout(self.live, channel, node, self.config.policy_rollout_interval_s)
            self.rollout.start()

    @staticmethod
    def _channel(where: str, control: ControlPlane) -> PolicyChannel:
        """The channel a fleet rollout comes through: the control plane's (etcd), or a shared directory."""
        from nexuskv.policy.serving.rollout import DirectoryChannel

        if where != "control-plane":
            return DirectoryChannel(where)
        make = getattr(control, "policy_channel", None)
        if make is None:
            raise ConfigError(f'policy_rollout = "control-plane": the control plane {control!r} has no policy '
                              "channel (use the etcd plugin, or a shared directory path)")  # fmt: skip
        channel: PolicyChannel = make()
        return channel

    @property
    def current(self) -> Policies | None:
        """The serving policies."""
        return self.live.current if self.live is not None else None

    @property
    def revision(self) -> str:
        """The serving revision ("" when none serves)."""
        return self.live.revision if self.live is not None else ""

    def reload(self) -> ReloadResult:
        """Load the policy directory again (see `Kernel.reload_policies`)."""
        if self.live is None:
            raise ValueError("no policy directory to reload (the kernel config has no `policies`)")
        if self.config.policy_rollout:
            raise ValueError("this node follows the fleet's policy rollout: publish a bundle (nexuskv policy publish) "
                             "instead of reloading its local directory")  # fmt: skip
        return self.live.reload()

    def shadow(self, candidate: str | os.PathLike[str] | PolicyBundle | Policies | None) -> str | None:
        """Shadow `candidate` (or stop shadowing); see `Kernel.shadow_policies`."""
        assert self._decisions is not None and self._planner is not None, "start() first"
        old = self._decisions.shadow
        if candidate is None:
            self._decisions.shadow = None
        else:
            if isinstance(candidate, PolicyBundle):
                candidate = Policies.from_bundle(candidate, self.functions)
            elif not isinstance(candidate, Policies):
                candidate = Policies.load(candidate, self.functions)
            self._decisions.shadow = Shadow(candidate, Replayer.of(self._planner))
            log.info("shadowing a candidate policy revision", candidate=candidate.revision, live=self.revision)
        if old is not None:
            old.close()
        return candidate.revision if candidate is not None else None

    def shadow_report(self, wait_s: float = 0.0) -> ShadowReport | None:
        """The shadow's counts (None when none runs); `wait_s`: first wait for the plans made so far."""
        shadow = self._decisions.shadow if self._decisions is not None else None
        if shadow is None:
            return None
        if wait_s:
            shadow.drain(wait_s)
        return shadow.report()

    def close(self) -> None:
        """Stop the rollout and the watcher (the shadow stops with the decision log)."""
        if self.rollout is not None:
            self.rollout.close()
        if self.live is not None:
            self.live.close()
