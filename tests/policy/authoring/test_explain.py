"""`policy explain`'s own pieces: the sub-expressions it lists, and the literals it leaves out.

The command itself, one test per rule kind, is tested in tests/cli/test_main.py.
"""

import pytest

from nexuskv.cel import subexpressions as cel_subexpressions
from nexuskv.policy.authoring.explain import _literal, subexpressions

WITHOUT_BOOLEANS = [
    "(a + b) * c", "[1, 2, 3].exists(x, x > 2)", "f(a, (b))", "a.b.c[1]", '{"a": 1}["a"]', "x ? (y) : z", "!a",
    "-(-x)", "size(l) > 0 && has(m.f)", "a in [1,2]", "  a   ||  b  ", "m.f(1).g", "[]", "{}", 'b"x" + b"y"',
    '!("trust" in target.labels) || target.labels["trust"] != "high"', "x == null", "a // a comment\n  + b",
]  # fmt: skip


@pytest.mark.parametrize("source", WITHOUT_BOOLEANS)
def test_the_same_sub_expressions_as_the_cel_engine_lists(source):
    assert subexpressions(source) == cel_subexpressions(source)


@pytest.mark.parametrize("source, expected", [
    ("true", ["true"]),
    ("x || true", ["x || true", "x", "true"]),
    ("(a || true) && b", ["(a || true) && b", "(a || true)", "a || true", "a", "true", "b"]),
    ('"true" == s && false', ['"true" == s && false', '"true" == s', '"true" ==', '"true"', "s", "false"]),
    ("true ? null : false", ["true ? null : false", "true", "null", "false"]),
    ("x || // true\n  false", ["x || // true\n  false", "x", "false"]),
    ("[true, false].exists(v, v == true)", ["[true, false].exists(v, v == true)", "[true, false]", "true, false",
                                            "true", "false", "v, v == true", "v", "v == true", "v =="]),
])  # fmt: skip
def test_true_and_false_have_their_place(source, expected):
    """lark hands `true` / `false` tokens over without a position: the CEL engine's listing fails on them."""
    assert subexpressions(source) == expected


@pytest.mark.parametrize("text, literal", [
    ("1", True), ("-1", True), ("1.5", True), ("2u", True), ('"a"', True), ("'s'", True), ('b"x"', True),
    ('r"x"', True), ("true", True), ("null", True), ("[]", True), ("{}", True),
    ("x", False), (".x", False), ("x.y", False), ("f(x)", False), ("now()", False), ("[1]", False),
    ('"a" + x', False), ('"k" in m', False),
])  # fmt: skip
def test_literals_are_told_from_expressions_that_start_like_one(text, literal):
    assert _literal(text) is literal
