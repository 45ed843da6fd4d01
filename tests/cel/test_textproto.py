"""The protobuf text-format reader used for CEL's conformance files."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nexuskv.cel.textproto import Message, Scalar, TextFormatError, parse_text


def test_fields_nesting_and_repeats():
    m = parse_text('name: "x"  # a comment\nsection { test { name: "a" } test < name: "b" > }\nflag: true')
    assert m.text("name") == "x" and m.flag("flag")
    section = m.message("section")
    assert isinstance(section, Message)
    assert [t.text("name") for t in section.all("test")] == ["a", "b"]  # type: ignore[union-attr]
    assert m.names() == ["name", "section", "flag"]
    assert m.get("missing") is None and m.text("missing", "d") == "d" and not m.flag("missing")


def test_scalars():
    m = parse_text("a: -12 b: 0x1F c: 1.5e3 d: -inf e: nan f: ENUM_NAME g: 017 h: 2.5f i: - 3")
    assert m.get("a") == Scalar("number", "-12")
    assert m.get("a").as_int() == -12  # type: ignore[union-attr]
    assert m.get("b").as_int() == 31  # type: ignore[union-attr]
    assert m.get("c").as_float() == 1500.0  # type: ignore[union-attr]
    assert m.get("d").as_float() == float("-inf")  # type: ignore[union-attr]
    assert m.get("e").as_float() != m.get("e").as_float()  # type: ignore[union-attr]
    assert m.get("f") == Scalar("ident", "ENUM_NAME")
    assert m.get("g").as_int() == 15  # type: ignore[union-attr]
    assert m.get("h").as_float() == 2.5  # type: ignore[union-attr]
    assert m.get("i").as_int() == -3  # type: ignore[union-attr]


def test_string_escapes_and_concatenation():
    m = parse_text(r'''s: "a\n\t\"q\"" 'b\x41\101' "\u00e9\U0001F600" b: "\377\000"''')
    assert m.text("s") == 'a\n\t"q"bAAé😀'
    assert m.get("b").raw == b"\xff\x00"  # type: ignore[union-attr]


def test_lists_and_any_expansions():
    m = parse_text('v: [1, 2, 3] w: [] any { [type.googleapis.com/google.protobuf.Duration] { seconds: 5 } }')
    assert [s.as_int() for s in m.all("v")] == [1, 2, 3]  # type: ignore[union-attr]
    assert m.all("w") == []
    any_ = m.message("any")
    assert any_ is not None and any_.names() == ["[type.googleapis.com/google.protobuf.Duration]"]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("a {", "1:4: unexpected end of text"),
        ("a: ", "1:4: unexpected end of text"),
        ("a b", "1:3: expected ':' or '{'"),
        ("a: {}\n  ~", "2:3: unexpected character '~'"),
        ('a: "\\q"', "1:4: invalid escape"),
        ("a: [1 2]", "1:7: expected ',' or ']'"),
    ],
)
def test_errors_say_where(text, where):
    with pytest.raises(TextFormatError, match=where.replace("(", r"\(")):
        parse_text(text)


def test_a_scalar_is_not_a_message():
    with pytest.raises(TextFormatError, match="is a scalar"):
        parse_text("a: 1").message("a")


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_any_string_round_trips_through_octal_escapes(s):
    escaped = "".join(f"\\{b:03o}" for b in s.encode("utf-8"))
    assert parse_text(f'a: "{escaped}"').text("a") == s
