"""The scheduler side on real vLLM `Request` objects: plans and keys from many threads equal a single-threaded
reference; a request's keys are hashed once and grow with its decode, equal to hashing all its tokens afresh."""

from __future__ import annotations

from nexuskv_vllm.scheduler import SchedulerSide
from nexuskv_vllm.testing import tokens as prompt

from conftest import vllm_request
from nexuskv import Request
from tests.conftest import run_threads

BLOCK = 128


def _commit_prefix(side: SchedulerSide, tokens: list[int], tenant: str, blocks: int) -> None:
    req = side.request(vllm_request("seed", tokens, tenant), tokens[: blocks * BLOCK])
    assert side.kernel.commit(req, [b"\x01" * 64] * blocks).accepted == blocks
    assert side.kernel.flush(10)


def _reference_keys(side: SchedulerSide, req, tokens: list[int]) -> list[bytes]:
    nreq: Request = side.request(req, tokens)
    return side.kernel.keys(nreq)


def test_plans_and_keys_from_many_threads_equal_a_single_threaded_reference(side):
    shared = prompt(3 * BLOCK, 40)
    _commit_prefix(side, shared, "t", 3)
    cases = [(f"r{i}", shared + prompt(20 + i, 50 + i) if i % 2 else prompt(400 + i, 60 + i), ("t", "u", None)[i % 3])
             for i in range(24)]  # fmt: skip
    reference = {rid: side.matched(vllm_request(rid, toks, t), 0) for rid, toks, t in cases}
    for rid, _, _ in cases:
        side.finished(vllm_request(rid, [1], None))
    assert sorted(set(reference.values())) == [0, 3 * BLOCK]  # tenant t's shared prefix is planned; the rest not
    got: dict[str, int] = {}
    keys_ok: list[bool] = []

    def worker(i: int) -> None:
        rid, toks, tenant = cases[i]
        req = vllm_request(rid, toks, tenant)
        got[rid] = side.matched(req, 0)
        req.append_output_token_ids(prompt(2 * BLOCK, 70 + i))  # decode two more blocks
        end = len(req.all_token_ids) // BLOCK
        spec = side._save(rid, 0, end * BLOCK, req, [list(range(100 * i, 100 * i + end))])
        if tenant is None:
            keys_ok.append(spec is None)  # no tenant: nothing is saved
        else:
            want = _reference_keys(side, req, list(req.all_token_ids[: end * BLOCK]))
            held = 3 if toks[: 3 * BLOCK] == shared and tenant == "t" else 0
            keys_ok.append(spec.keys == want and spec.blocks == list(range(held, end)))

    run_threads(worker, len(cases), switch_interval=1e-6)
    assert got == reference and all(keys_ok) and len(keys_ok) == len(cases)


def test_a_requests_keys_grow_with_its_decode_and_are_hashed_once(side):
    req = vllm_request("grow", prompt(300, 80), "t")
    assert side.matched(req, 0) == 0
    chain = side._tracks["grow"].chain
    keys = chain.keys  # the chain's own list: extended in place, never rebuilt
    assert len(keys) == 2 and chain.tokens == 2 * BLOCK  # the prompt's two full blocks, hashed when it came in
    for step in range(3):
        req.append_output_token_ids(prompt(BLOCK, 90 + step))
        end = len(req.all_token_ids) // BLOCK
        spec = side._save("grow", (end - 1) * BLOCK, end * BLOCK, req, [list(range(end))])
        assert spec.keys == _reference_keys(side, req, list(req.all_token_ids[: end * BLOCK]))[:end]
        assert chain.keys is keys and chain.tokens == end * BLOCK and side._tracks["grow"].chain is chain
    side.finished(req)
    assert "grow" not in side._tracks


def test_blocks_vllm_already_holds_are_neither_loaded_nor_fetched(side):
    """vLLM's own prefix cache has the first two blocks: the load spec and its (resealed) plan start at block 2."""
    toks = prompt(5 * BLOCK + 10, 90)
    _commit_prefix(side, toks, "t", 5)
    req = vllm_request("held", toks, "t")
    assert side.matched(req, 2 * BLOCK) == 3 * BLOCK
    side.allocated(req, [list(range(10, 16))], 3 * BLOCK)
    spec = side._loads["held"]
    assert spec.first == 2 and spec.block_ids == [12, 13, 14]
    assert [(s.start, s.end) for s in spec.plan.spans] == [(2 * BLOCK, 5 * BLOCK)]
    assert side.kernel.plan_seal.check(spec.plan) and spec.plan.tokens_reused == 5 * BLOCK
    got = side.kernel.materialize(spec.plan, spec.request, keys=spec.keys)
    assert got.complete and sorted(b for b, _ in got.states) == [2, 3, 4]  # blocks 0 and 1 were never read
    side.finished(req)
