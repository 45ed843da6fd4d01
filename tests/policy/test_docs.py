"""docs/policies.md documents every field of the policy file format, each kind with an example."""

import re
from pathlib import Path

import attrs
import pytest

from nexuskv.policy.model import AdmitRule, PlaceRule, PolicyFile, ReuseRule, RouteRule, RouteTarget, ShareRule

DOC = (Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text()


@pytest.mark.parametrize("cls", [PolicyFile, AdmitRule, ReuseRule, PlaceRule, ShareRule, RouteRule, RouteTarget],
                         ids=lambda c: c.__name__)
def test_every_field_is_documented(cls):
    for f in attrs.fields(cls):
        if f.name in ("admit", "reuse", "place", "share", "route", "variables"):
            assert f"[[{f.name}]]" in DOC or f"[{f.name}]" in DOC, f.name
            continue
        assert f"`{f.name}`" in DOC, f"{cls.__name__}.{f.name} is not documented"


@pytest.mark.parametrize("kind", ["admit", "reuse", "place", "share", "route"])
def test_every_rule_kind_has_an_example(kind):
    examples = re.findall(r"```toml\n(.*?)```", DOC, re.S)
    assert any(f"[[{kind}]]" in ex for ex in examples), kind
