"""One request's path through the kernel, measured: which modules `Kernel.plan` enters, and whether it bounces.

`sys.setprofile` records every call made while one warm plan runs (the builtin keyer and matcher, so no part of
the path hides in C). How the path is read off those calls:

- Only kernel modules count (`core/nexuskv/`); a frame anywhere else (attrs-generated `__init__`s, generated CEL
  code, the standard library) is transparent: a call's caller is the nearest kernel frame below it.
- The foundation and the contracts (`errors`, `units`, `logs`, `contracts/*`) do not count: every floor uses them
  as values and helpers, like builtins.
- A cross-module call is a call whose callee's module is not its caller's.
- The *spine* is the modules that pass the request on (they make a cross-module call into a counted module); a
  *leaf* answers and returns (it makes none: a breaker, a hash, a price, a log line).
- The *path* is the facade, then the callee module of every cross-module call into a spine module, in order,
  repeats in a row collapsed. Modules entered: the distinct modules of the path. A return: an entry of the path
  into a module that appears earlier in it, by a new call (control bounced back into a room it had left).
  Control coming back to a caller when its callee returns is not a return: the read path calling its stages in
  turn is a path with no return, and so is the planner consulting the cost model for each candidate.
- A *callback* is a call into a module that still has a frame lower on the stack (a room that had passed the
  request on is handed it back before it is done): the ping-pong the tests require none of.
- Only the planning thread is traced (`sys.setprofile`): the writer, prefetch and observer threads are not the
  request's path.

docs/architecture.md quotes these figures; the tests pin them, so a change that adds a room to the path or makes it
bounce fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest

import nexuskv
from nexuskv import Kernel, KernelConfig, PlanAction
from tests.conftest import SECRET, make_request

ROOT = Path(nexuskv.__file__).resolve().parent
POLICIES = str(ROOT.parents[1] / "policies")
UNCOUNTED = ("errors", "units", "logs", "contracts")


def module_of(filename: str) -> str | None:
    """The kernel module a code object's file is (None outside the kernel)."""
    try:
        parts = list(Path(filename).resolve().relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        return None
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _counted(module: str | None) -> bool:
    return module is not None and module.split(".")[0] not in UNCOUNTED


def trace_calls(fn, callbacks: list[tuple[str, str]] | None = None) -> list[tuple[str, str, str]]:
    """`(caller module, callee module, callee function)` of every cross-module call between counted modules.

    `callbacks` (when given) receives `(caller, callee)` of every call into a module that still has a frame lower
    on the stack: control handed back up into a room that had passed the request on (ping-pong).
    """
    calls: list[tuple[str, str, str]] = []
    modules: dict[str, str | None] = {}

    def mod(code) -> str | None:
        got = modules.get(code.co_filename, "?")
        if got == "?":
            got = modules[code.co_filename] = module_of(code.co_filename)
        return got

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = mod(frame.f_code)
        if not _counted(callee):
            return
        back = frame.f_back
        while back is not None and not _counted(mod(back.f_code)):
            back = back.f_back  # transparent: generated code, attrs, the standard library, foundation, contracts
        caller = mod(back.f_code) if back is not None else None
        if caller != callee:
            calls.append((caller or "", callee, frame.f_code.co_name))  # type: ignore[arg-type]
            if callbacks is not None and back is not None:
                below, f = set(), back.f_back
                while f is not None:
                    below.add(mod(f.f_code))
                    f = f.f_back
                if callee in below:
                    callbacks.append((caller or "", callee))  # type: ignore[arg-type]

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def read_path(calls: list[tuple[str, str, str]]) -> tuple[list[str], set[str], int]:
    """(the path, the leaves, the number of returns) of a plan's cross-module calls (see the module docstring)."""
    spine = {caller for caller, _, _ in calls if caller}
    leaves = {callee for _, callee, _ in calls} - spine
    path: list[str] = ["kernel"]
    for _, callee, _ in calls:
        if callee in spine and path[-1] != callee:
            path.append(callee)
    returns = sum(1 for i, m in enumerate(path) if m in path[:i])
    return path, leaves, returns


@pytest.fixture
def kernel():
    cfg = KernelConfig(node="n1", policies=POLICIES, deadline_ms=60_000.0, keyer={"name": "python"},
                       matcher={"name": "dict"}, tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        yield k


def _stored(k: Kernel, tenant: str, scope: str = "", blocks: int = 16):
    """A request of `tenant` whose every block is in DRAM, committed and flushed through the write path."""
    req = make_request(range(16 * blocks), tenant=tenant, scope=scope, model=nexuskv.ModelIdentity(name="tiny-llama"))
    k.commit(req, [bytes(256)] * len(k.keys(req)))
    assert k.flush(10)
    return req


OWN_PATH = ["kernel", "paths.read", "state.keys", "state.index", "planning.decision", "planning.planner",
            "planning.cost"]  # fmt: skip
LEAVES = {"cluster.membership", "planning.breakers", "state.identity", "state.restore_points", "planning.links",
          "policy.loader", "policy.policyset", "ops.decision_log", "storage.prefetch", "planning.seal",
          "planning.budget"}  # fmt: skip


def test_a_plan_of_the_tenants_own_state_passes_seven_modules_without_a_return_or_a_callback(kernel):
    req = _stored(kernel, "rag")
    follow = attrs.evolve(req, request_id="r2", token_ids=(*req.token_ids, 1, 2, 3))
    kernel.plan(follow)  # warm: memoised roots, compiled rules
    got: list = []
    callbacks: list = []
    calls = trace_calls(lambda: got.append(kernel.plan(attrs.evolve(follow, request_id="r3"))), callbacks)
    assert got[0].action == PlanAction.MATERIALIZE and got[0].tokens_reused == 256
    path, leaves, returns = read_path(calls)
    assert path == OWN_PATH and len(set(path)) <= 7
    assert returns == 0 and callbacks == []
    assert leaves == LEAVES
    # the policy layer is asked for the tenant's policy and shared scopes once, by the read path, never mid-pricing
    asks = [(caller, fn) for caller, callee, fn in calls if callee == "policy.loader"]
    assert asks == [("paths.read", "for_tenant"), ("paths.read", "shared_with")]
    # mid-pricing, the planning layer only evaluates the policy it was handed: it never looks one up
    assert {(c, m, f) for c, m, f in calls if c.startswith("planning.") and m.startswith("policy.")} == {
        ("planning.decision", "policy.policyset", "evaluate")}


def test_a_shared_scope_adds_one_pass_over_the_owners_namespace(kernel):
    """A scope another tenant shares is a second lookup and a second pricing, after the own decision (so the own
    decision stands when the deadline passes meanwhile): the same seven modules, four returns, no other bounce."""
    _stored(kernel, "rag", scope="docs")
    question = make_request(range(16 * 16 + 5), tenant="chat", model=nexuskv.ModelIdentity(name="tiny-llama"))
    kernel.plan(question)
    got: list = []
    callbacks: list = []
    calls = trace_calls(lambda: got.append(kernel.plan(attrs.evolve(question, request_id="q2"))), callbacks)
    assert got[0].namespace is not None and got[0].namespace.tenant == "rag" and got[0].tokens_reused == 256
    path, leaves, returns = read_path(calls)
    assert path == [*OWN_PATH, "state.keys", "state.index", "planning.planner", "planning.cost"]
    assert len(set(path)) == 7 and returns == 4 and callbacks == []
    assert leaves == LEAVES | {"state.holding"}  # the owner's holdings, decoded by the index
    asks = [(caller, fn) for caller, callee, fn in calls if callee == "policy.loader"]
    assert asks == [("paths.read", "for_tenant"), ("paths.read", "shared_with")]
    assert {(c, m, f) for c, m, f in calls if c.startswith("planning.") and m.startswith("policy.")} == {
        ("planning.decision", "policy.policyset", "evaluate"),
        ("planning.decision", "policy.policyset", "share_granted"),
    }


def test_the_path_reader_counts_what_it_says():
    calls = [("kernel", "a", "f"), ("a", "b", "g"), ("b", "leaf", "h"), ("a", "leaf", "h"), ("a", "b", "g"),
             ("b", "a", "cb")]  # fmt: skip
    path, leaves, returns = read_path(calls)
    assert path == ["kernel", "a", "b", "a"] and leaves == {"leaf"} and returns == 1
