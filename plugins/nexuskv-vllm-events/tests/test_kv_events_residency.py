"""EngineResidency: an engine's KV events become RESIDENT_TIER locations, keyed exactly, per tenant, bounded."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kv_events_helpers import LAYOUT, MODEL, PAGE, TOKENIZER, request, residency, resident_tokens, router, vhash
from nexuskv_vllm_events import EngineResidency
from nexuskv_vllm_events.testing import encode_batch, removed, stored
from nexuskv_vllm_events.wire import AllBlocksCleared, decode

from nexuskv import RESIDENT_TIER, ConfigError, Location, NodeState


def batch(*events):
    return decode(encode_batch(list(events)))


def prompt(n_blocks: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(n_blocks * PAGE)]


def store_prompt(res, tokens, salt="salt-a", split=(), tag="a"):
    """Store `tokens` as vLLM would: the first event from the root, later ones continuing their parent."""
    n = len(tokens) // PAGE
    hashes = [vhash(tag, i) for i in range(n)]
    cuts = [0, *split, n]
    for lo, hi in itertools.pairwise(cuts):
        parent = hashes[lo - 1] if lo else None
        res.apply(batch(stored(hashes[lo:hi], parent, tokens[lo * PAGE:hi * PAGE], PAGE,
                               salt=salt if lo == 0 else None)))  # fmt: skip
    return hashes


def test_stored_blocks_get_the_keys_the_router_computes_and_routes_price_them():
    with router() as k:
        res = residency(k)
        toks = prompt(6)
        store_prompt(res, toks, split=(2, 5))  # three events: a root and two continuations
        keys = k.keys(request(toks))
        assert all(k.index.get(key) is not None for key in keys)
        assert {loc for key in keys for loc, _ in k.index.get(key).locations} == {Location(RESIDENT_TIER, "e1", 0)}
        assert resident_tokens(k, request(toks)) == 6 * PAGE
        assert resident_tokens(k, request(toks + prompt(2, seed=9))) == 6 * PAGE  # a longer prompt: its prefix
        assert res.stats()["stored"] == 6 and res.stats()["held"] == 6


def test_tenants_never_see_each_others_engine_cache():
    with router() as k:
        res = residency(k)
        toks = prompt(4)
        store_prompt(res, toks, salt="salt-a")
        assert resident_tokens(k, request(toks, tenant="a")) == 4 * PAGE
        assert resident_tokens(k, request(toks, tenant="b")) == 0  # same tokens, other tenant: nothing
        store_prompt(res, toks, salt="salt-b", tag="b")
        assert resident_tokens(k, request(toks, tenant="b")) == 4 * PAGE


def test_what_cannot_be_keyed_exactly_is_not_indexed_and_is_counted():
    with router() as k:
        res = residency(k)
        toks = prompt(3)
        res.apply(batch(stored([vhash(1)], None, toks[:PAGE], PAGE, salt="salt-unknown")))  # no namespace for it
        res.apply(batch(stored([vhash(2)], None, toks[:PAGE], PAGE, salt="salt-a", lora="adapter-x")))
        res.apply(batch(stored([vhash(3)], None, toks[:PAGE], PAGE, extras=[("salt-a", ("mm-hash", 0))])))
        res.apply(batch(stored([vhash(4)], vhash("never seen"), toks[:PAGE], PAGE)))  # a parent never shown
        res.apply(batch(stored([vhash(5)], None, toks[:PAGE], PAGE, salt="salt-a", medium="CPU")))  # offloaded
        res.apply(batch(stored([vhash(6)], None, toks[:PAGE], PAGE, salt="salt-a", group=1)))  # another group
        res.apply(batch(stored([vhash(7), vhash(70)], None, toks[:PAGE], 8, salt="salt-a")))  # another block size
        # extras in a later block (an image in the prompt): the blocks before it are keyed, not it or after
        res.apply(batch(stored([vhash(8), vhash(9), vhash(10)], None, toks, PAGE,
                               extras=[("salt-a",), (("mm", 3),), None])))  # fmt: skip
        s = res.stats()
        assert (s["unattributed"], s["orphaned"], s["other_medium"], s["other_group"]) == (7, 1, 1, 1)
        assert s["stored"] == s["held"] == 1
        assert resident_tokens(k, request(toks)) == PAGE


def test_removed_and_cleared_blocks_leave_the_index_and_children_still_chain():
    with router() as k:
        res = residency(k)
        toks = prompt(4)
        hashes = store_prompt(res, toks, split=(2,))
        res.apply(batch(removed(hashes[2:])))
        assert resident_tokens(k, request(toks)) == 2 * PAGE and res.stats()["held"] == 2
        res.apply(batch(removed(hashes[1:2])))  # a parent evicted while its child is re-stored later
        res.apply(batch(stored(hashes[2:3], hashes[1], toks[2 * PAGE:3 * PAGE], PAGE)))
        assert k.index.get(k.keys(request(toks))[2]) is not None  # keyed from the remembered parent
        assert resident_tokens(k, request(toks)) == PAGE  # block 1 is gone: the prefix ends there
        res.apply(batch(AllBlocksCleared()))
        assert resident_tokens(k, request(toks)) == 0 and res.stats()["held"] == 0
        assert not k.index.holdings().get(res.location)


def test_the_oldest_hash_is_forgotten_with_its_location_at_the_bound():
    with router() as k:
        res = residency(k, max_blocks=3)
        toks = prompt(5)
        store_prompt(res, toks)
        keys = k.keys(request(toks))
        assert [k.index.get(key) is not None for key in keys] == [False, False, True, True, True]
        assert res.stats()["forgotten"] == 2 and res.stats()["held"] == 3


def test_configuration_errors_say_what_is_wrong():
    with router() as k:
        with pytest.raises(ConfigError, match="page_size 32 is not the kernel's 16"):
            EngineResidency(k, node="e1", model=MODEL, tokenizer=TOKENIZER, layout=LAYOUT.__class__(
                groups=LAYOUT.groups, page_size=32), namespaces={})
        with pytest.raises(ConfigError, match="node"):
            residency(k, node="")
        with pytest.raises(ConfigError, match="max_blocks"):
            residency(k, max_blocks=0)


def test_another_nodes_engine_cache_is_not_this_nodes():
    with router() as k:
        e1, e2 = residency(k, "e1"), residency(k, "e2")
        toks = prompt(4)
        store_prompt(e1, toks)
        store_prompt(e2, toks[: 2 * PAGE], tag="e2")
        d = k.route(request(toks), [NodeState("e1"), NodeState("e2"), NodeState("e3")], all_options=True,
                    deadline_ms=10_000)  # a busy machine (two suites at once) ran past the default budget
        assert [d.option(n).reuse_tokens for n in ("e1", "e2", "e3")] == [4 * PAGE, 2 * PAGE, 0]
        assert d.node == "e1"


@given(st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 7), st.integers(1, 4)),
                max_size=40))
def test_the_index_says_exactly_what_a_reference_model_of_the_engine_cache_says(ops):
    """Differential: the held set after any sequence of events equals a plain set's (the bound never reached)."""
    with router() as k:
        res = residency(k)
        toks = prompt(12)
        keys = k.keys(request(toks))
        ref: set[int] = set()  # blocks in the engine's cache
        seen: set[int] = set()  # blocks whose hash was ever stored since the last clear (children can be keyed)
        for op, first, n in ops:
            blocks = list(range(first, min(first + n, 12)))
            if op == "store":
                parent = vhash("a", first - 1) if first else None
                res.apply(batch(stored([vhash("a", b) for b in blocks], parent,
                                       toks[first * PAGE:(blocks[-1] + 1) * PAGE], PAGE,
                                       salt="salt-a" if first == 0 else None)))  # fmt: skip
                if first == 0 or first - 1 in seen:  # else an orphan: nothing indexed
                    ref |= set(blocks)
                    seen |= set(blocks)
            elif op == "remove":
                res.apply(batch(removed([vhash("a", b) for b in blocks])))
                ref -= set(blocks)
            else:
                res.apply(batch(AllBlocksCleared()))
                ref.clear()
                seen.clear()
        assert {b for b in range(12) if k.index.get(keys[b]) is not None} == ref
        assert res.stats()["held"] == len(ref)


def test_many_threads_applying_events_leave_the_state_a_reference_model_predicts():
    """Eight threads, each its own engine prompt, storing and removing: the final state is each thread's last word."""
    with router() as k:
        res = residency(k, max_blocks=10_000)
        expected: dict[int, set[int]] = {}

        def work(t: int) -> None:
            rnd = random.Random(t)
            toks = prompt(8, seed=t)
            hashes = [vhash("t", t, b) for b in range(8)]
            held: set[int] = set()
            for _ in range(200):
                if rnd.random() < 0.6:
                    res.apply(batch(stored(hashes, None, toks, PAGE, salt="salt-a")))
                    held = set(range(8))
                else:
                    b = rnd.randrange(8)
                    res.apply(batch(removed(hashes[b:])))
                    held -= set(range(b, 8))
            expected[t] = held

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for t, held in expected.items():
            keys = k.keys(request(prompt(8, seed=t)))
            assert {b for b in range(8) if k.index.get(keys[b]) is not None} == held
        assert res.stats()["held"] == sum(len(h) for h in expected.values())


def test_a_hash_reused_for_other_blocks_never_leaves_its_old_claims_behind():
    """A writer re-using one vLLM hash with other tokens cannot grow the index past the bound: the old claim ends."""
    with router() as k:
        res = residency(k, max_blocks=4)
        for seed in range(50):
            toks = prompt(1, seed=seed)
            res.apply(batch(stored([vhash("same")], None, toks, PAGE, salt="salt-a")))
        assert k.index.holdings().get(res.location) == 1 and res.stats()["held"] == 1
        assert resident_tokens(k, request(prompt(1, seed=49))) == PAGE
        assert resident_tokens(k, request(prompt(1, seed=48))) == 0
        res.apply(batch(stored([vhash("dup")] * 3, None, prompt(3, seed=99), PAGE, salt="salt-a")))
        assert k.index.holdings().get(res.location) == 2 and res.stats()["held"] == 2


def test_a_block_of_an_adapter_named_only_by_id_is_not_indexed():
    with router() as k:
        res = residency(k)
        event = stored([vhash(1)], None, prompt(1), PAGE, salt="salt-a")
        event.lora_id = 3
        res.apply(batch(event))
        assert res.stats()["unattributed"] == 1 and res.stats()["held"] == 0
