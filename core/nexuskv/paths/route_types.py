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
    try:
        return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value
    except OverflowError:  # an int past a float's range is not a time (the validator names it)
        return math.inf


def _as_labels(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


_MAX_COUNT = 1 << 53  # counts stay exact as floats: the pricing does float arithmetic with them


def _count(name: str, value: Any) -> int:
    value = _as_count(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_COUNT:
        big = isinstance(value, int) and value.bit_length() >= 64
        shown = f"an int of {value.bit_length()} bits" if big else value
        raise ValueError(f"NodeState.{name} must be an int >= 0 and < 2^53, got {shown!r}")
    return value


def _ms(name: str, value: Any) -> float:
    value = _as_ms(value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"NodeState.{name} must be a finite number >= 0, got {value!r}")
    return value


@define(frozen=True)
class NodeState:
    """A candidate node as the scheduler reports it (its own bookkeeping, or the engine's metrics)."""

    node: str = field(metadata=doc("Node name, as the node publishes itself (`KernelConfig.node`)."))
    queued_prefill_tokens: int = field(default=0, metadata=doc("Prompt tokens waiting for prefill."))
    waiting_requests: int = field(default=0, metadata=doc("Requests waiting."))
    running_decodes: int = field(default=0, metadata=doc("Requests decoding."))
    decode_ms: float = field(default=0.0, metadata=doc(
        "Prefill delay per running decode (ms), as the scheduler measures it."))  # fmt: skip
    queue_ms: float | None = field(default=None, metadata=doc(
        "The scheduler's own prediction of the wait (wins over estimates)."))  # fmt: skip
    labels: dict[str, str] = field(factory=dict, metadata=doc("Labels route rules can read (zone, gpu, ...)."))
    overlap_loads: bool = field(default=False, metadata=doc(
        "The engine loads restored state while the request waits in its queue (async loading): the wait is "
        "the longer of the two, not their sum."))  # fmt: skip

    def __attrs_post_init__(self) -> None:
        """Check the report in one pass: a scheduler builds one per node per request.

        Counts are ints >= 0 (whole numbers from other sources converted), times finite floats >= 0, labels strings
        to strings; a `ValueError` names the field.
        """
        node = self.node
        if not isinstance(node, str) or not node:
            raise ValueError(f"NodeState.node must be a non-empty string, got {node!r}")
        q, w, r = self.queued_prefill_tokens, self.waiting_requests, self.running_decodes
        if not (type(q) is int and type(w) is int and type(r) is int and 0 <= q < _MAX_COUNT and 0 <= w < _MAX_COUNT
                and 0 <= r < _MAX_COUNT):  # fmt: skip
            for name in ("queued_prefill_tokens", "waiting_requests", "running_decodes"):
                object.__setattr__(self, name, _count(name, getattr(self, name)))
        d = self.decode_ms
        if type(d) is not float or not 0.0 <= d < math.inf:
            object.__setattr__(self, "decode_ms", _ms("decode_ms", d))
        qm = self.queue_ms
        if qm is not None and (type(qm) is not float or not 0.0 <= qm < math.inf):
            object.__setattr__(self, "queue_ms", _ms("queue_ms", qm))
        labels = _as_labels(self.labels)  # a copy: the caller's dict changing later changes nothing here
        object.__setattr__(self, "labels", labels)
        if not isinstance(labels, dict) or (labels and not all(isinstance(k, str) and isinstance(v, str)
                                                               for k, v in labels.items())):  # fmt: skip
            raise ValueError(f"NodeState.labels must map strings to strings, got {labels!r}")


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
