"""The native keyer against the pure-Python reference: every key bit-identical, every error the same kind."""

import hashlib
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv import CHAIN_PERSON, BlockKeyer, ExtraInput, Layout, ModelIdentity, Request, StateGroup, TokenizerIdentity
from nexuskv_native import NativeKeyer, _native

SECRET = bytes(range(32))

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=300)
digests = st.text("0123456789abcdef", min_size=1, max_size=40)
extras = st.lists(st.builds(ExtraInput, position=st.integers(0, 320), digest=digests), max_size=6)


def pair(page: int) -> tuple[BlockKeyer, NativeKeyer]:
    return BlockKeyer(SECRET, page), NativeKeyer(SECRET, page)


@given(data=st.binary(max_size=600), person=st.binary(max_size=16))
def test_blake2b_is_hashlibs(data, person):
    assert _native.blake2b16(data, person) == hashlib.blake2b(data, digest_size=16, person=person).digest()


@settings(max_examples=300)
@given(page=st.integers(1, 40), toks=tokens, xs=extras, parent=st.binary(min_size=16, max_size=16))
def test_chains_with_extras_are_bit_identical(page, toks, xs, parent):
    ref, nat = pair(page)
    assert nat.keys(parent, toks, xs) == ref.keys(parent, toks, xs)
    offset = page * 3
    assert nat.extend(parent, toks, xs, offset=offset) == ref.extend(parent, toks, xs, offset=offset)
    for blocks in (1, 3, 128):
        assert list(nat.chunks(parent, toks, xs, blocks)) == list(ref.chunks(parent, toks, xs, blocks))


@settings(max_examples=100)
@given(page=st.integers(1, 20), turns=st.lists(tokens, min_size=1, max_size=5), xs=extras)
def test_a_growing_session_chain_is_bit_identical(page, turns, xs):
    ref, nat = pair(page)
    a, b = ref.chain(b"r" * 16), nat.chain(b"r" * 16)
    for turn in turns:
        assert b.extend(turn, xs) == a.extend(turn, xs)
    assert b.keys == a.keys


def test_request_keys_and_roots_match_for_every_kind():
    for kind in ("dense", "latent", "windowed", "recurrent"):
        layout = Layout(groups=[StateGroup(kind=kind, layers=2, kv_heads=2, head_dim=8, window=64 if kind ==
                                           "windowed" else None)], page_size=16)  # fmt: skip
        req = Request(request_id="r", tenant="t", model=ModelIdentity(name="m", revision="1"),
                      tokenizer=TokenizerIdentity(name="tok"), layout=layout, token_ids=list(range(5000)),
                      scope="s", cache_salt="salt")  # fmt: skip
        ref, nat = pair(16)
        assert nat.request_keys(req) == ref.request_keys(req)
        assert len(nat.request_keys(req)) == 312


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_bad_token_ids_are_the_same_value_error(bad):
    ref, nat = pair(4)
    toks = [1, 2, 3, 4, 5, bad]  # in the partial last block: still checked, as the reference does
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
        ref.keys(b"p" * 16, toks)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
        nat.keys(b"p" * 16, toks)


def test_big_and_index_like_ints_are_accepted_like_the_reference():
    class Tok:
        def __index__(self):
            return 2**31 + 5

    ref, nat = pair(2)
    toks = [2**32 - 1, 2**30, 2**31, True, Tok(), 0]
    assert nat.keys(b"p" * 16, toks) == ref.keys(b"p" * 16, toks)


@pytest.mark.parametrize("pipeline", [0, 1, 64])  # never piped, always piped (even one block), from 64 blocks
def test_both_hashing_paths_give_the_same_keys(pipeline):
    ref, nat = pair(16)
    old = _native.pipeline(pipeline)
    try:
        for n in (0, 15, 16, 17, 16 * 63, 16 * 64 + 3, 16 * 700):
            toks = [(i * 7919) % 2**32 for i in range(n)]
            xs = [ExtraInput(position=n // 2, digest="ab" * 8)] if n else []
            assert nat.keys(b"p" * 16, toks, xs) == ref.keys(b"p" * 16, toks, xs)
            assert nat.keys_until(b"p" * 16, toks, xs, 1e18) == ref.keys(b"p" * 16, toks, xs)
        with pytest.raises(ValueError, match="token ids"):
            nat.keys(b"p" * 16, [1] * (16 * 100) + [-1])  # the reader fails while the hasher waits: no hang
    finally:
        _native.pipeline(old)


def test_an_index_method_that_changes_the_list_is_an_error_not_a_crash():
    toks = list(range(16 * 40))

    class Shrinks:
        def __index__(self):
            toks.clear()  # the list being read loses every item, this one included
            return 5

    toks[3] = Shrinks()
    with pytest.raises(RuntimeError, match="changed while they were read"):
        _native.chain(b"p" * 16, toks, 16, None, CHAIN_PERSON)

    class Fails:
        def __index__(self):
            toks2.clear()
            raise TypeError("no")

    toks2 = [Fails(), *range(100)]
    with pytest.raises(ValueError, match="is not an integer"):
        _native.chain(b"p" * 16, toks2, 16, None, CHAIN_PERSON)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="extras must be a dict or None"):
        _native.chain(b"p" * 16, [1] * 16, 16, [], CHAIN_PERSON)
    with pytest.raises(ValueError, match="must not be negative"):
        _native.chain(b"p" * 16, [1] * 16, 16, None, CHAIN_PERSON, -1, 16)
    with pytest.raises(ValueError, match="parent must be 16 bytes"):
        _native.chain(b"p", [1] * 16, 16, None, CHAIN_PERSON)


def test_person_is_the_kernels():
    assert CHAIN_PERSON == b"nexuskv.block"
    assert NativeKeyer.name == "native" and NativeKeyer.deadline_chunk > BlockKeyer.deadline_chunk


def test_long_chains_from_many_threads_equal_the_reference():
    """The GIL is released while a long chain hashes: threads interleave and every answer is still exact."""
    ref, nat = pair(16)
    reqs = [[(i * 7919 + t) % 128_000 for i in range(16 * 512)] for t in range(8)]
    want = [ref.keys(b"p" * 16, toks) for toks in reqs]
    got: dict[int, list[list[bytes]]] = {}

    def work(t: int) -> None:
        got[t] = [nat.keys(b"p" * 16, reqs[(t + j) % 8]) for j in range(8)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(16):
        assert got[t] == [want[(t + j) % 8] for j in range(8)]


def test_keys_until_stops_at_the_deadline_in_c_and_keeps_a_true_prefix():
    import time

    ref, nat = pair(16)
    toks = list(range(16 * 32768))  # about 1.5 ms to read the ids, 5 ms to hash them
    want = ref.keys(b"p" * 16, toks)
    assert abs(_native.now() - time.perf_counter()) < 0.01  # C checks the clock perf_counter reads
    assert nat.keys_until(b"p" * 16, toks, (), time.perf_counter() - 1) == []  # checked before the first block
    assert nat.keys_until(b"p" * 16, toks, (), None) == want
    assert nat.keys_until(b"p" * 16, toks, (), time.perf_counter() + 60) == want
    for keyer in (nat, ref):  # every answer is a true prefix; some deadline falls inside the hashing
        t0 = time.perf_counter()
        keyer.keys_until(b"p" * 16, toks, (), None)
        full = time.perf_counter() - t0
        parts = [keyer.keys_until(b"p" * 16, toks, (), time.perf_counter() + full * f / 10) for f in range(1, 10)]
        assert all(p == want[: len(p)] for p in parts)
        assert any(0 < len(p) < len(want) for p in parts), [len(p) for p in parts]
