"""Condition coverage of policy unit tests (`nexuskv policy test --coverage`): counts computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nexuskv.cel.compiled import CelSyntaxError
from nexuskv.cli import cli
from nexuskv.policy.authoring.coverage import (
    Condition,
    Coverage,
    CoverageCollector,
    RuleCoverage,
    conditions,
    measure,
    render,
)
from nexuskv.policy.authoring.testing import run_tests
from nexuskv.policy.loader import Policies

SHIPPED = Path(__file__).resolve().parents[3] / "policies"

# Line numbers matter: the tests below assert file positions of conditions.
DEFAULT = """\
name = "default"

[variables]
big = "state.nbytes > 1000"
per_token = "state.nbytes / state.raw_nbytes"

[[admit]]
name = "guard"
when = '!(variables.big || has(state.parent_key)) && [1, 2].exists(g, g == state.group)'

[[admit]]
name = "ratio"
failure = "ignore"
when = '''variables.per_token > 100
  ? state.codec == "raw"
  : state.group > 5'''

[[reuse]]
name = "never-reached"
when = "match.tokens > 1 || match.shared"
"""

CHILD = """\
name = "child"
extends = "default"

[variables]
big = "state.nbytes > 100"

[[admit]]
name = "tmp"
match = ['state.codec == "raw"']
when = 'state.namespace.scope.startsWith("tmp-")'
"""

CASES = """\
[[case]]
name = "c1: big, no matching group, per_token 2048"
policy = "default"
kind = "admit"
input = { state = { raw_nbytes = 16 } }
expect = { allowed = false, deciding = ["ratio"] }

[[case]]
name = "c2: small, group 2, per_token 50"
policy = "default"
kind = "admit"
input = { state = { nbytes = 500, raw_nbytes = 10, group = 2 } }
expect = { allowed = false, deciding = ["guard"] }

[[case]]
name = "c3: child, big by the child's variable, per_token divides by zero"
policy = "child"
kind = "admit"
input = { state = { nbytes = 500, namespace = { tenant = "child", scope = "tmp-1" } } }
expect = { allowed = false, deciding = ["tmp"], errors = ["ratio"] }
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "policies"
    (root / "tenants").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "default.toml").write_text(DEFAULT)
    (root / "tenants" / "child.toml").write_text(CHILD)
    (root / "tests" / "cases.toml").write_text(CASES)
    return root


def _measure(root: Path) -> Coverage:
    results, cov = measure(Policies.load(root), sorted((root / "tests").glob("*.toml")))
    assert [r.failures for r in results] == [(), (), ()]
    return cov


def _rule(cov: Coverage, name: str, file: str | None = None) -> RuleCoverage:
    got = [r for f in cov.files for r in f.rules if r.name == name and (file is None or r.file.endswith(file))]
    assert len(got) == 1, got
    return got[0]


def _counts(rule: RuleCoverage) -> list[tuple[str, str, int, int, int]]:
    return [(c.expression, c.source, c.true, c.false, c.error) for c in rule.conditions]


def test_conditions_are_the_leaves_of_the_boolean_structure():
    def texts(src: str) -> list[str]:
        return [src[a:b] for a, b in conditions(src)]

    assert texts("a") == ["a"]
    assert texts("(a.b == 1)") == ["a.b == 1"]
    assert texts('!(x.a == 1 || has(x.b)) && [1].exists(i, i > 0 && y) ? z : true') == [
        "x.a == 1", "has(x.b)", "[1].exists(i, i > 0 && y)", "z"]  # fmt: skip
    assert texts("(a ? b : c) == d || -x < 0") == ["(a ? b : c) == d", "-x < 0"]  # operators inside a leaf stay
    assert texts("true") == []  # a constant is no condition
    assert texts("a &&\n  !b") == ["a", "b"]
    with pytest.raises(CelSyntaxError):
        conditions("a &&")


def test_rule_and_condition_counts(tree):
    cov = _measure(tree)
    assert cov.cases == 3
    guard = _rule(cov, "guard")
    assert (guard.file, guard.kind, guard.line) == (str(tree / "default.toml"), "admit", 8)
    # c1 (default), c2 (default) and c3 (child inherits guard): c3 sees the child's `big` (nbytes > 100).
    assert (guard.evaluated, guard.fired, guard.not_fired, guard.errors) == (3, 1, 2, 0)
    assert (guard.when_true, guard.when_false, guard.when_error) == (1, 2, 0)
    assert _counts(guard) == [
        ("when", "variables.big", 2, 1, 0),
        ("when", "has(state.parent_key)", 0, 3, 0),
        ("when", "[1, 2].exists(g, g == state.group)", 1, 2, 0),
    ]
    assert [c.missing for c in guard.conditions] == ["", "never true", ""]
    assert guard.decision and guard.decision_covered


def test_an_erroring_condition_and_a_ternary(tree):
    ratio = _rule(_measure(tree), "ratio")
    # per_token: 32768 / 16 = 2048 (c1), 500 / 10 = 50 (c2), 500 / 0 (c3: error, also the rule's).
    assert (ratio.evaluated, ratio.fired, ratio.not_fired, ratio.errors) == (3, 1, 1, 1)
    assert (ratio.when_true, ratio.when_false, ratio.when_error) == (1, 1, 1)
    assert _counts(ratio) == [
        ("when", "variables.per_token > 100", 1, 1, 1),
        ("when", 'state.codec == "raw"', 3, 0, 0),
        ("when", "state.group > 5", 0, 3, 0),
    ]
    assert [c.covered for c in ratio.conditions] == [True, False, False]
    assert [c.missing for c in ratio.conditions] == ["", "never false", "never true"]
    # Positions: file line and column, and line and column inside the multi-line expression.
    assert [(c.line, c.column, c.expr_line, c.expr_column) for c in ratio.conditions] == [
        (14, 11, 1, 1), (15, 5, 2, 5), (16, 5, 3, 5)]  # fmt: skip


def test_file_positions_and_an_unreached_rule(tree):
    cov = _measure(tree)
    guard = _rule(cov, "guard")
    assert [(c.line, c.column) for c in guard.conditions] == [(9, 11), (9, 28), (9, 54)]
    never = _rule(cov, "never-reached")
    assert (never.evaluated, never.fired, never.when_true, never.when_false) == (0, 0, 0, 0)
    assert _counts(never) == [("when", "match.tokens > 1", 0, 0, 0), ("when", "match.shared", 0, 0, 0)]
    assert {c.missing for c in never.conditions} == {"never evaluated"}


def test_an_inherited_rule_counts_at_its_file_and_match_conditions(tree):
    cov = _measure(tree)
    assert [f.file for f in cov.files] == [str(tree / "default.toml"), str(tree / "tenants" / "child.toml")]
    assert [r.name for r in cov.files[0].rules] == ["guard", "ratio", "never-reached"]
    tmp = _rule(cov, "tmp")
    assert tmp.file == str(tree / "tenants" / "child.toml")
    assert (tmp.evaluated, tmp.fired, tmp.line) == (1, 1, 8)
    assert _counts(tmp) == [("match[0]", 'state.codec == "raw"', 1, 0, 0),
                            ("when", 'state.namespace.scope.startsWith("tmp-")', 1, 0, 0)]  # fmt: skip
    assert [(c.line, c.column) for c in tmp.conditions] == [(9, 11), (10, 9)]


def test_totals(tree):
    cov = _measure(tree)
    # Conditions: guard 3 (2 covered), ratio 3 (1), never-reached 2 (0), tmp 2 (0).
    t = cov.totals
    assert (t.rules, t.rules_evaluated, t.rules_fired) == (4, 3, 3)
    assert (t.conditions, t.conditions_covered, t.decisions, t.decisions_covered) == (10, 3, 4, 2)
    assert t.conditions_pct == 30.0
    assert [(f.totals.conditions, f.totals.conditions_covered) for f in cov.files] == [(8, 3), (2, 0)]
    d = cov.to_dict()
    assert d["totals"]["rules_evaluated_pct"] == 75.0 and d["totals"]["decisions_pct"] == 50.0
    assert d["files"][0]["rules"][0]["conditions"][1] == {
        "expression": "when", "source": "has(state.parent_key)", "line": 9, "column": 28, "expr_line": 1,
        "expr_column": 20, "true": 0, "false": 3, "error": 0, "covered": False, "missing": "never true"}  # fmt: skip


def test_run_tests_still_works_without_an_observer_and_counts_failing_cases(tree, tmp_path):
    policies = Policies.load(tree)
    assert all(r.passed for r in run_tests(policies, [tree / "tests" / "cases.toml"]))
    bad = tmp_path / "bad.toml"
    bad.write_text('[[case]]\npolicy = "default"\nkind = "admit"\nexpect = { allowed = false }\n'
                   '[[case]]\npolicy = "nope"\nkind = "admit"\n')  # fmt: skip
    collector = CoverageCollector(policies)
    results = run_tests(policies, [bad], observe=collector.observe)
    assert [r.passed for r in results] == [False, False]
    cov = collector.result()
    assert cov.cases == 1  # the failing case ran; the one naming an unknown policy did not
    assert _rule(cov, "guard").evaluated == 1 and _rule(cov, "tmp").evaluated == 0


def test_render(tree):
    text = render(_measure(tree))
    assert "coverage of 3 test case(s):" in text
    assert "  admit guard (line 8): evaluated 3, fired 1\n    when: true 1, false 2\n" in text
    assert "    9:28    has(state.parent_key)  T 0 F 3  <- never true" in text
    assert "  admit ratio (line 12): evaluated 3, fired 1, error 1\n    when: true 1, false 1, error 1\n" in text
    assert "    14:11   variables.per_token > 100  T 1 F 1 E 1\n" in text
    assert "  reuse never-reached (line 19): evaluated 0, fired 0  <- no test reaches it" in text
    assert "    20:9    match.tokens > 1  T 0 F 0  <- never evaluated" in text
    assert text.endswith("total: rules 3/4 evaluated (75.0%), 3/4 fired (75.0%); conditions 3/10 covered (30.0%); "
                         "decisions 2/4 covered (50.0%)")  # fmt: skip


def test_cli_text_json_and_min_coverage(tree, tmp_path):
    runner = CliRunner()
    base = ["--log-level", "error", "policy", "test", str(tree)]
    plain = runner.invoke(cli, base)
    assert plain.exit_code == 0 and "coverage" not in plain.output
    res = runner.invoke(cli, [*base, "--coverage"])
    assert res.exit_code == 0
    assert res.output.startswith("policy tests: 3 passed, 0 failed\n\ncoverage of 3 test case(s):")
    assert "never true" in res.output and "conditions 3/10 covered (30.0%)" in res.output
    out = tmp_path / "cov.json"
    res = runner.invoke(cli, [*base, "--coverage-json", str(out), "--min-coverage", "30"])
    assert res.exit_code == 0 and "coverage of" not in res.output
    data = json.loads(out.read_text())
    assert data["cases"] == 3 and data["totals"]["conditions_covered"] == 3
    assert data == _measure(tree).to_dict()
    res = runner.invoke(cli, [*base, "--min-coverage", "30.5"])
    assert res.exit_code == 1
    assert "condition coverage 30.0% is below --min-coverage 30.5%" in res.stderr
    (tree / "tests" / "cases.toml").write_text(CASES.replace('deciding = ["ratio"]', 'deciding = ["guard"]'))
    res = runner.invoke(cli, [*base, "--coverage"])
    assert res.exit_code == 1 and "FAIL" in res.output and "coverage of 3 test case(s)" in res.output


def _shipped() -> Coverage:
    results, cov = measure(Policies.load(SHIPPED), sorted((SHIPPED / "tests").glob("*.toml")))
    assert results and all(r.passed for r in results)
    return cov


def test_shipped_policies_hand_checked_rules():
    cov = _shipped()
    # default's bounded-payload: admit cases of default (2), chat (2), rag (1), strict (1); 300 MiB twice.
    bounded = _rule(cov, "bounded-payload")
    assert (bounded.evaluated, bounded.fired, bounded.not_fired) == (6, 2, 4)
    assert _counts(bounded) == [("when", "variables.big_payload", 2, 4, 0)]
    # checksummed: the sample checksum is blake2b-128, so the xxh3 half is never true, the blake2b half never false.
    checksummed = _rule(cov, "checksummed")
    assert (checksummed.evaluated, checksummed.fired, checksummed.when_true, checksummed.when_false) == (6, 0, 0, 6)
    assert _counts(checksummed) == [("when", 'state.checksum.startsWith("xxh3-128:")', 0, 6, 0),
                                    ("when", 'state.checksum.startsWith("blake2b-128:")', 6, 0, 0)]  # fmt: skip
    assert [(c.line, c.column) for c in checksummed.conditions] == [(23, 11), (23, 53)]
    # strict's trusted-nodes-only: two strict route cases, both with a `trust` label (low, high).
    trusted = _rule(cov, "trusted-nodes-only")
    assert (trusted.evaluated, trusted.fired, trusted.when_true, trusted.when_false) == (2, 1, 1, 1)
    assert _counts(trusted) == [("when", '"trust" in target.labels', 2, 0, 0),
                                ("when", 'target.labels["trust"] != "high"', 1, 1, 0)]  # fmt: skip
    # Overridden: strict's own large-to-disk is another rule than default's (place cases of default, chat, rag).
    assert _rule(cov, "large-to-disk", "default.toml").evaluated == 4
    assert _rule(cov, "large-to-disk", "strict.toml").evaluated == 1
    # No test runs a rag reuse case.
    assert _rule(cov, "documents-need-whole-pages").evaluated == 0


def test_shipped_policies_totals_are_consistent():
    cov = _shipped()
    t = cov.totals
    assert cov.cases == 20
    assert (t.rules, t.rules_evaluated, t.rules_fired, t.conditions, t.conditions_covered) == (21, 20, 18, 25, 9)
    assert (t.decisions, t.decisions_covered) == (19, 8)
    assert 0 <= t.rules_fired <= t.rules_evaluated <= t.rules and 0 <= t.conditions_covered <= t.conditions
    assert 0 <= t.decisions_covered <= t.decisions <= t.rules
    for field in ("rules", "rules_evaluated", "rules_fired", "conditions", "conditions_covered", "decisions"):
        assert getattr(t, field) == sum(getattr(f.totals, field) for f in cov.files), field
    for f in cov.files:
        for r in f.rules:
            assert r.evaluated == r.fired + r.not_fired + r.errors == r.when_true + r.when_false + r.when_error
            for c in r.conditions:
                assert isinstance(c, Condition) and c.true + c.false + c.error == r.evaluated
                assert c.line is not None and c.column is not None


def test_the_documented_example_is_real_output(monkeypatch):
    doc = (SHIPPED.parent / "docs" / "policies.md").read_text()
    section = doc[doc.index("## Test coverage") :]
    example = section[section.index("$ nexuskv policy test policies --coverage\n") :].split("```")[0]
    monkeypatch.chdir(SHIPPED.parent)
    res = CliRunner().invoke(cli, ["--log-level", "error", "policy", "test", "policies", "--coverage"])
    assert res.exit_code == 0
    lines = [ln for ln in example.splitlines()[1:] if ln.strip() and ln.strip() != "..."]
    assert len(lines) > 20
    for ln in lines:
        assert ln in res.output.splitlines(), ln
