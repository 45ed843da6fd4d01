"""NexusKV's CEL against Google's (cel-cpp, `cel-expr-python`) on generated expressions and bindings (issue 35).

bench/cel_official.py runs the same comparison over 10,000+ expressions and prints the count of disagreements.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from nexuskv.cel import CelSyntaxError
from tests.cel.official import KINDS, disagreement, expressions, known_reason, run_official
from tests.cel.test_differential import SETTINGS, activations, run_ours


@pytest.mark.parametrize("kind", KINDS)
def test_generated_expressions_agree_with_the_official_cel(kind):
    @SETTINGS
    @given(expressions(kind), activations())
    def agree(source: str, act: dict[str, Any]) -> None:
        why = disagreement(source, kind, act)
        assert why is None or known_reason(why) is not None, why  # listed ones: docs/cel.md

    agree()


@pytest.mark.parametrize(("source", "kind", "want"), [
    ("[1, 2,][1]", "int", ("value", ("int", 2))),            # trailing commas (a syntax error here before)
    ('{"a": 1,}["a"]', "int", ("value", ("int", 1))),
    ('matches(s, "^a")', "bool", ("value", ("bool", True))),  # the global form (refused here before)
    ('matches(s, "^b")', "bool", ("value", ("bool", False))),
    ('duration("1x") == duration("1s")', "bool", ("error", None)),  # malformed literal: an evaluation error
    ('timestamp("nope") == timestamp("2020-01-01T00:00:00Z")', "bool", ("error", None)),
    ('duration("9223372036s") + duration("1s") > duration("1s")', "bool", ("error", None)),  # int64 ns overflow
    ('duration("9223372036.854775807s") + duration("0s") > duration("1s")', "bool", ("value", ("bool", True))),
    ('duration("-9223372036.854775808s") - duration("0s") < duration("1s")', "bool", ("value", ("bool", True))),
    ('timestamp("2020-01-01T00:00:00.123456789Z").getHours("America/New_York")', "int", ("value", ("int", 19))),
    ('timestamp("2020-01-01T00:00:00.1234567Z").getMinutes("Asia/Kolkata")', "int", ("value", ("int", 30))),
])  # fmt: skip
def test_forms_the_spec_has_and_nexuskv_refused(source, kind, want):
    act = {"s": "ab"}
    assert run_official(source, kind, act) == want
    assert run_ours(source, kind, act)[0] == want


def test_in_is_not_an_identifier():
    act = {"s": "ab"}
    assert run_official("[1, 2].exists(in, in > 1)", "bool", act)[0] == "invalid"
    with pytest.raises(CelSyntaxError, match="'in' is an operator, not an identifier"):
        run_ours("[1, 2].exists(in, in > 1)", "bool", act)
