"""What a policy evaluation answers: the `Verdict`, with the deciding rules, messages, warnings and errors."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Placement", "Verdict"]


class Placement(NamedTuple):
    """The outcome of `place` rules: tier, time to live and eviction priority (None = not decided)."""

    tier: str | None = None
    ttl_s: float | None = None
    priority: float | None = None


class Verdict(NamedTuple):
    """The answer of one policy evaluation (an immutable tuple: cheap to build on the hot path).

    `allowed` is False when an enforced `deny` fired (admit, reuse) or when no `share` grant allowed access.
    `max_tokens` caps reuse (None: no cap). For `route` rules, `allowed` False excludes the node and
    `weight` multiplies its predicted TTFT (None: unweighted). `deciding` names the rules that determined the
    outcome; `fired` every rule that fired, whatever its effect. `errors` lists `rule: message` for rules whose
    evaluation failed (each handled by its `failure` setting, which is how it may appear in `deciding`).
    """

    kind: str
    policy: str
    revision: str
    allowed: bool = True
    max_tokens: int | None = None
    deciding: tuple[str, ...] = ()
    fired: tuple[str, ...] = ()
    messages: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    audits: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    placement: Placement | None = None
    weight: float | None = None

    def to_log(self) -> dict[str, object]:
        """A compact JSON-compatible record for decision logs (empty fields left out)."""
        out: dict[str, object] = {"kind": self.kind, "policy": self.policy, "revision": self.revision,
                                  "allowed": self.allowed}  # fmt: skip
        for name in ("max_tokens", "weight", "deciding", "fired", "messages", "warnings", "audits", "errors"):
            value = getattr(self, name)
            if value:
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.placement is not None:
            out["placement"] = {"tier": self.placement.tier, "ttl_s": self.placement.ttl_s,
                                "priority": self.placement.priority}  # fmt: skip
        return out
