from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv import ModelIdentity, TensorSpec
from nexuskv_tier_disk import codec


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=5000), name=st.sampled_from(codec.CODECS), elem=st.sampled_from([None, 1, 2, 3, 4, 8]),
       level=st.sampled_from([1, 3]))  # fmt: skip
def test_encode_decode_roundtrip_over_random_bytes(data, name, elem, level):
    enc = codec.encode(data, name, elem_size=elem, level=level)
    assert enc.codec in codec.CODECS and len(enc.data) <= len(data)
    assert bytes(codec.decode(enc.data, enc.codec, len(data), elem_size=enc.elem_size)) == data


_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}  # bf16 as its bit pattern


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(sorted(_DTYPES)), n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-3, 1.0, 300.0]))  # fmt: skip
def test_roundtrip_over_random_float_payloads(dtype, n, seed, scale):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n) * scale
    if dtype == "bfloat16":
        raw = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = values.astype(_DTYPES[dtype]).tobytes()
    elem = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    enc = codec.encode(raw, "shuffle-zstd", elem_size=elem)
    assert bytes(codec.decode(enc.data, enc.codec, len(raw), elem_size=enc.elem_size)) == raw


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 1001])
@pytest.mark.parametrize("elem", [2, 3, 4])
def test_shuffle_is_a_byte_plane_transpose(n, elem):
    data = bytes(range(256)) * 4
    data = data[:n]
    out = codec.shuffle(data, elem)
    whole = n - n % elem
    assert out[: whole // elem] == data[:whole:elem]  # first plane: every value's first byte
    assert out[whole:] == data[whole:]
    assert codec.unshuffle(out, elem) == data


def test_shuffle_beats_plain_zstd_on_fp16_like_kv():
    raw = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float16).tobytes()
    plain = codec.encode(raw, "zstd")
    shuffled = codec.encode(raw, "shuffle-zstd", elem_size=2)
    assert shuffled.codec == "shuffle-zstd" and len(shuffled.data) < len(plain.data) < len(raw)


def test_incompressible_payloads_stay_raw():
    raw = np.random.default_rng(1).bytes(4096)
    assert codec.encode(raw, "zstd").codec == "raw"
    assert codec.encode(raw, "shuffle-zstd", elem_size=2).codec == "raw"


def test_element_size_from_tensors_then_model_dtype(item):
    desc = item(1).desc
    assert codec.element_size(desc) == 2  # model dtype float16, no quantization
    half = TensorSpec("k", "bfloat16", (4,))
    assert codec.element_size(attrs.evolve(desc, tensors=(half, half))) == 2
    mixed = (half, TensorSpec("v", "float32", (4,)))
    assert codec.element_size(attrs.evolve(desc, tensors=mixed)) is None
    unknown = (TensorSpec("k", "int8", (4,)),)
    assert codec.element_size(attrs.evolve(desc, tensors=unknown)) is None
    quant = ModelIdentity("m", quantization="fp8-kv")
    assert codec.element_size(attrs.evolve(desc, model=quant)) is None


def test_decode_rejects_bad_input():
    raw = bytes(1000)
    enc = codec.encode(raw, "zstd")
    with pytest.raises(ValueError):
        codec.decode(enc.data, "zstd", 999)
    with pytest.raises(ValueError):
        codec.decode(b"not a zstd frame", "zstd", 1000)
    with pytest.raises(ValueError):
        codec.decode(enc.data, "lz4", 1000)
    with pytest.raises(ValueError):
        codec.encode(raw, "lz4")
