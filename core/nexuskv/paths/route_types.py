"""What routing takes and gives: a node's report, a priced node, the answer.

`NodeState` (a candidate node as the scheduler reports it), `RouteOption` (one node, priced), `RouteDecision` (the
chosen node and why): frozen contracts; `paths.route` computes them (re-exported there and from `nexuskv`).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

from attrs import define, field

from nexuskv.contracts.schema import doc

__all__ = ["NodeState", "RouteDecision", "RouteOption"]


def _as_count(value: Any) -> Any:
    """Whole numbers from other sources (numpy ints, `3.0` from a metrics scrape) as int; the rest unchanged."""
    if isinstance(value, int):  # bool included: the validator names it
        return value
    try:
        return operator.index(value)
    except TypeError:
        return int(value) if isinstance(value, float) and value.is_integer() else value


def _as_ms(value: Any) -> Any:
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value


def _as_labels(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def _count(_: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"NodeState.{attribute.name} must be an int >= 0, got {value!r}")


def _ms(_: Any, attribute: Any, value: Any) -> None:
    if value is None and attribute.name == "queue_ms":
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"NodeState.{attribute.name} must be a finite number >= 0, got {value!r}")


def _node(_: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"NodeState.node must be a non-empty string, got {value!r}")


def _labels(_: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"NodeState.labels must map strings to strings, got {value!r}")


@define(frozen=True)
class NodeState:
    """A candidate node as the scheduler reports it (its own bookkeeping, or the engine's metrics)."""

    node: str = field(validator=_node, metadata=doc("Node name, as the node publishes itself (`KernelConfig.node`)."))
    queued_prefill_tokens: int = field(default=0, converter=_as_count, validator=_count,
                                       metadata=doc("Prompt tokens waiting for prefill."))  # fmt: skip
    waiting_requests: int = field(default=0, converter=_as_count, validator=_count,
                                  metadata=doc("Requests waiting."))
    running_decodes: int = field(default=0, converter=_as_count, validator=_count,
                                 metadata=doc("Requests decoding."))
    decode_ms: float = field(default=0.0, converter=_as_ms, validator=_ms,
                             metadata=doc("Prefill delay per running decode (ms), as the scheduler measures it."))
    queue_ms: float | None = field(default=None, converter=_as_ms, validator=_ms,
                                   metadata=doc("The scheduler's own prediction of the wait (wins over estimates)."))
    labels: dict[str, str] = field(factory=dict, converter=_as_labels, validator=_labels,
                                   metadata=doc("Labels route rules can read (zone, gpu, ...)."))
    overlap_loads: bool = field(default=False, metadata=doc(
        "The engine loads restored state while the request waits in its queue (async loading): the wait is "
        "the longer of the two, not their sum."))  # fmt: skip


@define(frozen=True)
class RouteOption:
    """One candidate node, priced."""

    node: str
    predicted_ttft_ms: float  # queue + plan, before weights
    score_ms: float  # predicted_ttft_ms times the route rules' weight: what is compared
    queue_ms: float
    plan_ms: float  # lookup + transfer + mount + prefill of the rest
    reuse_tokens: int
    sources: tuple[str, ...]  # "tier@node" of each restored run, in order
    spans: tuple[tuple[int, int, str, str], ...] = ()  # (first block, end block, tier, node) of each run
    excluded: bool = False
    weight: float = 1.0
    rules: tuple[str, ...] = ()  # route rules that excluded or weighted it
    messages: tuple[str, ...] = ()
    prefetch: tuple[tuple[int, int, str, str], ...] = ()  # runs past the plan worth moving into `prefetch_to`
    prefetch_to: str = ""


@define(frozen=True)
class RouteDecision:
    """Where to run a request: the chosen node (None when route rules excluded every node) and why."""

    request_id: str
    tenant: str
    node: str | None
    options: tuple[RouteOption, ...]
    reasons: tuple[str, ...]
    fail_open: bool = False

    def option(self, node: str) -> RouteOption | None:
        """The priced option of `node` (None when it was not priced: fail-open, or it could not win)."""
        return next((o for o in self.options if o.node == node), None)
