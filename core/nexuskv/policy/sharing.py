"""Who may read whose state: the `share` grants that let one tenant reuse a scope of another tenant's.

The decision step asks the owner's policy (`PolicySet.share_granted`, resolved once by the read path) before it
plans over another tenant's scope; the load path asks `authorise` again before it loads a plan that names another
namespace, because a plan may have crossed a process boundary and must not be trusted to say whose state it may
read.
"""

from __future__ import annotations

from nexuskv.contracts import Namespace, Request
from nexuskv.policy.loader import Policies, PolicyError

__all__ = ["authorise"]


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
        ok = policies.for_tenant(namespace.tenant).share_granted(request, namespace.tenant, namespace.scope, blocks)
    except PolicyError:  # no policy for the owner any more: closed
        ok = False
    return "" if ok else f"{who}: the owner's share rules do not grant this request"
