"""The identity mapping: every field that changes what a KV block holds changes the identity, hence the keys."""

from __future__ import annotations

import pytest
from nexuskv_vllm.identity import EngineIdentity, adapter_identity, files_digest, request_scope
from nexuskv_vllm.testing import write_lora


def _build(model_dir, **kw):
    args = {"model": str(model_dir), "dtype": "torch.float32", "layers": 2, "kv_heads": 2, "head_dim": 32,
            "block_size": 128} | kw  # fmt: skip
    return EngineIdentity.build(**args)


def test_every_identity_field_reaches_the_identity(model_dir, workdir):
    base = _build(model_dir)
    assert base.model.dtype == "float32" and base.model.weights_hash and base.tokenizer.hash
    assert base.layout.page_size == 128 and base.layout.groups[0].layers == 2
    variants = [_build(model_dir, revision="r2"), _build(model_dir, dtype="bfloat16"),
                _build(model_dir, quantization="awq"), _build(model_dir, kv_cache_dtype="fp8"),
                _build(model_dir, block_size=256), _build(model_dir, tp_size=2),
                _build(model_dir, weights_hash="explicit")]  # fmt: skip
    assert all(v != base for v in variants) and len(set(variants)) == len(variants)
    assert _build(model_dir) == base  # deterministic (and cached per file stat)


def test_weights_are_hashed_by_content(workdir, model_dir):
    from nexuskv_vllm.testing import write_tiny_llama

    other = write_tiny_llama(workdir / "ident-other" / "model", seed=3)
    same = write_tiny_llama(workdir / "ident-same" / "model", seed=0)
    assert files_digest(other, suffixes=(".safetensors",)) != files_digest(model_dir, suffixes=(".safetensors",))
    assert files_digest(same, suffixes=(".safetensors",)) == files_digest(model_dir, suffixes=(".safetensors",))
    with pytest.raises(ValueError, match="weights_hash"):
        _build(workdir / "no-such-model")


def test_adapter_identity_is_name_and_weights(workdir, model_dir):
    a = write_lora(workdir / "ident-lora-a", model_dir, seed=11)
    b = write_lora(workdir / "ident-lora-b", model_dir, seed=12)
    ia, ib = adapter_identity("x", str(a)), adapter_identity("x", str(b))
    assert ia.name == ib.name and ia.weights_hash != ib.weights_hash and ia.scale == 2.0
    assert adapter_identity("y", str(a)) != ia
    with pytest.raises(ValueError, match="cannot be keyed"):
        adapter_identity("z", str(workdir / "missing"))


def test_request_scope_fails_closed_without_a_tenant():
    assert request_scope({"tenant": "t", "scope": "docs"}, "salt", None).cache_salt == "salt"
    assert request_scope(None, None, "default").tenant == "default"
    assert request_scope({"tenant": "t"}, None, "default").tenant == "t"
    for bad in ({"tenant": ""}, {"tenant": 3}, {"scope": 1}, ["tenant"]):
        assert request_scope(bad, None, None if bad != {"scope": 1} else "d") is None
    assert request_scope(None, None, None) is None


def test_vllm_identity_command_prints_the_models_identity(model_dir):
    import json

    from click.testing import CliRunner
    from nexuskv_vllm.commands import identity_command

    res = CliRunner().invoke(identity_command, [str(model_dir), "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got["model"]["weights_hash"] == _build(model_dir).model.weights_hash
    assert got["layout"]["groups"][0]["kv_heads"] == 2 and got["layout"]["page_size"] == 128
