"""The model-checked stress harness, bounded for CI (bench/stress.py runs it for a million operations)."""

from __future__ import annotations

import attrs

from nexuskv import Namespace
from nexuskv.contracts import Request
from nexuskv.testing.stress import LAYOUTS, MODEL, TOKENIZER, reference_payload, run


def test_a_bounded_stress_run_restores_no_wrong_state_and_keeps_the_index_exact():
    r = run(operations=8_000, threads=8, seed=7)
    assert r.errors == [] and r.index_problems == []
    assert r.wrong_keys == 0 and r.wrong_restores == 0
    assert r.operations >= 8_000
    # The run exercised what it claims to: real restores, shared ones, refusals, evictions, prefetches.
    assert r.blocks_restored > 500 and r.shared_restores > 0 and r.refused_plans > 0
    assert r.fallbacks > 0 and r.stats["writer"]["written"] > 0 and r.stats["prefetch"]["done"] > 0
    assert sum(r.stats["evictions"].values()) > 0


def test_the_reference_model_tells_identities_apart():
    req = Request(request_id="r", tenant="chat", model=MODEL, tokenizer=TOKENIZER, layout=LAYOUTS[0],
                  token_ids=list(range(64)))  # fmt: skip
    base = reference_payload(req.namespace, req, 1, 0)
    assert base == reference_payload(req.namespace, attrs.evolve(req, token_ids=[*range(32), 7, 7]), 1, 0)
    assert base != reference_payload(Namespace("rag", "docs"), req, 1, 0)
    assert base != reference_payload(req.namespace, attrs.evolve(req, token_ids=[1, *range(1, 64)]), 1, 0)
    assert base != reference_payload(req.namespace, req, 1, 1) != reference_payload(req.namespace, req, 2, 0)
