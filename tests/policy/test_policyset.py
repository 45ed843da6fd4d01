"""Policy evaluation: effects, match conditions, caps, placement, sharing, lazy variables and run-time errors."""

from __future__ import annotations

import datetime as dt
import textwrap
from pathlib import Path

import pytest
import structlog.testing

from nexuskv.cel.types import plugin_functions
from nexuskv.policy.authoring.testing import build_activation
from nexuskv.policy.loader import Policies
from nexuskv.policy.policyset import KINDS, PolicySet, kind_env
from nexuskv.policy.verdict import Placement, Verdict

SHIPPED = Path(__file__).resolve().parents[2] / "policies"


def policy(tmp_path: Path, text: str, functions=None, **tenants: str) -> PolicySet:
    """The compiled `default` policy of `text` (or of tenant `t` when tenants are given)."""
    (tmp_path / "default.toml").write_text(textwrap.dedent(text))
    for name, body in tenants.items():
        (tmp_path / "tenants").mkdir(exist_ok=True)
        (tmp_path / "tenants" / f"{name}.toml").write_text(textwrap.dedent(body))
    pol = Policies.load(tmp_path, functions)
    return pol.for_tenant(next(iter(tenants), "default"))


def state(**kw) -> dict:
    return build_activation({"state": kw})


def reuse(tokens: int = 64, **kw) -> dict:
    inputs = {"match": {"tokens": tokens, **kw.pop("match", {})}, "cost": kw.pop("cost", {"gain_ms": 5.0}), **kw}
    return build_activation(inputs)


# ------------------------------------------------------------------------------------------ admit / reuse


def test_admit_effects(tmp_path):
    ps = policy(tmp_path, """
        [[admit]]
        name = "deny-big"
        when = "state.nbytes > 1000"
        message = "too big"

        [[admit]]
        name = "warn-mid"
        effect = "warn"
        when = "state.nbytes > 100"
        message_expr = '"size " + string(state.nbytes)'

        [[admit]]
        name = "audit-small"
        effect = "audit"
        when = "state.nbytes > 10"
    """)
    v = ps.evaluate("admit", state(nbytes=5))
    assert (v.allowed, v.deciding, v.fired, v.warnings, v.audits, v.errors) == (True, (), (), (), (), ())
    v = ps.evaluate("admit", state(nbytes=50))
    assert (v.allowed, v.deciding, v.fired, v.audits) == (True, (), ("audit-small",), ("audit-small",))
    v = ps.evaluate("admit", state(nbytes=500))
    assert v.allowed and v.warnings == ("warn-mid: size 500",) and v.fired == ("warn-mid", "audit-small")
    v = ps.evaluate("admit", state(nbytes=5000))
    assert not v.allowed
    assert v.deciding == ("deny-big",) and v.messages == ("too big",)
    assert v.fired == ("deny-big", "warn-mid", "audit-small")  # every rule is evaluated and recorded
    assert v.kind == "admit" and v.policy == "default" and v.revision == ps.revision and v.placement is None


def test_match_conditions_are_preconditions(tmp_path):
    ps = policy(tmp_path, """
        [[reuse]]
        name = "edge"
        match = ['node.startsWith("edge-")', "match.tokens > 0"]
        when = "match.tokens > 100"
    """)
    assert ps.evaluate("reuse", reuse(500, node="core-1")).allowed
    assert ps.evaluate("reuse", reuse(50, node="edge-1")).allowed
    v = ps.evaluate("reuse", reuse(500, node="edge-1"))
    assert not v.allowed and v.fired == ("edge",)


def test_a_failing_match_condition_is_not_evaluated_further(tmp_path):
    calls: list[int] = []
    fns, _ = plugin_functions({"spy": (lambda x: calls.append(x) or x, ["int"], "int")})
    ps = policy(tmp_path, """
        [[reuse]]
        name = "r"
        match = ["match.tokens > 1000"]
        when = "spy(match.tokens) > 0"
    """, fns)
    assert ps.evaluate("reuse", reuse(10)).fired == ()
    assert calls == []


def test_max_tokens_caps(tmp_path):
    ps = policy(tmp_path, """
        [[reuse]]
        name = "cap-a"
        when = "match.tokens > 1000"
        max_tokens = "1000"
        message = "a"

        [[reuse]]
        name = "cap-b"
        when = "match.tokens > 500"
        max_tokens = "match.tokens / 2"

        [[reuse]]
        name = "warn-cap"
        effect = "warn"
        when = "true"
        max_tokens = "1"

        [[reuse]]
        name = "negative"
        when = "match.tokens == 7"
        max_tokens = "-5"

        [[reuse]]
        name = "refuse"
        when = "match.tokens == 3000"
    """)
    v = ps.evaluate("reuse", reuse(100))
    assert (v.allowed, v.max_tokens, v.deciding) == (True, None, ())  # a warning never caps
    v = ps.evaluate("reuse", reuse(800))
    assert (v.allowed, v.max_tokens, v.deciding) == (True, 400, ("cap-b",))
    v = ps.evaluate("reuse", reuse(1500))
    assert (v.allowed, v.max_tokens, v.deciding, v.messages) == (True, 750, ("cap-a", "cap-b"), ("a",))
    v = ps.evaluate("reuse", reuse(2400))
    assert (v.allowed, v.max_tokens) == (True, 1000)  # the smallest of all firing caps
    v = ps.evaluate("reuse", reuse(3000))
    assert (v.allowed, v.max_tokens, v.deciding) == (False, 0, ("cap-a", "cap-b", "refuse"))
    v = ps.evaluate("reuse", reuse(7))
    assert (v.allowed, v.max_tokens) == (False, 0)  # a negative cap is no reuse


def test_a_deny_without_cap_before_a_cap_still_refuses(tmp_path):
    ps = policy(tmp_path, """
        [[reuse]]
        name = "refuse"
        when = "true"

        [[reuse]]
        name = "cap"
        when = "true"
        max_tokens = "100"
    """)
    v = ps.evaluate("reuse", reuse(500))
    assert (v.allowed, v.max_tokens, v.deciding) == (False, 0, ("refuse", "cap"))


def test_reuse_sees_tier_and_cost(tmp_path):
    ps = policy(tmp_path, """
        [[reuse]]
        name = "slow"
        effect = "warn"
        when = 'tier == "disk" && cost.gain_ms < 2.0'
        message_expr = '"gain " + string(cost.gain_ms)'
    """)
    assert ps.evaluate("reuse", reuse(tier="dram", cost={"gain_ms": 1.5})).warnings == ()
    v = ps.evaluate("reuse", reuse(tier="disk", cost={"gain_ms": 1.5}))
    assert v.warnings == ("slow: gain 1.5",)


def test_the_shipped_chat_policy():
    chat = Policies.load(SHIPPED).for_tenant("chat")
    v = chat.evaluate("reuse", reuse(12000, node="edge-3", match={"tier": "dram"}, cost={"gain_ms": 1.5}))
    assert (v.allowed, v.max_tokens, v.deciding) == (True, 8192, ("cap-untrusted-node",))
    assert v.warnings == ("watch-slow-reuse: reuse from dram gains only 1.5 ms",)
    assert v.to_log() == {"kind": "reuse", "policy": "chat", "revision": chat.revision, "allowed": True,
                          "max_tokens": 8192, "deciding": ["cap-untrusted-node"], "fired": ["cap-untrusted-node",
                          "watch-slow-reuse"], "messages": ["edge nodes reuse at most 8k tokens"],
                          "warnings": ["watch-slow-reuse: reuse from dram gains only 1.5 ms"]}  # fmt: skip


# ------------------------------------------------------------------------------------------ place


PLACE = """
    default_tier = "nvme"

    [[place]]
    name = "audit-all"
    effect = "audit"
    tier = "tape"

    [[place]]
    name = "big"
    when = "state.nbytes > 1000"
    tier_expr = 'state.nbytes > 5000 ? "disk" : "ssd"'
    ttl_expr = 'duration("1h") + duration("3600s")'
    priority_expr = "state.span.end / 16"

    [[place]]
    name = "mid"
    when = "state.nbytes > 100"
    ttl = "90s"
    priority = 2.5

    [[place]]
    name = "mid-too"
    when = "state.nbytes > 100"
    tier = "never"
"""


def test_place_first_firing_rule_wins_and_audits_are_skipped(tmp_path):
    ps = policy(tmp_path, PLACE)
    v = ps.evaluate("place", state(nbytes=6000, span={"start": 0, "end": 64}))
    assert v.placement == Placement(tier="disk", ttl_s=7200.0, priority=4.0)
    assert v.deciding == ("big",) and v.fired == ("audit-all", "big")
    assert v.audits == ("audit-all: would place in tape (ttl None, priority None)",)
    assert ps.evaluate("place", state(nbytes=2000)).placement.tier == "ssd"
    v = ps.evaluate("place", state(nbytes=500))
    assert v.placement == Placement(tier="nvme", ttl_s=90.0, priority=2.5)  # no tier: the default tier
    assert v.deciding == ("mid",) and "mid-too" not in v.fired
    v = ps.evaluate("place", state(nbytes=5))
    assert v.placement == Placement(tier="nvme") and v.deciding == () and v.fired == ("audit-all",)


def test_place_without_a_default_tier(tmp_path):
    ps = policy(tmp_path, '[[place]]\nname = "p"\nwhen = "false"\ntier = "x"\n')
    assert ps.evaluate("place", state()).placement == Placement(tier=None, ttl_s=None, priority=None)


def test_a_failing_place_rule_never_decides(tmp_path):
    ps = policy(tmp_path, """
        default_tier = "dflt"
        [[place]]
        name = "broken"
        when = "state.nbytes / state.span.start > 1"
        tier = "bad"

        [[place]]
        name = "broken-prio"
        tier = "bad2"
        priority_expr = "100 / state.span.start"

        [[place]]
        name = "next"
        when = "state.nbytes > 100"
        tier = "good"
    """)
    with structlog.testing.capture_logs() as logs:
        v = ps.evaluate("place", state(nbytes=500, span={"start": 0, "end": 16}))
    assert v.placement.tier == "good" and v.deciding == ("next",)
    assert [e.split(":")[0] for e in v.errors] == ["broken", "broken-prio"]
    assert all("division by zero" in e for e in v.errors)
    assert [log["rule"] for log in logs] == ["broken", "broken-prio"]
    v = ps.evaluate("place", state(nbytes=5, span={"start": 0, "end": 16}))
    assert v.placement == Placement(tier="dflt") and len(v.errors) == 2


# ------------------------------------------------------------------------------------------ share


SHARE = """
    [[share]]
    name = "docs"
    scope = "docs"
    tenants = ["chat", "partner"]
    when = 'request.model.name == "tiny-llama"'

    [[share]]
    name = "public"
    scope = "public"
    tenants = ["*"]

    [[share]]
    name = "trial"
    effect = "audit"
    scope = "docs"
    tenants = ["trial"]
"""


def share(reader: str, scope: str, model: str = "tiny-llama") -> dict:
    return build_activation({"request": {"tenant": reader, "model": {"name": model}},
                             "match": {"tokens": 64, "owner": "owner", "scope": scope, "shared": True}})  # fmt: skip


def test_share_grants(tmp_path):
    ps = policy(tmp_path, SHARE)
    assert ps.grants("chat") == [("docs", "docs"), ("public", "public")]
    assert ps.grants("stranger") == [("public", "public")]
    assert ps.grants("trial") == [("public", "public"), ("trial", "docs")]  # `evaluate` decides about audits
    v = ps.evaluate("share", share("chat", "docs"))
    assert (v.allowed, v.deciding) == (True, ("docs",))
    assert not ps.evaluate("share", share("chat", "docs", model="other")).allowed
    v = ps.evaluate("share", share("stranger", "public"))
    assert (v.allowed, v.deciding) == (True, ("public",))


def test_share_is_only_for_the_named_tenants_and_scope(tmp_path):
    ps = policy(tmp_path, SHARE)
    # A grant to `chat` of scope `docs` gives nothing to other tenants, nor of other scopes.
    for reader, scope in [("stranger", "docs"), ("chat", "private"), ("chat", ""), ("partner", "public-ish")]:
        v = ps.evaluate("share", share(reader, scope))
        assert (v.allowed, v.deciding, v.fired) == (False, (), ()), (reader, scope)


def test_share_audit_grants_nothing(tmp_path):
    ps = policy(tmp_path, SHARE)
    v = ps.evaluate("share", share("trial", "docs"))
    assert (v.allowed, v.deciding, v.fired, v.audits) == (False, (), ("trial",), ("trial",))


def test_share_default_is_no_access(tmp_path):
    ps = policy(tmp_path, '[[admit]]\nname = "a"\nwhen = "false"\n')
    assert ps.grants("chat") == []
    v = ps.evaluate("share", share("chat", "docs"))
    assert (v.allowed, v.deciding) == (False, ())


def test_the_shipped_rag_policy_shares_documents_with_partners_only():
    rag = Policies.load(SHIPPED).for_tenant("rag")
    assert rag.evaluate("share", share("partner-a", "docs")).allowed
    assert not rag.evaluate("share", share("strict", "docs")).allowed
    assert not rag.evaluate("share", share("partner-a", "user-42")).allowed


# ------------------------------------------------------------------------------------------ variables


def counting(calls: list[int]):
    def count(x: int) -> int:
        calls.append(x)
        return x

    fns, problems = plugin_functions({"count": (count, ["int"], "int")})
    assert problems == []
    return fns


def test_variables_are_lazy_and_evaluated_at_most_once(tmp_path):
    calls: list[int] = []
    ps = policy(tmp_path, """
        [variables]
        size = "count(state.nbytes)"
        double_size = "variables.size * 2"
        both = "variables.size + variables.double_size"

        [[admit]]
        name = "a"
        when = "variables.size > 100"

        [[admit]]
        name = "b"
        effect = "warn"
        when = "variables.double_size > 100 && variables.both > 0"
        message_expr = 'string(variables.size)'

        [[admit]]
        name = "c"
        match = ["state.span.end > 1000"]
        when = "variables.size > 0"
    """, counting(calls))
    v = ps.evaluate("admit", state(nbytes=60))
    assert v.allowed and v.warnings == ("b: 60",)
    assert calls == [60]
    v = ps.evaluate("admit", state(nbytes=70))  # a new evaluation computes it again, once
    assert calls == [60, 70]


def test_variables_no_rule_needs_are_never_evaluated(tmp_path):
    calls: list[int] = []
    ps = policy(tmp_path, """
        [variables]
        size = "count(state.nbytes)"

        [[admit]]
        name = "a"
        match = ["state.nbytes > 1000"]
        when = "variables.size > 0"

        [[admit]]
        name = "b"
        when = "state.nbytes > 1000 && variables.size > 0"

        [[place]]
        name = "p"
        tier = "dram"
    """, counting(calls))
    ps.evaluate("admit", state(nbytes=5))
    ps.evaluate("place", state(nbytes=5000))
    assert calls == []
    ps.evaluate("admit", state(nbytes=5000))
    assert calls == [5000]


def test_a_failing_variable_fails_each_rule_that_uses_it_but_is_computed_once(tmp_path):
    # (A failing expression is re-run by its exact evaluator to apply CEL's error rules, so the count is
    # taken in a variable that succeeds.)
    calls: list[int] = []
    ps = policy(tmp_path, """
        [variables]
        size = "count(state.nbytes)"
        ratio = "variables.size / state.span.start"

        [[admit]]
        name = "a"
        failure = "ignore"
        when = "variables.ratio > 1"

        [[admit]]
        name = "b"
        when = "variables.ratio > 2"
    """, counting(calls))
    v = ps.evaluate("admit", state(nbytes=10, span={"start": 0, "end": 16}))
    assert calls == [10]
    assert [e.split(":")[0] for e in v.errors] == ["a", "b"]
    assert "variable 'ratio'" in v.errors[0] and "division by zero" in v.errors[0]
    assert (v.allowed, v.deciding) == (False, ("b",))


def test_variables_per_kind(tmp_path):
    ps = policy(tmp_path, """
        [variables]
        big = "state.nbytes > 100"
        long = "match.tokens > 100"
        any_kind = "request.priority > 0"

        [[admit]]
        name = "a"
        when = "variables.big && variables.any_kind"

        [[reuse]]
        name = "r"
        when = "variables.long && variables.any_kind"
    """)
    assert set(ps.variables["admit"]) == {"big", "any_kind"}
    assert set(ps.variables["reuse"]) == {"long", "any_kind"}
    assert set(ps.variables["share"]) == {"long", "any_kind"}
    assert set(ps.variables["place"]) == {"big", "any_kind"}
    act = build_activation({"state": {"nbytes": 500}, "request": {"priority": 1}})
    assert not ps.evaluate("admit", act).allowed


# ------------------------------------------------------------------------------------------ run-time errors


ERRORS = """
    failure = "{failure}"

    [[admit]]
    name = "divide"
    when = "state.nbytes / state.span.start > 1"

    [[admit]]
    name = "overflow"
    when = "state.nbytes * 9223372036854775807 > 0"

    [[admit]]
    name = "fine"
    effect = "warn"
    when = "true"
"""


def test_runtime_errors_with_failure_deny(tmp_path):
    ps = policy(tmp_path, ERRORS.format(failure="deny"))
    with structlog.testing.capture_logs() as logs:
        v = ps.evaluate("admit", state(nbytes=10, span={"start": 0, "end": 16}))
    assert not v.allowed
    assert v.deciding == ("divide", "overflow")
    assert v.fired == ("fine",) and v.warnings == ("fine",)
    assert [e.split(":")[0] for e in v.errors] == ["divide", "overflow"]
    assert "division by zero" in v.errors[0] and "overflow" in v.errors[1]
    assert all("failing safe" in m for m in v.messages)
    assert [(r["event"], r["rule"], r["failure"], r["policy"], r["kind"]) for r in logs] == [
        ("policy rule failed", "divide", "deny", "default", "admit"),
        ("policy rule failed", "overflow", "deny", "default", "admit"),
    ]
    assert all(r["log_level"] == "warning" for r in logs)


def test_runtime_errors_with_failure_ignore(tmp_path):
    ps = policy(tmp_path, ERRORS.format(failure="ignore"))
    with structlog.testing.capture_logs() as logs:
        v = ps.evaluate("admit", state(nbytes=10, span={"start": 0, "end": 16}))
    assert v.allowed and v.deciding == () and v.messages == ()
    assert [e.split(":")[0] for e in v.errors] == ["divide", "overflow"]
    assert [(r["rule"], r["failure"]) for r in logs] == [("divide", "ignore"), ("overflow", "ignore")]
    # Without the error the rules evaluate normally.
    v = ps.evaluate("admit", state(nbytes=1, span={"start": 5, "end": 16}))
    assert (v.allowed, v.deciding, v.errors) == (False, ("overflow",), ())


def test_per_rule_failure_overrides_the_file(tmp_path):
    ps = policy(tmp_path, """
        failure = "ignore"
        [[reuse]]
        name = "strict-one"
        failure = "deny"
        when = "match.tokens / match.blocks > 1"

        [[reuse]]
        name = "lenient-one"
        when = "match.tokens % match.blocks > 1"
    """)
    v = ps.evaluate("reuse", reuse(100, match={"blocks": 0}))
    assert (v.allowed, v.max_tokens, v.deciding) == (False, 0, ("strict-one",))
    assert [e.split(":")[0] for e in v.errors] == ["strict-one", "lenient-one"]


def test_an_error_in_max_tokens_fails_the_rule(tmp_path):
    ps = policy(tmp_path, '[[reuse]]\nname = "cap"\nwhen = "true"\nmax_tokens = "match.tokens / match.blocks"\n')
    v = ps.evaluate("reuse", reuse(100, match={"blocks": 0}))
    assert (v.allowed, v.max_tokens, v.deciding) == (False, 0, ("cap",))
    assert v.errors[0].startswith("cap: ")


def test_a_failing_share_rule_grants_nothing(tmp_path):
    ps = policy(tmp_path, '[[share]]\nname = "s"\nscope = "x"\ntenants = ["*"]\nwhen = "1 / match.blocks > 0"\n')
    v = ps.evaluate("share", share("a", "x"))
    assert (v.allowed, v.deciding) == (False, ())
    assert v.errors[0].startswith("s: ")


def test_an_error_absorbed_by_the_logic_is_no_error(tmp_path):
    ps = policy(tmp_path, '[[admit]]\nname = "a"\nwhen = "state.nbytes > 0 || 1 / state.span.start > 0"\n')
    v = ps.evaluate("admit", state(span={"start": 0, "end": 16}))
    assert (v.allowed, v.errors) == (False, ())


def test_message_expr_failure_falls_back_to_the_message(tmp_path):
    ps = policy(tmp_path, """
        [[admit]]
        name = "a"
        when = "true"
        message = "static"
        message_expr = 'string(state.nbytes / state.span.start)'

        [[admit]]
        name = "b"
        effect = "warn"
        when = "true"
        message_expr = 'string(state.nbytes / state.span.start)'
    """)
    v = ps.evaluate("admit", state(span={"start": 0, "end": 16}))
    assert not v.allowed and v.deciding == ("a",) and v.errors == ()
    assert v.messages[0].startswith("static (message_expr failed: ") and "division by zero" in v.messages[0]
    assert v.warnings[0].startswith("b: (message_expr failed: ")
    v = ps.evaluate("admit", state(nbytes=64, span={"start": 2, "end": 16}))
    assert v.messages == ("32",) and v.warnings == ("b: 32",)


# ------------------------------------------------------------------------------------------ activation


def test_now_and_node_defaults(tmp_path):
    ps = policy(tmp_path, """
        [[admit]]
        name = "recent"
        when = 'now > timestamp("2020-01-01T00:00:00Z")'

        [[admit]]
        name = "nodeless"
        effect = "warn"
        when = 'node == ""'
    """)
    v = ps.evaluate("admit", state())
    assert v.deciding == ("recent",) and v.warnings == ("nodeless",)
    past = dt.datetime(2019, 6, 1, tzinfo=dt.UTC)
    v = ps.evaluate("admit", {**state(), "now": past, "node": "n1"})
    assert v.allowed and v.fired == ()
    act = ps.activation("admit", state())
    assert act["node"] == "" and act["now"].tzinfo is not None
    assert abs((act["now"] - dt.datetime.now(dt.UTC)).total_seconds()) < 60
    # A kind that never uses `now` does not pay for it.
    assert "now" not in ps.activation("reuse", reuse())


def test_now_used_only_by_a_variable(tmp_path):
    ps = policy(tmp_path, '[variables]\nold = \'now < timestamp("2000-01-01T00:00:00Z")\'\n'
                          '[[admit]]\nname = "a"\nwhen = "variables.old"\n')  # fmt: skip
    assert ps.evaluate("admit", state()).allowed
    assert "now" in ps.activation("admit", state())


def test_unknown_kind(tmp_path):
    ps = policy(tmp_path, '[[admit]]\nname = "a"\nwhen = "true"\n')
    with pytest.raises(ValueError, match="unknown rule kind 'evict'"):
        ps.evaluate("evict", {})


def test_every_kind_evaluates_with_no_rules(tmp_path):
    ps = policy(tmp_path, 'description = "empty"\n')
    for kind in KINDS:
        v = ps.evaluate(kind, reuse())
        assert isinstance(v, Verdict) and v.kind == kind and v.errors == ()
        assert v.allowed is (kind != "share")


def test_kind_env_declares_what_each_kind_sees():
    assert set(kind_env("admit").variables) == {"request", "node", "now", "state"}
    assert set(kind_env("place").variables) == {"request", "node", "now", "state"}
    assert set(kind_env("reuse").variables) == {"request", "node", "now", "match", "tier", "cost"}
    assert set(kind_env("share").variables) == {"request", "node", "now", "match"}


def test_plugin_function_registrations():
    fns, problems = plugin_functions({
        "ok": (len, ["string"], "int"),
        "bad_type": (len, ["str"], "int"),
        "bad_shape": (len, ["string"]),
    })  # fmt: skip
    assert set(fns) == {"ok"}
    assert len(problems) == 2 and "'bad_type'" in problems[0] and "'bad_shape'" in problems[1]


def test_placement_and_verdict_to_log():
    v = Verdict(kind="place", policy="p", revision="r", deciding=("x",), placement=Placement("dram", 60.0, 1.0))
    assert v.deciding == ("x",)
    assert v.to_log() == {"kind": "place", "policy": "p", "revision": "r", "allowed": True, "deciding": ["x"],
                          "placement": {"tier": "dram", "ttl_s": 60.0, "priority": 1.0}}  # fmt: skip
