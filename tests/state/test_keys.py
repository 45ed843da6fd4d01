"""Keys: plain, per session (cached chains, LRU-bounded, safe under threads), and under another namespace."""

from __future__ import annotations

import random
import threading

import pytest

from nexuskv import BlockKeyer, ConfigError, Namespace
from nexuskv.state.keys import Keys
from tests.conftest import SECRET, layout_of, make_request, run_threads


@pytest.fixture
def keys():
    return Keys(BlockKeyer(SECRET, 16), session_cache=4)


def test_plain_keys_check_the_page_size(keys):
    req = make_request(range(100))
    assert keys.keys(req) == BlockKeyer(SECRET, 16).request_keys(req)
    with pytest.raises(ConfigError, match="page_size 32 is not the kernel's page_size 16"):
        keys.keys(make_request(range(100), layout=layout_of("dense", page_size=32)))


def test_a_session_continues_its_chain_and_restarts_when_the_history_changes(keys):
    turn1 = make_request(range(40))
    turn2 = make_request([*range(40), *range(100, 130)])
    assert keys.keys_for(turn1, "s") == keys.keys(turn1)
    assert keys.keys_for(turn2, "s") == keys.keys(turn2)
    edited = make_request([7, *range(1, 70)])  # the history was edited: the chain is not reused
    assert keys.keys_for(edited, "s") == keys.keys(edited)
    other = make_request(range(70), tenant="globex")  # same session name, another identity
    assert keys.keys_for(other, "s") == keys.keys(other)


def test_the_session_cache_is_bounded_least_recently_used_first(keys):
    for i in range(6):
        keys.keys_for(make_request(range(32)), f"s{i}")
    keys.keys_for(make_request(range(48)), "s2")  # s2 is used again: s3 is now the oldest
    keys.keys_for(make_request(range(32)), "s6")
    assert list(keys._sessions) == ["s4", "s5", "s2", "s6"]


def test_returned_keys_are_a_copy(keys):
    got = keys.keys_for(make_request(range(32)), "s")
    got.append(b"x" * 16)
    assert keys.keys_for(make_request(range(48)), "s") == keys.keys(make_request(range(48)))


def test_keys_under_another_namespace_are_that_namespaces_keys(keys):
    req = make_request(range(64), tenant="chat")
    ns = Namespace(tenant="rag", scope="docs")
    owner_req = make_request(range(64), tenant="rag", scope="docs")
    assert keys.under(ns, req) == keys.keys(owner_req) != keys.keys(req)


def test_held_prefix_stops_after_the_first_chunk_with_an_unheld_block(keys):
    req = make_request(range(16 * 100), tenant="chat")
    ns = Namespace(tenant="rag", scope="docs")
    full = keys.under(ns, req)
    held = set(full[:20])
    got = keys.held_prefix(ns, req, lambda k: True if k in held else None)
    assert got == full[: len(got)] and 20 < len(got) < 100  # doubling chunks: 8, 16 (the chunk with the gap)
    assert keys.held_prefix(ns, req, lambda k: None) == full[:8]
    assert keys.held_prefix(ns, req, lambda k: True) == full
    ckpt = make_request(range(16 * 10), tenant="chat", layout=layout_of("recurrent"))
    assert keys.held_prefix(ns, ckpt, lambda k: None) == keys.under(ns, ckpt)  # checkpoints restore past gaps


def test_sessions_are_safe_under_many_threads():
    """Many threads extend the same sessions; every key list equals the reference (a fresh chain)."""
    keyer = BlockKeyer(SECRET, 16)
    keys = Keys(keyer, session_cache=8)
    rng = random.Random(5)
    base = [rng.randrange(50_000) for _ in range(16 * 40)]
    tenants = ["acme", "globex", "initech"]
    wrong: list[str] = []
    calls = [0]
    lock = threading.Lock()

    def worker(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(150):
            session = f"s{r.randrange(6)}"
            tenant = tenants[int(session[1:]) % 3] if r.random() < 0.9 else r.choice(tenants)
            n = r.randrange(1, len(base))
            toks = base[:n] if r.random() < 0.8 else [r.randrange(50_000), *base[1:n]]
            req = make_request(toks, tenant=tenant)
            got = keys.keys_for(req, session)
            if got != keyer.request_keys(req):
                wrong.append(f"{session} {tenant} {n}")
            with lock:
                calls[0] += 1

    run_threads(worker, 8, switch_interval=1e-6)  # switch threads as often as CPython allows: races show up
    assert calls[0] == 8 * 150
    assert wrong == []


# ------------------------------------------------------------------------------------------ extra inputs

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nexuskv import ExtraInput  # noqa: E402


def test_a_session_turn_with_an_image_never_gets_the_text_only_keys(keys):
    text = make_request(range(64), request_id="t1")
    image = make_request(range(64), request_id="t2", extra_inputs=[ExtraInput(position=20, digest="sha256:img")])
    assert keys.keys_for(text, "s") == keys.keys(text)
    got = keys.keys_for(image, "s")
    assert got == keys.keys(image)
    assert got[0] == keys.keys(text)[0] and got[1] != keys.keys(text)[1]  # the image is in block 1


turns = st.lists(
    st.tuples(st.integers(0, 40),  # tokens added this turn
              st.lists(st.tuples(st.integers(0, 120), st.sampled_from(["a", "b"])), max_size=3),  # extras
              st.booleans()),  # keep the earlier extras (a continuation) or not (a different history)
    min_size=1, max_size=6,
)  # fmt: skip


@given(turns)
def test_every_session_turn_gets_exactly_the_keys_of_its_request(plan):
    keys = Keys(BlockKeyer(SECRET, 4), session_cache=2)
    toks: list[int] = []
    extras: list[ExtraInput] = []
    for i, (n, new_extras, keep) in enumerate(plan):
        toks = toks + list(range(len(toks), len(toks) + n))
        if not keep:
            extras = []
        extras = extras + [ExtraInput(position=p, digest=d) for p, d in new_extras if p < max(len(toks), 1)]
        req = make_request(toks, layout=layout_of("dense", page_size=4), request_id=f"t{i}", extra_inputs=extras)
        assert keys.keys_for(req, "s") == keys.keys(req)
        assert keys.session(req).keys == keys.keys(req)


@given(st.integers(0, 300), st.lists(st.tuples(st.integers(0, 299), st.sampled_from(["a", "b"])), max_size=4))
def test_keys_hashed_in_deadline_chunks_are_the_plain_keys(n, extras):
    import time

    keys = Keys(BlockKeyer(SECRET, 4))
    req = make_request(range(n), layout=layout_of("dense", page_size=4),
                       extra_inputs=[ExtraInput(position=p, digest=d) for p, d in extras if p < max(n, 1)])  # fmt: skip
    assert keys.keys(req, deadline=time.perf_counter() + 60) == keys.keys(req)
