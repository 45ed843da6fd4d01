import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv import (
    AdapterIdentity,
    BlockKeyer,
    ConfigError,
    ExtraInput,
    Layout,
    ModelIdentity,
    Namespace,
    StateGroup,
    TokenizerIdentity,
    checksum,
    load_secret,
    verify_checksum,
)
from tests.conftest import SECRET, layout_of, make_request

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=200)
KEYER = BlockKeyer(SECRET, page_size=4)


def keys_of(req, keyer=KEYER):
    return keyer.request_keys(req)


@given(tokens)
def test_equal_inputs_give_equal_keys(toks):
    assert keys_of(make_request(toks)) == keys_of(make_request(toks))


@given(tokens)
def test_only_full_blocks_are_keyed(toks):
    assert len(keys_of(make_request(toks))) == len(toks) // 4


@given(tokens, st.integers(0, 200))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(toks, cut):
    full = keys_of(make_request(toks))
    assert keys_of(make_request(toks[:cut])) == full[: min(cut, len(toks)) // 4]


@given(st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=64), st.data())
def test_any_differing_token_makes_disjoint_chains_from_that_block(toks, data):
    i = data.draw(st.integers(0, len(toks) - 1))
    other = list(toks)
    other[i] = (other[i] + data.draw(st.integers(1, 2**32 - 1))) % 2**32
    a, b = keys_of(make_request(toks)), keys_of(make_request(other))
    block = i // 4
    assert a[:block] == b[:block]
    assert set(a[block:]).isdisjoint(b[block:])


IDENTITY_VARIANTS = {
    "tenant": dict(tenant="globex"),
    "scope": dict(scope="team-b"),
    "cache_salt": dict(cache_salt="s"),
    "model name": dict(model=ModelIdentity(name="other", revision="1")),
    "model revision": dict(model=ModelIdentity(name="tiny", revision="2")),
    "weights hash": dict(model=ModelIdentity(name="tiny", revision="1", weights_hash="abc")),
    "dtype": dict(model=ModelIdentity(name="tiny", revision="1", dtype="bfloat16")),
    "quantization": dict(model=ModelIdentity(name="tiny", revision="1", quantization="fp8")),
    "adapter": dict(model=ModelIdentity(name="tiny", revision="1", adapter=AdapterIdentity(name="lora-a"))),
    "adapter weights": dict(
        model=ModelIdentity(name="tiny", revision="1", adapter=AdapterIdentity(name="lora-a", weights_hash="x"))
    ),
    "tokenizer": dict(tokenizer=TokenizerIdentity(name="tok", revision="2")),
    "layout kind": dict(layout=layout_of("latent", page_size=4)),
    "layout heads": dict(layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=4)], page_size=4)),
    "tp rank": dict(layout=Layout(groups=layout_of("dense").groups, page_size=4, tp_rank=1, tp_size=2)),
}


@pytest.mark.parametrize("variant", sorted(IDENTITY_VARIANTS))
@settings(max_examples=25)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=40))
def test_any_differing_identity_field_gives_disjoint_key_chains(variant, toks):
    base = make_request(toks, layout=layout_of("dense", page_size=4))
    changed = make_request(toks, **{"layout": layout_of("dense", page_size=4), **IDENTITY_VARIANTS[variant]})
    assert set(keys_of(base)).isdisjoint(keys_of(changed))


def test_latent_state_is_shared_across_tensor_parallel_ranks():
    lat = layout_of("latent", page_size=4)
    r0 = make_request(range(16), layout=lat)
    r1 = make_request(range(16), layout=Layout(groups=lat.groups, page_size=4, tp_rank=1, tp_size=2))
    assert keys_of(r0) == keys_of(r1)


def test_different_secrets_give_disjoint_keys():
    req = make_request(range(64))
    other = BlockKeyer(bytes(reversed(SECRET)), page_size=4)
    assert set(keys_of(req)).isdisjoint(keys_of(req, other))


def test_extra_inputs_change_only_their_block_and_after():
    plain = make_request(range(32))
    img = make_request(range(32), extra_inputs=[ExtraInput(position=9, digest="sha256:abc")])
    a, b = keys_of(plain), keys_of(img)
    assert a[:2] == b[:2] and set(a[2:]).isdisjoint(b[2:])
    img2 = make_request(range(32), extra_inputs=[ExtraInput(position=9, digest="sha256:abd")])
    assert keys_of(img2)[2] != b[2]


@given(st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=30), max_size=6))
def test_key_chain_grows_to_the_same_keys(turns):
    chain = KEYER.chain(KEYER.request_root(make_request([])))
    everything: list[int] = []
    for t in turns:
        chain.extend(t)
        everything += t
    assert chain.keys == keys_of(make_request(everything))


def test_keys_are_16_bytes_and_root_depends_on_namespace():
    ks = keys_of(make_request(range(8)))
    assert all(len(k) == 16 for k in ks)
    r = make_request([])
    ns_a = KEYER.root(Namespace("a"), r.model, r.tokenizer, r.layout)
    ns_b = KEYER.root(Namespace("a", scope="x"), r.model, r.tokenizer, r.layout)
    assert ns_a != ns_b


def test_secret_generated_once_and_persisted(tmp_path):
    p = tmp_path / "sub" / "secret"
    s1 = load_secret(path=p)
    s2 = load_secret(path=p)
    assert s1 == s2 and len(s1) == 32
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def test_secret_from_env_and_config(monkeypatch):
    monkeypatch.setenv("NEXUSKV_SECRET", "ab" * 16)
    assert load_secret() == b"\xab" * 16
    assert load_secret("cd" * 20) == b"\xcd" * 20


@pytest.mark.parametrize("bad", ["zz" * 16, "ab" * 4])
def test_bad_secret_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="config secret"):
        load_secret(bad)


def test_a_binary_secret_file_is_a_clear_error(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"(yK\xf2k\x07JL" * 4)  # raw random bytes, not hex text
    with pytest.raises(ConfigError, match="the secret file is not text; it holds the secret as hex"):
        load_secret(path=path)


def test_keyer_rejects_short_secret_and_bad_page():
    with pytest.raises(ConfigError):
        BlockKeyer(b"short")
    with pytest.raises(ConfigError):
        BlockKeyer(SECRET, page_size=0)


def test_checksum_roundtrip_and_mismatch():
    c = checksum(b"payload")
    assert c.startswith("xxh3-128:") and len(c) == len("xxh3-128:") + 32
    assert verify_checksum(b"payload", c) and verify_checksum(memoryview(b"payload"), c)
    assert not verify_checksum(b"payloaD", c)
    assert not verify_checksum(b"payload", "md5:" + c.split(":")[1])


def test_every_known_algorithm_verifies_and_unknown_ones_never_do():
    import hashlib

    from nexuskv.contracts.checksums import CHECKSUMS, DEFAULT_CHECKSUM, checksum_known

    assert DEFAULT_CHECKSUM == "xxh3-128" and set(CHECKSUMS) == {"xxh3-128", "blake2b-128"}
    legacy = "blake2b-128:" + hashlib.blake2b(b"payload", digest_size=16).hexdigest()  # descriptors before 0.2
    assert checksum(b"payload", "blake2b-128") == legacy and verify_checksum(bytearray(b"payload"), legacy)
    for algo in CHECKSUMS:
        c = checksum(b"x" * 5000, algo)
        assert checksum_known(c) and verify_checksum(b"x" * 5000, c) and not verify_checksum(b"x" * 4999, c)
    assert not checksum_known("sha3-256:00") and not verify_checksum(b"", "sha3-256:00")
    assert not verify_checksum(b"payload", "xxh3-128")  # no digest at all


def test_generated_secret_directory_is_private(tmp_path):
    p = tmp_path / "state" / "nexuskv" / "secret"
    load_secret(path=p)
    assert stat.S_IMODE(os.stat(p.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert [q.name for q in p.parent.iterdir()] == ["secret"]  # no temporary file left behind


def test_concurrent_first_starts_agree_on_one_secret_and_never_read_a_partial_file(tmp_path):
    from tests.conftest import run_threads

    for round_ in range(20):
        p = tmp_path / f"r{round_}" / "secret"
        got: list[bytes] = []
        run_threads(lambda _i, p=p, got=got: got.append(load_secret(path=p)), 12)
        assert len(got) == 12 and len(set(got)) == 1
