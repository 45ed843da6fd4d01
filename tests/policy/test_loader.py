"""Policy loading: every kind of bad input is a precise problem (file, rule, line, column, message), all at once."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv.policy.loader import Policies, PolicyError, PolicyProblem, parse_policy_file
from nexuskv.policy.model import Effect, Failure, PolicyFile

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "policies"


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def check(root: Path, files: dict[str, str], **kw) -> list[PolicyProblem]:
    return Policies.check(write(root, files), **kw)


def one(root: Path, files: dict[str, str], **kw) -> PolicyProblem:
    problems = check(root, files, **kw)
    assert len(problems) == 1, "\n".join(map(str, problems))
    return problems[0]


def at(p: PolicyProblem) -> tuple[str, str, int | None, int | None]:
    return Path(p.file).name, p.rule, p.line, p.column


# ------------------------------------------------------------------------------------------ file format


def test_toml_syntax_error_is_located_by_tomllib(tmp_path):
    p = one(tmp_path, {"default.toml": 'name = "default"\n[[admit]]\nname = "x\nwhen = "true"\n'})
    assert at(p) == ("default.toml", "", 3, 10)
    assert p.message.startswith("TOML syntax error: ")
    assert "(at line" not in p.message  # the position is in line/column, not repeated in the text
    assert str(p) == f"{tmp_path / 'default.toml'}:3:10: {p.message}"


def test_unknown_top_level_key(tmp_path):
    p = one(tmp_path, {"default.toml": 'description = "d"\nnmae = "x"\n'})
    assert at(p) == ("default.toml", "", 2, 1)
    assert p.message == "nmae: unknown field (did you mean 'name'?)"


def test_unknown_rule_kind(tmp_path):
    p = one(tmp_path, {"default.toml": 'name = "default"\n\n[[evict]]\nname = "x"\nwhen = "true"\n'})
    assert at(p) == ("default.toml", "", 3, 1)
    assert p.message == "evict: unknown rule kind (one of admit, reuse, place, share, route)"


def test_a_mistyped_key_or_rule_kind_gets_a_did_you_mean(tmp_path):
    """Issue 35: TOML keys and rule kinds get a suggestion, as CEL fields do."""
    files = {"default.toml": '[[reuse]]\nname = "r"\nwhen = "true"\nmax_tokns = 3\n\n[[reuze]]\nname = "x"\n'}
    got = sorted(p.message for p in check(tmp_path, files))
    assert got == ["reuse[0].max_tokns: unknown field (did you mean 'max_tokens'?)",
                   "reuze: unknown rule kind (did you mean 'reuse'?) (one of admit, reuse, place, share, route)"]


def test_a_mistyped_cel_method_gets_a_did_you_mean(tmp_path):
    p = one(tmp_path, {"default.toml": '[[reuse]]\nname = "r"\nwhen = \'request.tenant.startswith("a")\'\n'})
    assert p.message == "when: unknown method 'startswith' on string (did you mean 'startsWith'?)"
    assert at(p) == ("default.toml", "r", 3, 24)


def test_a_file_with_structural_problems_still_has_its_cel_problems_listed_and_never_loads(tmp_path):
    """Issue 35: every problem of a file at once, its CEL errors beside a mistyped key; nothing of it is usable."""
    files = {"default.toml": '[[reuse]]\nname = "r"\nwhen = "request.tenantt == 1"\neffct = "warn"\n\n'
                             '[[admit]]\nname = "a"\nwhen = "state.nbytes > \'x\'"\n',
             "tenants/t.toml": '[[reuse]]\nname = "t"\nwhen = "true"\n'}  # fmt: skip
    problems = check(tmp_path, files)
    assert sorted((p.rule, p.line, p.message.split(":")[0]) for p in problems) == [
        ("a", 8, "when"), ("r", 3, "when"), ("r", 4, "reuse[0].effct")]
    policies, again = Policies._load(tmp_path, {})
    assert again == problems and policies.sets == {}  # neither the file nor the tenant extending it is usable
    with pytest.raises(PolicyError):
        Policies.load(tmp_path)


def test_every_cel_problem_of_a_rule_with_a_mistyped_key_is_listed(tmp_path):
    """Review finding: a rule's `match` and `max_tokens` problems and a broken variable were dropped beside a typo."""
    files = {"default.toml": 'nmae = "x"\n\n[variables]\nv = "request.nope"\n\n[[reuse]]\nname = "r"\n'
                             'when = "true"\nmatch = ["request.tenantt == 1"]\nmax_tokens = "request.x"\n'
                             'effct = "warn"\n'}  # fmt: skip
    got = sorted(p.message.split(":")[0] for p in check(tmp_path, files))
    assert got == ["match[0]", "max_tokens", "nmae", "reuse[0].effct", "variable 'v'"], got


def test_unknown_key_in_a_rule_is_located_at_its_line(tmp_path):
    text = """
        [[admit]]
        name = "a"
        when = "true"

        [[admit]]
        name = "b"
        when = "true"
          effct = "warn"
    """
    p = one(tmp_path, {"default.toml": text})
    assert at(p) == ("default.toml", "b", 8, 3)
    assert p.message == "admit[1].effct: unknown field (did you mean 'effect'?)"


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ('name = "a"\nwhen = 3\n', 3, "admit[0].when: expected string, got integer"),
        (
            'name = "a"\nwhen = "true"\neffect = "block"\n',
            4,
            "admit[0].effect: 'block' is not one of ['deny', 'warn', 'audit']",
        ),
        ('name = "a"\nwhen = "true"\nmatch = "true"\n', 4, "admit[0].match: expected array, got string"),
        ('name = "a"\nwhen = "true"\nfailure = "panic"\n', 4, "admit[0].failure: 'panic' is not one of"),
        ('name = "a"\n', 1, "admit[0].when: required field is missing"),
    ],
)
def test_wrong_or_missing_values_in_a_rule(tmp_path, body, line, message):
    p = one(tmp_path, {"default.toml": "[[admit]]\n" + body})
    assert at(p) == ("default.toml", "a", line, 1)
    assert p.message.startswith(message)


def test_missing_rule_name(tmp_path):
    p = one(tmp_path, {"default.toml": '[[admit]]\nname = "a"\nwhen = "true"\n[[reuse]]\nwhen = "true"\n'})
    assert at(p) == ("default.toml", "", 4, 1)  # the rule's header: there is no name line to point at
    assert p.message == "reuse[0].name: required field is missing"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('failure = "panic"\n', "failure: 'panic' is not one of ['deny', 'ignore']"),
        ('min_gain_ms = "fast"\n', "min_gain_ms: expected number, got string"),
        ("min_gain_ms = -1\n", "min_gain_ms: -1 is less than the minimum of 0"),
        ("max_cost = 0\n", "max_cost: 0 is less than the minimum of 1"),
        ("schema_version = 2\n", "schema_version: version 2 is not supported"),
        ('variables = { a = 1 }\n', "variables.a: expected string, got integer"),
    ],
)
def test_wrong_settings(tmp_path, text, message):
    p = one(tmp_path, {"default.toml": 'description = "x"\n' + text})
    assert at(p) == ("default.toml", "", 2, 1)
    assert p.message.startswith(message)


def test_wrong_variable_type_in_a_variables_table(tmp_path):
    p = one(tmp_path, {"default.toml": '[variables]\nok = "true"\nbad = 3\n'})
    assert at(p) == ("default.toml", "", 3, 1)
    assert p.message == "variables.bad: expected string, got integer"


def test_duplicate_rule_names_point_at_the_second(tmp_path):
    text = '[[admit]]\nname = "a"\nwhen = "true"\n\n[[admit]]\n  name = "a"\nwhen = "false"\n'
    p = one(tmp_path, {"default.toml": text})
    assert at(p) == ("default.toml", "a", 6, 3)
    assert p.message == "duplicate admit rule name 'a'"


def test_same_rule_name_in_two_kinds_is_fine(tmp_path):
    text = '[[admit]]\nname = "a"\nwhen = "true"\n[[reuse]]\nname = "a"\nwhen = "true"\n'
    assert check(tmp_path, {"default.toml": text}) == []


# ------------------------------------------------------------------------------------------ extends


def test_extends_cycle_is_reported_in_each_file_of_it(tmp_path):
    problems = check(tmp_path, {"default.toml": "", "tenants/a.toml": 'extends = "b"\n',
                                "tenants/b.toml": 'description = "b"\nextends = "a"\n'})  # fmt: skip
    got = sorted((at(p), p.message) for p in problems)
    assert got == [
        (("a.toml", "", 1, 1), "extends 'b': cycle b -> a -> b"),
        (("b.toml", "", 2, 1), "extends 'a': cycle a -> b -> a"),
    ]


def test_extends_self(tmp_path):
    p = one(tmp_path, {"default.toml": "", "tenants/a.toml": 'extends = "a"\n'})
    assert (at(p), p.message) == (("a.toml", "", 1, 1), "extends 'a': cycle a -> a")


def test_default_extending_itself_is_a_cycle_too(tmp_path):
    p = one(tmp_path, {"default.toml": 'extends = "default"\n'})
    assert p.message == "extends 'default': cycle default -> default"


def test_missing_parent(tmp_path):
    p = one(tmp_path, {"default.toml": "", "tenants/a.toml": '# tenant a\nextends = "nope"\n'})
    assert (at(p), p.message) == (("a.toml", "", 2, 1), "extends 'nope': no such policy (have: a, default)")


def test_two_files_defining_the_same_policy(tmp_path):
    p = one(tmp_path, {"default.toml": "", "x.toml": 'name = "x"\n', "tenants/x.toml": '# b\nname = "x"\n'})
    assert at(p) == ("x.toml", "", 2, 1) and Path(p.file) == tmp_path / "tenants" / "x.toml"
    assert p.message == f"policy 'x' is also defined in {tmp_path / 'x.toml'}"


def test_a_tenant_file_named_default_clashes_with_the_default(tmp_path):
    p = one(tmp_path, {"default.toml": "", "tenants/default.toml": ""})
    assert Path(p.file) == tmp_path / "tenants" / "default.toml"
    assert "policy 'default' is also defined in" in p.message


def test_without_a_default_tenants_extend_nothing(tmp_path):
    pol = Policies.load(write(tmp_path, {"tenants/a.toml": '[[admit]]\nname = "x"\nwhen = "true"\n'}))
    assert pol.tenants() == ["a"]
    with pytest.raises(PolicyError, match="no policy for tenant 'b' and no default"):
        pol.for_tenant("b")


def test_explicit_extends_default_without_a_default_is_missing(tmp_path):
    p = one(tmp_path, {"tenants/a.toml": 'extends = "default"\n'})
    assert p.message == "extends 'default': no such policy (have: a)"


# ------------------------------------------------------------------------------------------ CEL problems


def rule_file(kind: str, body: str) -> dict[str, str]:
    return {"default.toml": f'# header\n[[{kind}]]\nname = "r"\n{body}'}


@pytest.mark.parametrize(
    ("kind", "body", "line", "col", "message"),
    [
        ("admit", 'when = "state.nbytes > > 3"\n', 4, 24, "when: unexpected '>'"),
        ("admit", "when = 'state.nbytes > > 3'\n", 4, 24, "when: unexpected '>'"),
        # An escaped quote before the error shifts the file column by one per backslash.
        (
            "reuse",
            'when = "match.scope == \\"docs\\" && match.tokens > > 1"\n',
            4,
            51,
            "when: unexpected '>'",
        ),
        # Multi-line literal strings: the first newline is trimmed by TOML.
        ("admit", "when = '''\nstate.nbytes > 3 &&\n  state.nbytes < < 4\n'''\n", 6, 18, "when: unexpected '<'"),
        ("admit", "when = '''state.nbytes > 3 &&\n  state.nbytes < < 4'''\n", 5, 18, "when: unexpected '<'"),
        # Multi-line basic string with a line-ending backslash: the expression is one line for CEL.
        ("admit", 'when = """state.nbytes > 3 && \\\n    state.nbytes < < 4"""\n', 5, 20, "when: unexpected '<'"),
        (
            "admit",
            'when = "state.nbyts > 3"\n',
            4,
            15,
            "when: unknown field 'nbyts' on StateDescriptor (did you mean 'nbytes'?)",
        ),
        (
            "admit",
            'when = "state.nbytes + 1.0 > 3.0"\n',
            4,
            22,
            "when: operator '+' is not defined for int and double (no implicit conversion: use double() or int())",
        ),
        ("admit", 'when = "state.nbytes"\n', 4, 9, "when: expression must evaluate to bool, but its type is int"),
        (
            "reuse",
            'when = "true"\nmax_tokens = "match.tokens / 2.0"\n',
            5,
            28,
            "max_tokens: operator '/' is not defined for int and double",
        ),
        (
            "reuse",
            'when = "true"\nmax_tokens = "1.5"\n',
            5,
            15,
            "max_tokens: expression must evaluate to int, but its type is double",
        ),
        (
            "place",
            "priority_expr = \"'high'\"\n",
            4,
            18,
            "priority_expr: expression must evaluate to int or double, but its type is string",
        ),
        (
            "admit",
            'when = "true"\nmessage_expr = "state.nbytes"\n',
            5,
            17,
            "message_expr: expression must evaluate to string, but its type is int",
        ),
        ("place", "tier_expr = 'state.nbytes'\n", 4, 14, "tier_expr: expression must evaluate to string"),
        ("place", "ttl_expr = '3600'\n", 4, 13, "ttl_expr: expression must evaluate to duration"),
        ("place", 'ttl = "forever"\n', 4, 8, "ttl: 'forever': invalid duration 'forever'"),
        ("share", 'scope = "s"\ntenants = ["x"]\nwhen = "state.nbytes > 0"\n', 6, 9, "when: undeclared variable"),
        ("reuse", 'when = "tier == 1"\n', 4, 14, "when: cannot compare string == int (operands must have the same"),
    ],
)
def test_cel_problems_are_located_at_file_line_and_column(tmp_path, kind, body, line, col, message):
    p = one(tmp_path, rule_file(kind, body))
    assert at(p) == ("default.toml", "r", line, col), p
    assert p.message.startswith(message), p.message


def test_the_locator_finds_the_right_match_item_and_skips_text_that_only_looks_the_same(tmp_path):
    text = """
        [[admit]]
        name = "x1"
        match = ["state.nbytes > 0",
                 "state.nbyts > 1"]
        when = "x1"

        [[admit]]
        name = "x2"
        match = ["state.nbytes"]
        when = "state.nbytes"
    """
    problems = check(tmp_path, {"default.toml": text})
    got = [(at(p), p.message.split(":")[0]) for p in problems]
    assert got == [
        (("default.toml", "x1", 4, 17), "match[1]"),
        (("default.toml", "x1", 5, 9), "when"),
        (("default.toml", "x2", 9, 11), "match[0]"),
        (("default.toml", "x2", 10, 9), "when"),
    ]


def test_problems_of_rules_in_inline_tables_still_get_a_position(tmp_path):
    p = one(tmp_path, {"default.toml": 'admit = [{name = "a", when = "state.nbytes > true"}]\n'})
    assert at(p) == ("default.toml", "a", 1, 44)


def test_a_place_rule_without_any_setting(tmp_path):
    p = one(tmp_path, rule_file("place", 'when = "true"\n'))
    assert at(p) == ("default.toml", "r", 3, 1)
    assert p.message == "a place rule must set at least one of tier, ttl, priority (or their _expr)"


def test_broken_variable_is_reported_once_at_its_definition(tmp_path):
    text = """
        [variables]
        ok = "true"
        v = '''
        state.nbytes >
           > 1'''

        [[admit]]
        name = "a"
        when = "variables.v"
    """
    p = one(tmp_path, {"default.toml": text})
    assert at(p) == ("default.toml", "", 5, 4)
    assert p.message == "variable 'v': unexpected '>'"


def test_reuse_rule_using_a_state_variable_names_the_variable_and_the_rule(tmp_path):
    files = {
        "default.toml": '[variables]\nbig = "state.nbytes > 3"\n\n[[admit]]\nname = "ok"\nwhen = "variables.big"\n',
        "tenants/t.toml": '[[reuse]]\nname = "uses-big"\nwhen = "match.tokens > 1 && variables.big"\n',
    }
    p = one(tmp_path, files)
    assert at(p) == ("t.toml", "uses-big", 3, 29)  # at the reference, in the rule's file
    assert p.message == (
        "when: variable 'big' cannot be used in a reuse rule: undeclared variable 'state' "
        f"(variable at {tmp_path / 'default.toml'}:2:8)"
    )


def test_chained_variables_check_in_order(tmp_path):
    text = '[variables]\nb = "variables.a + 1"\na = "1"\n'
    p = one(tmp_path, {"default.toml": text})
    assert at(p) == ("default.toml", "", 2, 16)
    assert p.message.startswith("variable 'b': unknown field 'a'")


def test_expression_over_the_cost_bound_and_a_file_max_cost(tmp_path):
    body = 'when = "request.token_ids.exists(t, t == 0)"\n'
    p = one(tmp_path / "a", rule_file("reuse", body))
    assert at(p) == ("default.toml", "r", 4, 9)
    assert p.message.startswith("when: estimated cost 4000003 exceeds the limit 10000")
    raised = "max_cost = 5000000\n" + rule_file("reuse", body)["default.toml"]
    assert check(tmp_path / "b", {"default.toml": raised}) == []
    # A tenant inherits the budget of its parent...
    files = {"default.toml": "max_cost = 5000000\n", "tenants/t.toml": rule_file("reuse", body)["default.toml"]}
    assert check(tmp_path / "c", files) == []
    # ...and may set a lower one.
    files["tenants/t.toml"] = "max_cost = 100\n" + files["tenants/t.toml"]
    p = one(tmp_path / "d", files)
    assert p.message.startswith("when: estimated cost 4000003 exceeds the limit 100")


def test_unknown_functions_and_plugin_functions(tmp_path):
    from nexuskv.cel.types import plugin_functions

    files = rule_file("admit", 'when = "double_it(state.nbytes) > 3"\n')
    p = one(tmp_path, files)
    assert at(p) == ("default.toml", "r", 4, 9)
    assert "double_it" in p.message
    fns, bad = plugin_functions({"double_it": (lambda x: 2 * x, ["int"], "int")})
    assert bad == []
    assert Policies.check(tmp_path, functions=fns) == []


def test_every_problem_of_a_directory_is_reported_and_nothing_loads(tmp_path):
    files = {
        "default.toml": '[[admit]]\nname = "a"\nwhen = "state.nbyts > 1"\n',
        "tenants/t1.toml": "name = \n",
        "tenants/t2.toml": 'extends = "ghost"\n',
        "tenants/t3.toml": '[[reuse]]\nname = "r"\nwhen = "true"\neffct = "warn"\n',
        "tenants/t4.toml": '[[reuse]]\nname = "r"\nwhen = "match.tokens"\n[[place]]\nname = "p"\n',
        "tenants/fine.toml": '[[reuse]]\nname = "r"\nwhen = "true"\n',
    }
    problems = check(tmp_path, files)
    where = sorted((Path(p.file).name, p.rule, p.line) for p in problems)
    assert where == [
        ("default.toml", "a", 3),
        ("t1.toml", "", 1),
        ("t2.toml", "", 1),
        ("t3.toml", "r", 4),
        ("t4.toml", "p", 5),
        ("t4.toml", "r", 3),
    ]
    # The default's problem shows once, not once per tenant that extends it.
    assert len(problems) == len(set(problems))
    with pytest.raises(PolicyError) as err:
        Policies.load(tmp_path)
    assert err.value.problems == problems
    assert str(err.value) == "\n".join(map(str, problems))


def test_empty_and_missing_directories(tmp_path):
    (tmp_path / "empty").mkdir()
    p = one(tmp_path / "empty", {})
    assert (p.file, p.message) == (str(tmp_path / "empty"), "no policy files (expected default.toml, tenants/*.toml)")
    problems = Policies.check(tmp_path / "missing")
    assert [(p.file, p.message) for p in problems] == [(str(tmp_path / "missing"), "no such policy directory")]
    with pytest.raises(PolicyError, match="no such policy directory"):
        Policies.load(tmp_path / "missing")


def test_unreadable_file(tmp_path):
    model, problems, text = parse_policy_file(tmp_path / "nope.toml")
    assert model is None and text == ""
    assert problems[0].message.startswith("cannot read: ")


# ------------------------------------------------------------------------------------------ good input


def test_the_shipped_policies_load():
    pol = Policies.load(SHIPPED)
    assert pol.tenants() == ["chat", "default", "rag", "strict"]
    assert Policies.check(SHIPPED) == []
    chat = pol.for_tenant("chat")
    assert chat.files == (str(SHIPPED / "tenants" / "chat.toml"), str(SHIPPED / "default.toml"))
    assert chat.rule_names("admit") == ["no-tmp-sessions", "bounded-payload", "checksummed"]
    assert chat.min_gain_ms == 0.2 and chat.default_tier == "dram" and chat.failure is Failure.DENY
    assert pol.for_tenant("default").min_gain_ms == 0.5


def test_parse_policy_file_defaults_the_name_to_the_file_stem(tmp_path):
    write(tmp_path, {"tenants/acme.toml": '[[admit]]\nname = "a"\nwhen = "true"\neffect = "warn"\n'})
    model, problems, _ = parse_policy_file(tmp_path / "tenants" / "acme.toml")
    assert problems == []
    assert isinstance(model, PolicyFile)
    assert model.name == "acme" and model.extends == "" and model.admit[0].effect is Effect.WARN


def test_revisions_are_content_hashes(tmp_path):
    src = (SHIPPED / "default.toml").read_text()
    shutil.copytree(SHIPPED, tmp_path / "a", ignore=shutil.ignore_patterns("tests"))
    shutil.copytree(SHIPPED, tmp_path / "b", ignore=shutil.ignore_patterns("tests"))
    a, b = Policies.load(tmp_path / "a"), Policies.load(tmp_path / "b")
    assert a.revision == b.revision and len(a.revision) == 16
    assert {t: a.for_tenant(t).revision for t in a.tenants()} == {t: b.for_tenant(t).revision for t in b.tenants()}
    assert len({a.for_tenant(t).revision for t in a.tenants()}) == 4

    (tmp_path / "b" / "default.toml").write_text(src.replace("min_gain_ms = 0.5", "min_gain_ms = 0.6"))
    c = Policies.load(tmp_path / "b")
    assert c.revision != a.revision
    # Every policy extending the changed file gets a new revision too.
    for t in a.tenants():
        assert c.for_tenant(t).revision != a.for_tenant(t).revision, t

    (tmp_path / "b" / "tenants" / "chat.toml").write_text((SHIPPED / "tenants" / "chat.toml").read_text() + "\n")
    (tmp_path / "b" / "default.toml").write_text(src)
    d = Policies.load(tmp_path / "b")
    assert d.for_tenant("chat").revision != a.for_tenant("chat").revision  # one byte more
    assert d.for_tenant("rag").revision == a.for_tenant("rag").revision
    assert d.for_tenant("default").revision == a.for_tenant("default").revision


def test_tenant_without_a_file_gets_default(tmp_path):
    pol = Policies.load(SHIPPED)
    assert pol.for_tenant("nobody") is pol.for_tenant("default")
    assert pol.for_tenant("nobody").name == "default"


def test_a_child_rule_overrides_the_parents_rule_of_the_same_name(tmp_path):
    files = {
        "default.toml": """
            [[admit]]
            name = "a"
            when = "state.nbytes > 10"

            [[admit]]
            name = "b"
            when = "false"
        """,
        "tenants/t.toml": """
            [[admit]]
            name = "c"
            when = "false"

            [[admit]]
            name = "a"
            effect = "warn"
            when = "state.nbytes > 100"
        """,
    }
    pol = Policies.load(write(tmp_path, files))
    t = pol.for_tenant("t")
    assert t.rule_names("admit") == ["c", "a", "b"]  # the tenant's own rules first, then inherited ones
    assert [r.effect for r in t.rules["admit"]] == ["deny", "warn", "deny"]
    assert t.rules["admit"][1].file == str(tmp_path / "tenants" / "t.toml")
    assert pol.for_tenant("default").rule_names("admit") == ["a", "b"]


def test_the_shipped_strict_policy_overrides_default_place_rules():
    strict = Policies.load(SHIPPED).for_tenant("strict")
    assert strict.rule_names("place") == ["large-to-disk", "hot-in-dram"]
    assert [r.tier for r in strict.rules["place"]] == ["dram", "dram"]


def test_extends_none_inherits_nothing(tmp_path):
    files = {
        "default.toml": 'min_gain_ms = 3.0\ndefault_tier = "disk"\n[[admit]]\nname = "a"\nwhen = "true"\n',
        "tenants/solo.toml": 'extends = "none"\n[[reuse]]\nname = "r"\nwhen = "false"\n',
        "tenants/child.toml": 'description = "inherits"\n',
    }
    pol = Policies.load(write(tmp_path, files))
    solo, child = pol.for_tenant("solo"), pol.for_tenant("child")
    assert solo.rule_names("admit") == [] and solo.rule_names("reuse") == ["r"]
    assert solo.min_gain_ms == 0.0 and solo.default_tier == ""
    assert solo.files == (str(tmp_path / "tenants" / "solo.toml"),)
    assert child.rule_names("admit") == ["a"] and child.min_gain_ms == 3.0 and child.default_tier == "disk"


def test_a_variable_of_the_child_replaces_the_parents(tmp_path):
    files = {
        "default.toml": '[variables]\nbig = "state.nbytes > 100"\n[[admit]]\nname = "a"\nwhen = "variables.big"\n',
        "tenants/t.toml": '[variables]\nbig = "state.nbytes > 1000"\n',
    }
    from nexuskv.policy.authoring.testing import build_activation

    pol = Policies.load(write(tmp_path, files))
    act = build_activation({"state": {"nbytes": 500}})
    assert not pol.for_tenant("default").evaluate("admit", act).allowed
    assert pol.for_tenant("t").evaluate("admit", act).allowed


# ------------------------------------------------------------------------------------------ the TOML locator


def _basic(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return '"' + out.replace("\x01", "\\u0001") + '"'


def _forms(s: str) -> list[str]:
    forms = [_basic(s)]
    raw = "\x01" not in s
    if raw and "'" not in s and "\n" not in s:
        forms.append(f"'{s}'")
    if raw and "'''" not in s and not s.endswith("'"):
        forms.append(f"'''\n{s}'''")
        if not s.startswith("\n"):
            forms.append(f"'''{s}'''")
    ml = s.replace("\\", "\\\\").replace('"', '\\"').replace("\x01", "\\u0001")
    forms.append(f'"""\n{ml}"""')
    if not s.startswith("\n"):
        forms.append(f'"""{ml}"""')
    return forms


@given(st.text(alphabet="ab \n\t'\"\\é\x01", max_size=12))
@settings(max_examples=150, deadline=None, derandomize=True)
def test_value_offsets_decode_like_tomllib(s):
    import tomllib

    from nexuskv.policy import positions as _tomlpos

    for form in _forms(s):
        text = f"# c\nk = {form}\n"
        assert tomllib.loads(text)["k"] == s, form
        got = _tomlpos.value_offsets(text, text.index("=") + 2)
        assert got is not None, form
        value, offs = got
        assert value == s, form
        assert len(offs) == len(s) + 1
        assert offs == sorted(offs)
        for ch, off in zip(s, offs, strict=False):
            assert text[off] == ch or text[off] == "\\", (form, ch, off)


def test_line_ending_backslash_and_comments_do_not_confuse_the_locator(tmp_path):
    text = """
        # [[admit]] in a comment is no header
        [[admit]]
        name = "a"   # name = "b"
        when = \"\"\"state.nbytes > 1 && \\
                  [1, 2].exists(x, x > state.nbyts)\"\"\"
    """
    p = one(tmp_path, {"default.toml": text})
    assert at(p) == ("default.toml", "a", 5, 38)
    assert "nbyts" in p.message


# ------------------------------------------------------------------------------------------ route rules


def test_route_rule_errors_name_file_rule_and_position(tmp_path):
    problems = check(tmp_path, {"default.toml": """
        [[route]]
        name = "typo"
        when = "target.nodes > 1"

        [[route]]
        name = "no-weight"
        effect = "weight"
        when = "true"

        [[route]]
        name = "text-weight"
        effect = "weight"
        when = "true"
        weight_expr = "target.node"
        """})
    got = {(p.rule, p.line, p.column, p.message) for p in problems}
    assert ("typo", 3, 16, "when: unknown field 'nodes' on RouteTarget (did you mean 'node'?)") in got
    assert ("no-weight", 6, 1, "a weight rule must set weight or weight_expr") in got
    assert ("text-weight", 14, 16, "weight_expr: expression must evaluate to int or double, but its type is "
            "string") in got  # fmt: skip
    assert len(problems) == 3


def test_route_rule_unknown_effect_and_non_positive_weight(tmp_path):
    p = one(tmp_path, {"default.toml": '[[route]]\nname = "x"\nwhen = "true"\neffect = "prefer"\n'})
    assert at(p)[:2] == ("default.toml", "x") and "route[0].effect" in p.message
    p = one(tmp_path / "w", {"default.toml": '[[route]]\nname = "x"\nwhen = "true"\neffect = "weight"\nweight = 0\n'})
    assert "route[0].weight" in p.message


def test_weights_belong_to_weight_rules_and_are_finite(tmp_path):
    p = one(tmp_path, {"default.toml": '[[route]]\nname = "x"\nwhen = "true"\nweight_expr = "2.0"\n'})
    assert p.rule == "x" and p.message == "weight and weight_expr apply to weight rules only (this one is exclude)"
    text = '[[route]]\nname = "y"\neffect = "weight"\nwhen = "true"\nweight = inf\n'
    p = one(tmp_path / "inf", {"default.toml": text})
    assert p.rule == "y" and p.message == "weight must be finite"


def test_remembered_expressions_are_keyed_by_every_refinement_of_a_plugin_function(tmp_path):
    from nexuskv.cel.types import STRING, FunctionDecl, list_of
    from nexuskv.policy import compiler

    files = {"default.toml": 'name = "default"\n[[admit]]\nname = "r"\nwhen = \'labels().exists(x, x == "a")\'\n'}
    root = write(tmp_path, files)

    def impl():
        return ["a"]

    bounded = {"labels": FunctionDecl("labels", (), list_of(STRING, max_size=10), impl)}
    unbounded = {"labels": FunctionDecl("labels", (), list_of(STRING), impl)}
    assert bounded["labels"] == unbounded["labels"]  # equal declarations, but not the same cost
    compiler._CACHE.clear()
    assert Policies.check(root, bounded) == []
    (p,) = Policies.check(root, unbounded)  # not the bounded one's compiled expression from the cache
    assert "exceeds the limit" in p.message and p.rule == "r"


def test_a_name_that_differs_from_the_file_name_is_a_located_problem(tmp_path):
    """Loaded under the other name, the file would never apply to the tenant it is named for."""
    write(tmp_path, {"default.toml": 'name = "default"\n',
                     "tenants/acme.toml": '# ACME\nmin_gain_ms = 1.0\n  name = "acme-corp"\n'})  # fmt: skip
    problems = Policies.check(tmp_path)
    assert [str(p) for p in problems] == [
        f'{tmp_path / "tenants" / "acme.toml"}:3:3: name "acme-corp" differs from the file name "acme", so this '
        'policy would never apply as "acme": rename the file to acme-corp.toml, or set name = "acme" '
        "(or leave name out)"
    ]
    with pytest.raises(PolicyError, match="differs from the file name"):
        Policies.load(tmp_path)
    (tmp_path / "tenants" / "acme.toml").write_text('name = "acme"\nmin_gain_ms = 1.0\n')
    assert Policies.load(tmp_path).for_tenant("acme").min_gain_ms == 1.0
