"""The worker side on real tensors: a failed load blocks that step's saves of the request, and only that step's."""

from __future__ import annotations

import pytest
import torch
from nexuskv_vllm.metadata import LoadSpec, NexusKVMetadata, SaveSpec
from nexuskv_vllm.testing import tokens
from nexuskv_vllm.worker import WorkerSide

from conftest import vllm_request
from nexuskv import Plan, PlanSpan

BLOCK = 128


@pytest.fixture
def sides(side):
    worker = WorkerSide(side.kernel)
    worker.register({f"l{i}": torch.randn(8, 2, BLOCK, 16) for i in range(2)})
    return side, worker


def test_a_failed_load_blocks_only_that_steps_saves(sides):
    sched, worker = sides
    toks = tokens(3 * BLOCK, 1)
    nreq = sched.request(vllm_request("r", toks, "t"), toks)
    keys = sched.kernel.keys(nreq)
    never_planned = Plan(decision_id="forged", request_id="r", tenant="t", action="materialize",
                         tokens_total=3 * BLOCK, tokens_reused=2 * BLOCK,
                         spans=[PlanSpan(start=0, end=2 * BLOCK, tier="dram", node="n1")])  # fmt: skip
    failing = NexusKVMetadata(loads=[LoadSpec("r", nreq, keys[:2], never_planned, 0, [1, 2])])
    worker.start_load(failing)  # refused (no MAC): nothing mounted, both blocks reported
    worker.end_step(failing)  # a step with no saves at all
    assert worker.take_errors() == {1, 2} and worker.stats["blocks_failed"] == 2

    save = NexusKVMetadata(saves=[SaveSpec("r", nreq, keys, [0, 1], [3, 4])])  # the recompute, next step
    for name, cache in worker.caches.items():
        worker.save_layer(name, cache, save)
    worker.end_step(save)
    assert worker.stats["blocks_saved"] == 2 and sched.kernel.flush(10)
    got = sched.kernel.load(keys[1])
    layer0 = torch.frombuffer(bytearray(got.payload), dtype=torch.float32)[: 2 * BLOCK * 16].view(2, BLOCK, 16)
    assert torch.equal(layer0, worker.caches["l0"][4])  # the bytes of vLLM's block 4, layer by layer

    again = NexusKVMetadata(loads=[LoadSpec("r", nreq, keys[:2], never_planned, 0, [5, 6])],
                            saves=[SaveSpec("r", nreq, keys, [2], [7])])  # fmt: skip
    worker.start_load(again)
    for name, cache in worker.caches.items():
        worker.save_layer(name, cache, again)
    worker.end_step(again)
    assert worker.stats["blocks_saved"] == 2  # a step that attended over a failed block saves nothing of it
