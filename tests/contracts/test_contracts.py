import enum
import json
import typing
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nexuskv.contracts as c
from nexuskv import ContractError, SchemaVersionError, from_dict, to_dict

ROOT = Path(__file__).resolve().parents[2]
name = st.from_regex(r"\A[a-z0-9][a-z0-9._-]{0,12}\Z")
text = st.text(max_size=12)
small = st.integers(0, 10_000)
hexkey = st.binary(min_size=16, max_size=16).map(bytes.hex)
fl = st.floats(0, 1e6, allow_nan=False)

groups = st.builds(c.StateGroup, kind=st.sampled_from(list(c.StateKind)), layers=st.integers(1, 64),
                   kv_heads=small, head_dim=small, latent_dim=small, window=small)
layouts = st.builds(c.Layout, groups=st.lists(groups, min_size=1, max_size=3), page_size=st.integers(1, 256),
                    tp_rank=small, tp_size=st.integers(1, 8))
models = st.builds(c.ModelIdentity, name=name, revision=text, weights_hash=text, dtype=name, quantization=name,
                   adapter=st.none() | st.builds(c.AdapterIdentity, name=name, weights_hash=text, scale=fl))
toks = st.builds(c.TokenizerIdentity, name=name, revision=text, hash=text)
descriptors = st.builds(
    c.StateDescriptor, key=hexkey, namespace=st.builds(c.Namespace, tenant=name, scope=text, cache_salt=text),
    model=models, tokenizer=toks, layout=layouts, span=st.builds(c.TokenSpan, start=small, end=small),
    nbytes=small, checksum=hexkey.map(lambda h: "blake2b-128:" + h), parent_key=st.none() | hexkey,
    placement=st.builds(c.Placement, tier=name, node=name, epoch=small), group=st.integers(0, 3),
    codec=name, raw_nbytes=small,
    tensors=st.lists(st.builds(c.TensorSpec, name=text, dtype=name, shape=st.lists(small, max_size=4)), max_size=3),
    usage=st.builds(c.Usage, created_s=fl, last_access_s=fl, hits=small),
)
requests = st.builds(
    c.Request, request_id=name, tenant=name, model=models, tokenizer=toks, layout=layouts,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=50), scope=text, cache_salt=text,
    extra_inputs=st.lists(st.builds(c.ExtraInput, position=small, digest=name), max_size=2), node=text,
    slo=st.builds(c.Slo, ttft_ms=st.none() | fl, deadline_ms=st.none() | fl), priority=st.integers(-5, 5),
)
spans = st.builds(c.PlanSpan, start=small, end=small, tier=name, node=name, transport=name, target_tier=text)
plans = st.builds(
    c.Plan, decision_id=name, request_id=name, tenant=name, action=st.sampled_from(list(c.PlanAction)),
    tokens_total=small, tokens_reused=small, spans=st.lists(spans, max_size=3), prefetch=st.lists(spans, max_size=2),
    route=st.none() | name, predicted=st.builds(c.Predicted, t_recompute_ms=fl, t_lookup_ms=fl, t_transfer_ms=fl,
                                                t_mount_ms=fl, gain_ms=fl, ttft_ms=fl),
    reasons=st.lists(text, max_size=3), rules=st.lists(name, max_size=3), policy_revision=text, epoch=small,
)
links = st.builds(c.LinkCost, bandwidth_bytes_per_s=st.floats(1, 1e12), latency_ms=fl)
profiles = st.builds(
    c.CostProfile, name=name, model=name, hardware=text, bytes_per_token=st.integers(1, 10**6),
    prefill=st.builds(c.PrefillCost, base_ms=fl, per_token_ms=fl, per_token_sq_ms=fl),
    tiers=st.dictionaries(name, links, max_size=3), transports=st.dictionaries(name, links, max_size=2),
    codecs=st.dictionaries(name, st.builds(c.CodecCost, decode_bytes_per_s=st.floats(1, 1e12),
                                           encode_bytes_per_s=st.floats(1, 1e12), ratio=st.floats(0.1, 10))),
    lookup_ms=fl, mount_ms_per_block=fl,
    calibration=st.builds(c.Calibration, method=text, samples=small, heldout_error_pct=st.none() | fl),
)
STRATEGIES = {c.StateDescriptor: descriptors, c.Request: requests, c.Plan: plans, c.CostProfile: profiles}


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda k: k.__name__)
def test_roundtrip_through_json(cls):
    @given(STRATEGIES[cls])
    def check(obj):
        data = json.loads(json.dumps(to_dict(obj)))
        assert from_dict(cls, data) == obj

    check()


def _expected_json_type(tp):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        return sorted(_expected_json_type(a) for a in args if a is not type(None)) + (
            ["null"] if type(None) in args else [])
    if origin is tuple:
        return "array"
    if origin is dict:
        return "object"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "string"
    if attrs.has(tp):
        return f"#/$defs/{tp.__name__}"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}[tp]


def _schema_json_type(sch):
    if "anyOf" in sch:
        return sorted(_schema_json_type(b) for b in sch["anyOf"] if b.get("type") != "null") + (
            ["null"] if any(b.get("type") == "null" for b in sch["anyOf"]) else [])
    return sch.get("$ref") or sch["type"]


def _flatten(out):
    return [x for v in out for x in (v if isinstance(v, list) else [v])] if isinstance(out, list) else out


def _all_contracts():
    from nexuskv.policy.model import PolicyFile

    return {**c.CONTRACTS, "policy": PolicyFile}


@pytest.mark.parametrize("contract", sorted(_all_contracts()))
def test_committed_schema_and_classes_agree_on_every_field(contract):
    """Independent of the generator: walk each attrs class and compare with the committed file."""
    cls = _all_contracts()[contract]
    schema = json.loads((ROOT / "schemas" / f"{contract}.v1.json").read_text())
    todo, seen = [(cls, schema)], set()
    while todo:
        k, sch = todo.pop()
        if k in seen:
            continue
        seen.add(k)
        attrs.resolve_types(k)
        fields = attrs.fields(k)
        assert set(sch["properties"]) == {f.name for f in fields}, k.__name__
        assert set(sch.get("required", [])) == {f.name for f in fields if f.default is attrs.NOTHING}, k.__name__
        assert sch["additionalProperties"] is False
        for f in fields:
            prop = sch["properties"][f.name]
            assert _flatten(_schema_json_type(prop)) == _flatten(_expected_json_type(f.type)), f"{k.__name__}.{f.name}"
            for leaf in typing.get_args(f.type) or (f.type,):
                for inner in typing.get_args(leaf) or (leaf,):
                    if attrs.has(inner):
                        todo.append((inner, schema["$defs"][inner.__name__]))


def test_schema_files_are_current():
    from click.testing import CliRunner

    from nexuskv.cli import cli

    res = CliRunner().invoke(cli, ["schema", "export", "--check"])
    assert res.exit_code == 0, res.output


def _request_dict():
    return to_dict(c.Request(request_id="r1", tenant="acme", model=c.ModelIdentity(name="m"),
                             tokenizer=c.TokenizerIdentity(name="t"),
                             layout=c.Layout(groups=[c.StateGroup(kind="dense", layers=2)]), token_ids=[1, 2, 3]))


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (lambda d: d.pop("tenant"), "tenant", "required"),
        (lambda d: d.update(tenant=7), "tenant", "expected string, got integer"),
        (lambda d: d.update(token_ids=[1, "x", 3]), "token_ids[1]", "expected integer"),
        (lambda d: d.update(token_ids=[1, -4]), "token_ids[1]", "minimum"),
        (lambda d: d["model"].update(name=None), "model.name", "expected string, got null"),
        (lambda d: d["model"].update(adapter={"name": 5}), "model.adapter.name", "expected string"),
        (lambda d: d["layout"]["groups"][0].update(kind="quantum"), "layout.groups[0].kind", "is not one of"),
        (lambda d: d["layout"].update(groups=[]), "layout.groups", "should be non-empty"),
        (lambda d: d["layout"]["groups"][0].update(extra=1), "layout.groups[0].extra", "unknown field"),
        (lambda d: d.update(tenantt="x"), "tenantt", "unknown field"),
        (lambda d: d.update(slo={"ttft_ms": "fast"}), "slo.ttft_ms", "expected"),
    ],
)
def test_malformed_request_names_the_field_path(mutate, path, fragment):
    d = _request_dict()
    mutate(d)
    with pytest.raises(ContractError) as info:
        from_dict(c.Request, d)
    problems = dict(info.value.problems)
    assert path in problems, info.value.problems
    assert fragment in problems[path]


def test_every_problem_is_reported_at_once():
    d = _request_dict()
    d.update(tenant=1, token_ids="abc", bogus=True)
    with pytest.raises(ContractError) as info:
        from_dict(c.Request, d)
    assert {p for p, _ in info.value.problems} == {"tenant", "token_ids", "bogus"}


@pytest.mark.parametrize("version", [2, 0, "1", True, None])
def test_unknown_schema_version_is_a_clear_error(version):
    d = _request_dict()
    d["schema_version"] = version
    with pytest.raises(SchemaVersionError, match=r"schema_version: version .* not supported \(this kernel speaks 1\)"):
        from_dict(c.Request, d)


@pytest.mark.parametrize("data", [[], "x", None, 3])
def test_non_object_input(data):
    with pytest.raises(ContractError, match="expected an object"):
        from_dict(c.StateDescriptor, data)


def test_bad_descriptor_key_and_checksum():
    d = to_dict(next_descriptor())
    d["key"] = "XYZ"
    d["checksum"] = "nocolon"
    with pytest.raises(ContractError) as info:
        from_dict(c.StateDescriptor, d)
    assert {p for p, _ in info.value.problems} == {"key", "checksum"}


def next_descriptor():
    return c.StateDescriptor(
        key="00" * 16, namespace=c.Namespace("acme"), model=c.ModelIdentity(name="m"),
        tokenizer=c.TokenizerIdentity(name="t"), layout=c.Layout(groups=[c.StateGroup(kind="dense", layers=1)]),
        span=c.TokenSpan(0, 16), nbytes=4, checksum="blake2b-128:00", placement=c.Placement("dram", "n1"),
    )


def test_layout_kind_and_masks():
    assert c.Layout(groups=[c.StateGroup(kind="latent", layers=1)]).kind == "latent"
    hy = c.Layout(groups=[c.StateGroup(kind="dense", layers=1), c.StateGroup(kind="recurrent", layers=1)])
    assert hy.kind == "hybrid" and hy.group_mask == 0b11
    assert c.StateKind.RECURRENT.checkpointed and not c.StateKind.LATENT.checkpointed


# ------------------------------------------------------------------- the compiled check against the reference one

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def mutated(draw, cls):
    """A valid contract dict with one random change: a value replaced, a key dropped or added, a token id bent."""
    data = to_dict(draw(STRATEGIES[cls]))
    path = []
    node = data
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node))) if isinstance(node, dict) else draw(
            st.integers(0, len(node) - 1))
        path.append(key)
        if not isinstance(node[key], dict | list) or not node[key]:
            break
        node = node[key]
    how = draw(st.sampled_from(["replace", "drop", "add", "token"]))
    if how == "token" and data.get("token_ids"):
        i = draw(st.integers(0, len(data["token_ids"]) - 1))
        data["token_ids"][i] = draw(st.sampled_from([True, False, -1, 2**32, 1.0, 0.5, "7", None, 2**32 - 1, 0]))
    elif path:
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if how == "drop" and isinstance(parent, dict):
            del parent[path[-1]]
        elif how == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=5))] = draw(json_values)
        else:
            parent[path[-1]] = draw(json_values)
    return data


@pytest.mark.parametrize("cls", [c.Request, c.Plan, c.StateDescriptor])
def test_compiled_check_agrees_with_the_reference_validator(cls):
    """fastjsonschema (plus the C check of token ids) accepts exactly what jsonschema accepts."""
    from nexuskv.contracts import schema as _schema

    reference = _schema._validator(cls)

    def floats(data):  # JSON Schema takes an integral float (1.0) for an integer; the compiled check leaves it
        return any(type(t) is float for t in data.get("token_ids", ()) if isinstance(data.get("token_ids"), list))

    @settings(max_examples=150, deadline=None)
    @given(mutated(cls))
    def check(data):
        fast, ref = _schema.fast_valid(cls, data), reference.is_valid(data)
        assert fast == ref or (ref and floats(data)), data  # never accepts what the reference validator refuses
        text = json.dumps(data)
        if "token_ids" in data and "true" not in text and "false" not in text:
            assert _schema.fast_valid(cls, data, bools=False) == fast  # no bool in the JSON: the same verdict

    check()


def test_from_json_reads_what_from_dict_reads():
    from nexuskv import from_json

    req = c.Request(request_id="r", tenant="t", model=c.ModelIdentity(name="m"), tokenizer=c.TokenizerIdentity(
        name="k"), layout=c.Layout(groups=[c.StateGroup(kind="dense", layers=1)], page_size=4),
        token_ids=[1, 0, 2**32 - 1])  # fmt: skip
    text = json.dumps(to_dict(req))
    assert from_json(c.Request, text) == from_json(c.Request, text.encode()) == req
    bad = to_dict(req)
    bad["token_ids"][1] = False
    with pytest.raises(ContractError) as err:
        from_json(c.Request, json.dumps(bad))
    assert err.value.problems == [("token_ids[1]", "expected integer, got boolean")]
    integral = to_dict(req)
    integral["token_ids"][0] = 1.0  # an integer by JSON Schema's rule: accepted, and kept as the int 1
    assert from_json(c.Request, json.dumps(integral)).token_ids == (1, 0, 2**32 - 1)
    assert type(from_dict(c.Request, integral).token_ids[0]) is int
    with pytest.raises(ContractError) as err:
        from_json(c.Request, '{"request_id": ')
    assert err.value.problems[0][0] == "<root>" and err.value.problems[0][1].startswith("not JSON: ")
