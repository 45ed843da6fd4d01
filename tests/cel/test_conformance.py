"""CEL's official conformance suite (cel-spec's "simple" tests, vendored in tests/data/cel-spec) against our CEL.

Every case that needs no protobuf message type must pass, except the few listed in KNOWN_FAILURES with the
reason; a listed case that starts passing fails the run (no stale entries), and no case may ever give a wrong
value. Each case also checks that the fast path and the exact path agree (`run_case` does).
"""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import pytest

from nexuskv.cel.conformance import Case, decode_type, decode_value, load_cases, protobuf_reason, run_case, same
from nexuskv.cel.textproto import parse_text
from nexuskv.cel.types import DYN, INT, STRING, UINT, list_of, map_of, optional_of

SUITE = Path(__file__).resolve().parents[1] / "data" / "cel-spec"

KNOWN_FAILURES: dict[str, str] = {}
"""Applicable cases that do not pass, with why (each is counted against the pass fraction)."""


@functools.cache
def cases() -> list[Case]:
    return load_cases(SUITE)


def applicable() -> list[Case]:
    return [c for c in cases() if protobuf_reason(c) is None]


@pytest.mark.parametrize("case", applicable(), ids=lambda c: c.id)
def test_case(case: Case) -> None:
    outcome = run_case(case)
    assert outcome.status != "wrong", f"{case.expr!r}: {outcome.detail}"
    if case.id in KNOWN_FAILURES:
        assert outcome.status != "pass", f"{case.id} passes now: remove it from KNOWN_FAILURES"
    else:
        assert outcome.status == "pass", f"{case.expr!r}: {outcome.detail}"


def test_the_suite_is_read_whole_and_counted():
    counts = collections.Counter(c.file for c in cases())
    assert len(counts) == 22 and sum(counts.values()) == 2008
    reasons = collections.Counter(protobuf_reason(c) for c in cases())
    assert len(applicable()) >= 1100
    assert reasons["the expression uses a protobuf message type"] > 0
    assert (len(applicable()) - len(KNOWN_FAILURES)) / len(applicable()) >= 0.99


def test_known_failures_name_real_applicable_cases():
    ids = {c.id for c in applicable()}
    assert set(KNOWN_FAILURES) <= ids


def _case(text: str) -> Case:
    test = parse_text(text)
    return Case("f", "s", test.text("name"), test.text("expr"), test)


def test_protobuf_cases_are_recognised():
    assert protobuf_reason(_case('expr: "TestAllTypes{single_int64: 1}"'))
    assert protobuf_reason(_case('expr: "google.protobuf.Int32Value{value: 1}.value"'))
    assert protobuf_reason(_case('expr: "x" type_env { name: "x" ident { type { message_type: "T" } } }'))
    assert protobuf_reason(_case('expr: "1" value { object_value { [type.googleapis.com/T] { a: 1 } } }'))
    assert protobuf_reason(_case('expr: "{1: 2}"')) is None
    assert protobuf_reason(_case('expr: "x" value { object_value { '
                                 '[type.googleapis.com/google.protobuf.Duration] { seconds: 1 } } }')) is None


def test_run_case_reports_wrong_values_and_errors():
    assert run_case(_case('expr: "1 + 1" value { int64_value: 2 }')).status == "pass"
    assert run_case(_case('expr: "1 + 1" value { int64_value: 3 }')).status == "wrong"
    assert run_case(_case('expr: "1u" value { int64_value: 1 }')).status == "wrong"  # kinds are strict
    assert run_case(_case('expr: "1 / 0" eval_error { errors { message: "x" } }')).status == "pass"
    assert run_case(_case('expr: "1 / 1" eval_error { errors { message: "x" } }')).status == "wrong"
    assert run_case(_case('expr: "1 +" value { int64_value: 2 }')).status == "fail"


def test_decoding_values_and_types():
    v = parse_text('map_value { entries { key { string_value: "a" } value { list_value { values { uint64_value: 2 } '
                   'values { double_value: -inf } } } } }')  # fmt: skip
    got = decode_value(v)
    assert same(got, {"a": [decode_value(parse_text("uint64_value: 2")), float("-inf")]})
    assert decode_type(parse_text("primitive: INT64")) == INT
    assert decode_type(parse_text("list_type { elem_type { primitive: STRING } }")) == list_of(STRING)
    assert decode_type(parse_text("map_type { key_type { primitive: UINT64 } value_type { dyn {} } }")) == map_of(
        UINT, DYN
    )
    t = parse_text('abstract_type { name: "optional_type" parameter_types { primitive: INT64 } }')
    assert decode_type(t) == optional_of(INT)
    with pytest.raises(ValueError, match="not supported"):
        decode_type(parse_text('message_type: "T"'))
