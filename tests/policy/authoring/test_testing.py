"""The policy unit-test runner (`nexuskv policy test`): cases, expectations, and bad test input."""

from __future__ import annotations

import datetime as dt
import textwrap
from pathlib import Path

import pytest

from nexuskv.errors import ContractError
from nexuskv.policy.authoring.testing import build_activation, run_tests, sample_request, sample_state
from nexuskv.policy.loader import Policies

SHIPPED = Path(__file__).resolve().parents[3] / "policies"

POLICY = """
[[admit]]
name = "big"
when = "state.nbytes > 1000"
message = "too big"

[[admit]]
name = "mid"
effect = "warn"
when = "state.nbytes > 100"

[[admit]]
name = "watch"
effect = "audit"
when = "state.nbytes > 10"

[[admit]]
name = "broken"
failure = "ignore"
when = "state.nbytes / state.span.start < 0"

[[place]]
name = "hot"
tier = "dram"
ttl = "1h"
priority_expr = "state.span.end / 16"
"""


@pytest.fixture
def policies(tmp_path) -> Policies:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "default.toml").write_text(POLICY)
    return Policies.load(tmp_path / "policies")


def run(tmp_path: Path, policies: Policies, text: str):
    path = tmp_path / "t_test.toml"
    path.write_text(textwrap.dedent(text))
    return run_tests(policies, [path])


def test_the_shipped_policy_tests_pass():
    results = run_tests(Policies.load(SHIPPED), sorted((SHIPPED / "tests").glob("*.toml")))
    assert len(results) >= 10
    assert [r for r in results if not r.passed] == []


def test_passing_and_failing_cases(tmp_path, policies):
    results = run(tmp_path, policies, """
        [[case]]
        name = "pass"
        kind = "admit"
        input = { state = { nbytes = 5000, span = { start = 16, end = 32 } } }
        expect.allowed = false
        expect.deciding = ["big"]
        expect.messages = ["too big"]
        expect.warnings = ["mid"]
        expect.audits = ["watch"]
        expect.fired = ["big", "mid", "watch"]
        expect.errors = 0

        [[case]]
        name = "fail"
        kind = "admit"
        input = { state = { nbytes = 5000 } }
        expect = { allowed = true, deciding = [], errors = ["nope"] }
    """)
    assert [(r.name, r.passed) for r in results] == [("pass", True), ("fail", False)]
    assert results[0].failures == () and results[0].verdict is not None
    why = f"decided by rule big ({tmp_path / 'policies' / 'default.toml'}:3)"  # the rule's `name` line
    assert results[1].failures == (
        f"allowed: expected True, got False; {why}",
        f"deciding: expected [], got ['big']; {why}",
        f"errors: expected ['nope'], got ['broken']; {why}",
    )
    assert results[1].file == str(tmp_path / "t_test.toml")


def test_counts_for_warnings_audits_errors_and_messages(tmp_path, policies):
    results = run(tmp_path, policies, """
        [[case]]
        name = "counts"
        kind = "admit"
        input = { state = { nbytes = 500 } }
        expect = { warnings = 1, audits = 1, errors = 1, messages = 0 }

        [[case]]
        name = "wrong counts"
        kind = "admit"
        input = { state = { nbytes = 500 } }
        expect = { warnings = 2, errors = 0 }
    """)
    assert results[0].passed, results[0].failures
    why = "no rule decided (fired: mid, watch): default allowed"
    assert results[1].failures == (f"warnings: expected 2, got 1; {why}", f"errors: expected 0, got 1; {why}")


def test_placement_expectations(tmp_path, policies):
    results = run(tmp_path, policies, """
        [[case]]
        name = "place"
        kind = "place"
        input = { state = { span = { start = 0, end = 64 } } }
        expect = { tier = "dram", ttl_s = 3600, priority = 4.0, deciding = ["hot"] }

        [[case]]
        name = "place wrong"
        kind = "place"
        input = { state = { span = { start = 0, end = 64 } } }
        expect = { tier = "disk" }

        [[case]]
        name = "placement of an admit verdict is none"
        kind = "admit"
        input = { state = { nbytes = 5 } }
        expect = { tier = "dram" }
    """)
    assert results[0].passed, results[0].failures
    assert results[1].failures == (f"tier: expected 'disk', got 'dram'; decided by rule hot "
                                   f"({tmp_path / 'policies' / 'default.toml'}:23)",)  # fmt: skip
    assert results[2].failures == ("tier: expected 'dram', got None; no rule matched: default allowed",)


def test_unknown_case_keys(tmp_path, policies):
    (result,) = run(tmp_path, policies, """
        [[case]]
        name = "typo"
        kind = "admit"
        inputs = { state = { nbytes = 5 } }
        expect = { allowed = true }
    """)
    assert not result.passed and result.failures == ("unknown case keys ['inputs']",)


def test_unknown_expect_keys(tmp_path, policies):
    (result,) = run(tmp_path, policies, """
        [[case]]
        name = "typo"
        kind = "admit"
        input = { state = { nbytes = 5 } }
        expect = { allowed = true, alowed = true, ttl = 5 }
    """)
    assert not result.passed and result.failures == ("unknown expect keys ['alowed', 'ttl']",)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ("{ state = { nbyts = 5 } }", "invalid policy test input: state.nbyts: unknown field"),
        ("{ state = { span = { strat = 0 } } }", "invalid policy test input: state.span.strat: unknown field"),
        ("{ state = { nbytes = 'big' } }", "invalid policy test input: state.nbytes: expected integer, got string"),
        ("{ state = 5 }", "invalid policy test input: state: expected a table, got int"),
        ("{ request = { tenant = 3 } }", "invalid policy test input: request.tenant: expected string, got integer"),
        ("{ match = { tokns = 5 } }", "match.tokns: unknown field (one of tokens, blocks, tier"),
        ("{ match = { tokens = 'x' } }", "invalid policy test input: match.tokens: expected int, got str"),
        ("{ match = { tier = 'dram' } }", "invalid policy test input: match.tokens: required field is missing"),
        ("{ match = { tokens = 5, shared = 1 } }", "match.shared: expected bool, got int"),
        ("{ cost = { gain = 5 } }", "invalid policy test input: cost.gain: unknown field"),
        ("{ cost = { gain_ms = true } }", "invalid policy test input: cost.gain_ms: expected float, got bool"),
        ("{ sate = {} }", "invalid policy test input: sate: unknown input"),
        ("{ now = 'yesterday' }", "Invalid isoformat string"),
    ],
)
def test_bad_inputs_fail_the_case_naming_the_path(tmp_path, policies, inputs, message):
    (result,) = run(tmp_path, policies, f"""
        [[case]]
        name = "bad input"
        kind = "admit"
        input = {inputs}
        expect = {{ allowed = true }}
    """)
    assert not result.passed and result.verdict is None
    assert len(result.failures) == 1 and message in result.failures[0], result.failures


def test_unknown_kind_and_unknown_policy(tmp_path, policies):
    results = run(tmp_path, policies, """
        [[case]]
        name = "kind"
        kind = "evict"
        expect = { allowed = true }

        [[case]]
        name = "policy"
        policy = "defualt"
        kind = "admit"
        expect = { allowed = true }
    """)
    assert results[0].failures == ("unknown rule kind 'evict' (one of admit, reuse, place, share, route)",)
    assert results[1].failures == ("unknown policy 'defualt' (have: default)",)


def test_unreadable_and_bad_test_files(tmp_path, policies):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[case]\n")
    extra = tmp_path / "extra.toml"
    extra.write_text('[[case]]\nname = "ok"\nkind = "admit"\nexpect = { allowed = false }\n[settings]\nx = 1\n')
    results = run_tests(policies, [bad, tmp_path / "missing.toml", extra])
    assert [(Path(r.file).name, r.name, r.passed) for r in results] == [
        ("bad.toml", "<file>", False),
        ("missing.toml", "<file>", False),
        ("extra.toml", "ok", True),
        ("extra.toml", "<file>", False),
    ]
    assert results[0].failures[0].startswith("cannot read tests: ")
    assert results[3].failures == ("unknown top-level keys ['settings']",)


def test_unnamed_cases_are_numbered(tmp_path, policies):
    results = run(tmp_path, policies, '[[case]]\nkind = "admit"\n\n[[case]]\nkind = "admit"\n')
    assert [r.name for r in results] == ["case 0", "case 1"]
    assert all(r.passed for r in results)  # no expectation: evaluating without error is the test


def test_build_activation():
    inputs = {"state": {"nbytes": 7}, "request": {"tenant": "t"}, "match": {"tokens": 3}, "cost": {"gain_ms": 2}}
    act = build_activation({**inputs, "tier": "disk", "node": "n", "now": "2024-01-01T00:00:00+00:00"})
    assert act["state"].nbytes == 7 and act["state"].span.end == sample_state()["span"]["end"]
    assert act["request"].tenant == "t" and list(act["request"].token_ids) == sample_request()["token_ids"]
    assert act["match"].tokens == 3
    assert act["cost"].gain_ms == 2.0 and isinstance(act["cost"].gain_ms, float)
    assert (act["tier"], act["node"]) == ("disk", "n")
    assert act["now"] == dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    assert set(build_activation({})) == {"request"}
    with pytest.raises(ContractError):
        build_activation({"state": {"nbytes": -1}})


def test_what_a_kind_needs_is_completed(tmp_path, policies):
    results = run(tmp_path, policies, """
        [[case]]
        name = "admit without state: the sample state (32 KiB) is used"
        kind = "admit"
        expect = { allowed = false, deciding = ["big"], errors = ["broken"] }

        [[case]]
        name = "reuse needs a match"
        kind = "reuse"
        expect = { allowed = true }
    """)
    assert results[0].passed, results[0].failures
    assert results[1].failures == ("invalid policy test input: match: required for reuse cases (at least `tokens`)",)
    act = build_activation({"match": {"tokens": 5, "tier": "disk"}}, "reuse")
    assert act["tier"] == "disk" and act["cost"].gain_ms == 0.0
    act = build_activation({"match": {"tokens": 5, "tier": "disk"}, "tier": "dram"}, "reuse")
    assert act["tier"] == "dram"
    assert "state" in build_activation({}, "place") and "state" not in build_activation({}, None)


def test_a_failed_case_names_the_deciding_rules_with_file_and_line_or_the_default(tmp_path):
    """`allowed: expected True, got False` alone leaves the author guessing which rule, inherited or not, decided."""
    root = tmp_path / "policies"
    (root / "tenants").mkdir(parents=True)
    (root / "default.toml").write_text('default_tier = "disk"\n\n[[admit]]\nname = "big"\n'
                                       'when = "state.nbytes > 100"\n')  # fmt: skip
    (root / "tenants" / "acme.toml").write_text('[[admit]]\nname = "tmp"\nwhen = \'state.namespace.scope == "tmp"\'\n')
    results = run(tmp_path, Policies.load(root), """
        [[case]]
        name = "both deny"
        policy = "acme"
        kind = "admit"
        input = { state = { nbytes = 500, namespace = { tenant = "acme", scope = "tmp" } } }
        expect.allowed = true

        [[case]]
        name = "nothing fires"
        policy = "acme"
        kind = "admit"
        input = { state = { nbytes = 5 } }
        expect.allowed = false

        [[case]]
        name = "the default tier"
        policy = "acme"
        kind = "place"
        expect.tier = "dram"
    """)
    assert [r.failures for r in results] == [
        (f"allowed: expected True, got False; decided by rules tmp ({root / 'tenants' / 'acme.toml'}:2), "
         f"big ({root / 'default.toml'}:4)",),
        ("allowed: expected False, got True; no rule matched: default allowed",),
        ("tier: expected 'dram', got 'disk'; no rule matched: default tier 'disk'",),
    ]
