"""Differential test of the SHIPPED policies: every CEL expression, as compiled by the loader, against cel-python.

Every expression of `policies/*.toml` and `policies/tenants/*.toml` (match, when, message_expr, max_tokens,
tier_expr, ttl_expr, priority_expr and the variables) is evaluated two ways over generated inputs:
- ours: the compiled function of the loaded `PolicySet`, over `PolicySet.activation` (lazy `variables`);
- cel-python: the expression text with each `variables.NAME` replaced by `(its expression)`, over the same
  inputs converted from their `nexuskv.to_dict` forms with `celpy.json_to_cel`, with `bytes_of` supplied as a
  custom function.
Both must give the same value, or both an error.

Documented cel-python 0.5.0 deviation handled here: `string(2.0)` is "2.0" there and "2" in CEL (cel-go) and
here; for expressions that format a double field, a trailing `.0` of an integral number in cel-python's text is
dropped before comparing.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import celpy
import pytest
from celpy import celtypes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv import to_dict
from nexuskv.cel.compiled import CelEvalError, Compiled
from nexuskv.policy.authoring.testing import build_activation
from nexuskv.policy.loader import Policies
from nexuskv.policy.policyset import KINDS, PolicySet
from nexuskv.units import parse_bytes

SHIPPED = Path(__file__).resolve().parents[2] / "policies"
POLICIES = Policies.load(SHIPPED)
_VAR = re.compile(r"\bvariables\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")
_DOUBLE_STRING = re.compile(r"string\(\s*(cost\.|double\()")


def inline(source: str, variables: Mapping[str, Compiled]) -> str:
    """The expression with every `variables.NAME` replaced by `(NAME's expression)`, recursively."""
    return _VAR.sub(lambda m: f"({inline(variables[m.group(1)].source, variables)})", source)


def _expressions() -> list[tuple[str, str, str, PolicySet, Compiled, str]]:
    """(policy, kind, label, policy set, compiled, inlined source), one per distinct (kind, inlined source)."""
    out, seen = [], set()
    for name in POLICIES.tenants():
        ps = POLICIES.for_tenant(name)
        for kind in KINDS:
            fns: list[tuple[str, Compiled]] = [(f"variables.{v}", f) for v, f in ps.variables[kind].items()]
            for rule in ps.rules[kind]:
                fns += [(f"{rule.name}.match[{i}]", m) for i, m in enumerate(rule.match)]
                fns.append((f"{rule.name}.when", rule.when))
                for what in ("message_fn", "max_tokens", "tier_fn", "ttl_fn", "priority_fn"):
                    fn = getattr(rule, what)
                    if fn is not None:
                        fns.append((f"{rule.name}.{what}", fn))
            for label, fn in fns:
                text = inline(fn.source, ps.variables[kind])
                if (kind, text) not in seen:
                    seen.add((kind, text))
                    out.append((name, kind, label, ps, fn, text))
    return out


EXPRESSIONS = _expressions()


def test_every_expression_of_the_shipped_policies_is_covered():
    labels = {(p, label) for p, _, label, *_ in EXPRESSIONS}
    for what in ("bounded-payload.message_fn", "cap-untrusted-node.max_tokens", "cap-untrusted-node.match[0]",
                 "hot-in-dram.priority_fn", "documents-on-disk.priority_fn", "docs-to-partners.when",
                 "watch-slow-reuse.message_fn", "variables.page_tokens", "variables.tokens_covered"):  # fmt: skip
        assert any(label == what for _, label in labels), what
    assert any("variables." in fn.source for *_, fn, _ in EXPRESSIONS)
    assert len(EXPRESSIONS) >= 30


# --------------------------------------------------------------------------------------------- cel-python

CELPY = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _bytes_of(text: Any) -> celtypes.IntType:
    return celtypes.IntType(parse_bytes(str(text)))


def run_celpy(source: str, act: Mapping[str, Any]) -> tuple[str, Any]:
    prog = _PROGRAMS.get(source)
    if prog is None:
        prog = _PROGRAMS[source] = CELPY.program(CELPY.compile(source), functions={"bytes_of": _bytes_of})
    try:
        value = prog.evaluate(act)
    except celpy.CELEvalError:
        return ("error", None)
    if isinstance(value, celpy.CELEvalError):
        return ("error", None)
    return ("value", normal(value))


def to_celpy(native: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in native.items():
        if name == "now":
            out[name] = celtypes.TimestampType(value)
        elif isinstance(value, str):
            out[name] = celtypes.StringType(value)
        else:
            out[name] = celpy.json_to_cel(to_dict(value))
    return out


def normal(value: Any) -> tuple[str, Any]:
    """(CEL type name, plain value) for values of either side."""
    if isinstance(value, bool | celtypes.BoolType):
        return ("bool", bool(value))
    if isinstance(value, int | celtypes.IntType):
        return ("int", int(value))
    if isinstance(value, float | celtypes.DoubleType):
        return ("double", float(value))
    if isinstance(value, str | celtypes.StringType):
        return ("string", str(value))
    if isinstance(value, dt.timedelta):
        return ("duration", value.total_seconds())
    raise AssertionError(f"unexpected value {value!r}")


# --------------------------------------------------------------------------------------------- inputs

MiB = 1 << 20
TENANTS = ["default", "chat", "rag", "strict", "partner-a", "other"]
TIERS = ["dram", "disk", "redis", "ssd", ""]
NODES = ["", "node-a", "edge-3", "edge-", "core-edge-1"]
SCOPES = ["", "system", "docs", "tmp-42", "tmp-", "user-7", "Docs", "xtmp-1"]

nbytes = st.one_of(
    st.sampled_from([0, 1, 16 * MiB, 16 * MiB + 1, 64 * MiB - 1, 64 * MiB, 256 * MiB, 256 * MiB + 1, 1 << 40]),
    st.integers(0, 1 << 31),
)
gains = st.one_of(
    st.sampled_from([0.0, 0.5, 1.5, 2.0, 1.999, 2.001, -3.0, 250.0]),
    st.floats(-10, 100, allow_nan=False).map(lambda x: round(x, 3)),
)


@st.composite
def inputs(draw: st.DrawFn) -> dict[str, Any]:
    start = draw(st.integers(0, 9000))
    lengths = st.sampled_from([0, 1, 16, max(0, 4096 - start)]) | st.integers(0, 9000)
    page = draw(st.sampled_from([1, 16, 64, 256]))
    state = {
        "namespace": {"tenant": draw(st.sampled_from(TENANTS)), "scope": draw(st.sampled_from(SCOPES))},
        "nbytes": draw(nbytes),
        "span": {"start": start, "end": start + draw(lengths)},
        "checksum": draw(st.sampled_from(["blake2b-128:" + "0" * 32, "sha256:" + "ab" * 32, "blake2b-12:00"])),
        "placement": {"tier": draw(st.sampled_from(TIERS[:-1])), "node": draw(st.sampled_from(NODES[1:])), "epoch": 1},
        "usage": {"hits": draw(st.integers(0, 1 << 40))},
        "layout": {"page_size": draw(st.sampled_from([1, 16, 64]))},
    }
    request = {
        "tenant": draw(st.sampled_from(TENANTS)),
        "model": {"name": draw(st.sampled_from(["tiny-llama", "tiny-llama-2", "other"]))},
        "layout": {"page_size": page},
        "priority": draw(st.integers(-2, 3)),
    }
    tokens = draw(st.one_of(st.integers(0, 20000), st.sampled_from([0, 8, 15, 16, 8191, 8192, 8193, page * 3])))
    match = {
        "tokens": tokens,
        "blocks": draw(st.integers(0, 64)),
        "tier": draw(st.sampled_from(TIERS)),
        "node": draw(st.sampled_from(NODES)),
        "owner": draw(st.sampled_from(TENANTS)),
        "scope": draw(st.sampled_from(SCOPES)),
        "shared": draw(st.booleans()),
        "kind": draw(st.sampled_from(["dense", "latent", "windowed", ""])),
    }
    cost = {"gain_ms": draw(gains), "t_recompute_ms": draw(gains), "ttft_ms": draw(gains)}
    target = {"node": draw(st.sampled_from(NODES)), "queue_ms": draw(gains) * 40,
              "running_decodes": draw(st.integers(0, 99)),
              "labels": draw(st.sampled_from([{}, {"trust": "high"}, {"trust": "low"}, {"zone": "eu"}]))}
    act = build_activation({"state": state, "request": request, "match": match, "cost": cost, "target": target,
                            "tier": draw(st.sampled_from(TIERS)), "node": draw(st.sampled_from(NODES))})  # fmt: skip
    act["now"] = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    return act


# --------------------------------------------------------------------------------------------- the test


def check(kind: str, ps: PolicySet, fn: Compiled, text: str, native: dict[str, Any], celact: dict[str, Any]) -> None:
    act = ps.activation(kind, native)
    try:
        ours: tuple[str, Any] = ("value", normal(fn(act)))
    except CelEvalError:
        ours = ("error", None)
    theirs = run_celpy(text, celact)
    if theirs[0] == "value" and theirs[1][0] == "string" and _DOUBLE_STRING.search(text):
        theirs = ("value", ("string", re.sub(r"\b(\d+)\.0\b", r"\1", theirs[1][1])))
    assert ours == theirs, f"{fn.source!r} (as {text!r}) over {native}: ours={ours} celpy={theirs}"


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(inputs())
def test_shipped_expressions_agree_with_cel_python(native: dict[str, Any]) -> None:
    celact = to_celpy(native)
    for _, kind, _, ps, fn, text in EXPRESSIONS:
        check(kind, ps, fn, text, native, celact)


@pytest.mark.parametrize(
    ("policy", "kind", "label", "ps", "fn", "text"), EXPRESSIONS, ids=[f"{e[0]}-{e[1]}-{e[2]}" for e in EXPRESSIONS]
)
def test_each_shipped_expression_on_the_test_samples(policy, kind, label, ps, fn, text):
    """Every expression on the samples of `nexuskv policy test`, so a failure names the expression."""
    native = build_activation({"state": {}, "match": {"tokens": 100, "tier": "dram"}, "cost": {"gain_ms": 1.5},
                               "node": "edge-1", "target": {"node": "edge-1", "labels": {"trust": "high"},
                                                            "queue_ms": 2500.0}}, kind)  # fmt: skip
    native["now"] = dt.datetime(2025, 1, 2, tzinfo=dt.UTC)
    check(kind, ps, fn, text, native, to_celpy(native))
