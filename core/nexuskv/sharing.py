"""Who may read whose state: the `share` grants that let one tenant reuse a scope of another tenant's.

The read path asks `granted` before it plans over another tenant's scope; the load path asks `authorise`
again before it loads a plan that names another namespace, because a plan may have crossed a process boundary
and must not be trusted to say whose state it may read.
"""

from __future__ import annotations

from typing import Any

from nexuskv.contracts import Namespace, Request
from nexuskv.policy.loader import Policies, PolicyError
from nexuskv.policy.model import Candidate

__all__ = ["authorise", "granted"]


def granted(policies: Policies, request: Request, owner: str, scope: str, blocks: int, now: Any = None) -> bool:
    """True when `owner`'s `share` rules grant `request` the first `blocks` blocks of its scope `scope`.

    `now`: the time the rules see (default: the clock; a replay passes the recorded time).
    """
    view = Candidate(tokens=blocks * request.layout.page_size, blocks=blocks, owner=owner, scope=scope,
                     shared=True, kind=request.layout.kind)  # fmt: skip
    values = {"request": request, "match": view} if now is None else {"request": request, "match": view, "now": now}
    return policies.for_tenant(owner).evaluate("share", values).allowed


def authorise(policies: Policies | None, request: Request, namespace: Namespace, blocks: int) -> str:
    """Why `request` may not read `blocks` blocks of `namespace` ("" when it may: its own, or granted now)."""
    if namespace == request.namespace:
        return ""
    who = f"tenant {request.tenant!r} may not read scope {namespace.scope!r} of tenant {namespace.tenant!r}"
    if namespace.cache_salt != request.cache_salt:
        return f"{who}: the cache salt differs"
    if policies is None or (namespace.tenant, namespace.scope) not in policies.readable_by(request.tenant):
        return f"{who}: no share rule names it"
    try:
        ok = granted(policies, request, namespace.tenant, namespace.scope, blocks)
    except PolicyError:  # no policy for the owner any more: closed
        ok = False
    return "" if ok else f"{who}: the owner's share rules do not grant this request"
