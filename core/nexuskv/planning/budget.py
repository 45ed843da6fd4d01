"""The planning budget: how long a plan (or a route) may take, sized by what the request stands to gain.

Planning time is a cost like any other (G already holds T_lookup), so a fixed deadline is a bug in the budget: at
1 ms, a busy machine threw away seconds of prefill to save a fraction of a millisecond. The budget of a request is

    budget_ms = max(deadline_ms, min(deadline_cap_ms, deadline_fraction x T_recompute(prompt tokens)))

where T_recompute is the cost model's predicted prefill time of the whole prompt: the most a plan could save. With
the defaults (floor 0.5 ms, 0.8 %, cap 50 ms) and the default CPU profile, a 1k-token request gets 0.98 ms, a
4k-token one 4.9 ms, a 9k-token one 14 ms and a 32k-token one the 50 ms cap (0.36 % of its 13.9 s): spending under
1 % of what is at stake to find out whether it can be saved. The defaults were chosen by measurement
(`bench/load.py`): under a CPU hog on both cores of a 2-core machine a 9k-token plan took up to 14 ms, and at 0.5 %
(8.8 ms) about 1 % of the gain at stake was lost to fallbacks; at a fixed 1 ms, about 90 %. The rule's budget is
stretched by how much the machine slows plans down now (`slowdown`), never past `max_deadline_ms`. A request's
`slo.deadline_ms` (never above `max_deadline_ms`) or a caller's `deadline_ms` replaces the rule. Failures (control
plane down, a breaker open, a plugin raising) answer at once, whatever the budget.
"""

from __future__ import annotations

from attrs import define

from nexuskv.contracts import Request
from nexuskv.contracts.config import KernelConfig
from nexuskv.planning.cost import CostModel

__all__ = ["Budget", "budget_for", "format_ms"]


@define(frozen=True, slots=True)
class Budget:
    """A plan's budget in milliseconds and the rule that gave it (`why`, for reasons and the decision line)."""

    ms: float
    why: str

    def reason(self) -> str:
        """The budget as a plan reason: `budget 4.87 ms (0.8% of 609 ms predicted prefill)`."""
        return f"budget {format_ms(self.ms)} ms ({self.why})"


def budget_for(request: Request, config: KernelConfig, cost: CostModel, deadline_ms: float | None = None,
               slowdown: float = 1.0) -> Budget:  # fmt: skip
    """The budget of `request`: the caller's `deadline_ms`, else its `slo.deadline_ms` (capped), else the rule.

    `slowdown` (at least 1) is how much the machine stretches plans now (the read path's estimate: recent plans'
    wall time over their CPU time). The rule's budget is stretched by it, never past `max_deadline_ms`: a CPU hog
    slows a plan and the prefill it would save alike, so what is at stake in wall time grows by the same factor.
    """
    if deadline_ms is not None:
        return Budget(deadline_ms, "the caller's deadline_ms")
    asked = request.slo.deadline_ms
    if asked is not None:  # a tenant's word: never above the operator's `max_deadline_ms`
        if asked > config.max_deadline_ms:
            return Budget(config.max_deadline_ms, f"slo.deadline_ms {asked:g} capped at max_deadline_ms")
        return Budget(asked, "the request's slo.deadline_ms")
    # T_recompute of the whole prompt, read off the profile as `CostModel.recompute_ms` computes it (a test pins the
    # two equal): a call into the cost model here would make the request's path re-enter it when pricing
    n = len(request.token_ids)
    prefill = cost.profile.prefill
    stake = prefill.per_token_ms * n + prefill.per_token_sq_ms * n * n
    share = config.deadline_fraction * stake
    rule = f"{100 * config.deadline_fraction:.3g}% of {format_ms(stake)} ms predicted prefill"
    if share <= config.deadline_ms:
        ms, why = config.deadline_ms, f"the floor: {rule} is less"
    elif share >= config.deadline_cap_ms:
        ms, why = max(config.deadline_cap_ms, config.deadline_ms), f"the cap: {rule} is more"
    else:
        ms, why = share, rule
    if slowdown >= 1.05:  # a busy machine: the stakes in wall time are larger by as much
        ms, why = ms * slowdown, f"{why}; x{slowdown:.2g} for this machine's load"
    if ms > config.max_deadline_ms:  # the rule never gives more than a request may ask for
        ms, why = config.max_deadline_ms, f"{why}; capped at max_deadline_ms"
    return Budget(ms, why)


def format_ms(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"
