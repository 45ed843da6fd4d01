import pytest
import simpy
from _sim_fakes import request

from nexuskv_sim.engine import Engine, Job
from nexuskv_sim.profile import ModelProfile

M = ModelProfile("m", 1, overhead_ms=1.0, per_token_ms=0.01, attn_ms=1e-5, per_decode_ms=0.5, decode_ctx_ms=0.001)


def chunk(tokens, ctx):
    return tokens * M.per_token_ms + tokens * (ctx + tokens / 2) * M.attn_ms


def run(reqs, chunk_tokens=512, max_batch=256):
    env = simpy.Environment()
    first, finish = {}, {}
    eng = Engine(env, "n0", M, chunk_tokens=chunk_tokens, max_batch=max_batch, hbm_capacity_blocks=10,
                 on_first_token=lambda j: first.__setitem__(j.req.rid, env.now),
                 on_finish=lambda j: finish.__setitem__(j.req.rid, env.now), on_report=lambda n, load: None)

    def arrive(req, cached):
        yield env.timeout(req.arrival_ms)
        job = Job(req, (), "n0")
        eng.admit(job, req.input_tokens - cached)
        eng.enqueue(job, req.input_tokens - cached)

    for req, cached in reqs:
        env.process(arrive(req, cached))
    env.run()
    return first, finish, eng


def test_single_request_ttft_is_its_iterations():
    req = request(0, [1, 2], tokens=1000, out=1)
    first, finish, eng = run([(req, 0)])
    want = (M.overhead_ms + chunk(512, 0)) + (M.overhead_ms + chunk(488, 512))
    assert first[0] == pytest.approx(want)
    assert finish[0] == first[0] and eng.iterations == 2


def test_cached_tokens_are_context_not_work():
    req = request(0, [1, 2], tokens=1000, out=1)
    first, _, _ = run([(req, 512)])
    assert first[0] == pytest.approx(M.overhead_ms + chunk(488, 512))


def test_decodes_one_token_per_iteration_with_growing_context():
    req = request(0, [1], tokens=100, out=4)
    first, finish, eng = run([(req, 0)])
    decode = sum(M.overhead_ms + M.per_decode_ms + (100 + i) * M.decode_ctx_ms for i in (1, 2, 3))
    assert finish[0] == pytest.approx(first[0] + decode)
    assert eng.iterations == 4 and eng.active_blocks == 0 and eng.queued_tokens == 0


def test_fcfs_chunks_share_an_iteration_under_the_budget():
    a = request(0, [1], tokens=300, out=1)
    b = request(1, [2], tokens=300, out=1)
    first, _, _ = run([(a, 0), (b, 0)])
    one = M.overhead_ms + chunk(300, 0) + chunk(212, 0)  # a whole, then b's first 212 tokens
    assert first[0] == pytest.approx(one)
    assert first[1] == pytest.approx(one + M.overhead_ms + chunk(88, 212))


def test_max_batch_holds_new_prefills_back():
    a = request(0, [1], tokens=100, out=50)
    b = request(1, [2], tokens=100, out=1, at=5.0)
    first, _, _ = run([(a, 0), (b, 0)], max_batch=1)
    # b may only start once a stops decoding
    assert first[1] > first[0] + 48 * M.overhead_ms
