"""The worker side beyond one process, on real tensors and a real kernel: a tensor-parallel rank keys its own shard,
asynchronous loads mount in the background and are given up past the load timeout without ever writing late, an
aborted request's blocks are released only once its load can no longer write, and each rank's report tells the
scheduler what it holds."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch
from attrs import evolve
from nexuskv_vllm.metadata import LoadSpec, NexusKVMetadata, NexusKVWorkerMeta, SaveSpec
from nexuskv_vllm.testing import tokens
from nexuskv_vllm.worker import WorkerSide

from conftest import vllm_request
from nexuskv import PlanAction

BLOCK = 128


def _worker(kernel, rank: int = 0, size: int = 1) -> WorkerSide:
    worker = WorkerSide(kernel, tp_rank=rank, tp_size=size)
    torch.manual_seed(rank)
    worker.register({f"l{i}": torch.randn(8, 2, BLOCK, 16) for i in range(2)})
    return worker


def _save(worker: WorkerSide, spec: SaveSpec) -> None:
    meta = NexusKVMetadata(saves=[spec])
    for name, cache in worker.caches.items():
        worker.save_layer(name, cache, meta)
    worker.end_step(meta)


def _saved_request(side, worker: WorkerSide, rid: str = "r", blocks: int = 3):
    """A request of `blocks` + 1 blocks whose first `blocks` blocks `worker` saved (from its blocks 1..blocks)."""
    toks = tokens((blocks + 1) * BLOCK, 7)
    nreq = side.request(vllm_request(rid, toks, "t"), toks)
    keys = side.kernel.keys(nreq)
    _save(worker, SaveSpec(rid, nreq, keys, list(range(blocks)), list(range(1, blocks + 1))))
    assert worker.kernel.flush(10)
    return nreq, keys


def test_a_rank_keys_its_own_shard_and_reports_by_the_schedulers_keys(side):
    rank0, rank1 = _worker(side.kernel, 0, 2), _worker(side.kernel, 1, 2)
    toks = tokens(3 * BLOCK, 3)
    nreq = side.request(vllm_request("r", toks, "t"), toks)
    nreq = evolve(nreq, layout=evolve(nreq.layout, tp_size=2))
    keys = side.kernel.keys(nreq)  # the scheduler's: rank 0's layout
    for w in (rank0, rank1):
        _save(w, SaveSpec("r", nreq, keys, [0, 1], [1, 2]))
    assert side.kernel.flush(10)
    own1 = rank1._own(nreq, keys, 2)[1]
    assert own1 != keys[:2] and rank0._own(nreq, keys, 2)[1][:2] == keys[:2]
    shard0, shard1 = side.kernel.load(keys[0]), side.kernel.load(own1[0])
    assert shard0.descriptor.layout.tp_rank == 0 and shard1.descriptor.layout.tp_rank == 1
    assert bytes(shard0.payload) != bytes(shard1.payload)  # each rank's own heads
    reports = [w.worker_meta() for w in (rank0, rank1)]
    assert set(reports[0].stored) == set(reports[1].stored) == set(keys[:2])  # by the scheduler's keys, both
    merged = reports[0].aggregate(reports[1])
    assert set(merged.stored) == set(keys[:2]) and {v[3] for v in merged.stored.values()} == {0b11}


def test_a_block_is_indexed_while_every_rank_holds_it_whatever_the_step(side):
    """Ranks place a block in different steps; the scheduler indexes it once the last one reports, drops it when
    one rank loses it, and indexes it again when that rank alone stores it again."""
    from nexuskv_vllm.scheduler import SchedulerSide

    sched = SchedulerSide(side.kernel, evolve(side.engine, layout=evolve(side.engine.layout, tp_size=2)),
                          shares_worker_kernel=False)  # fmt: skip
    k1, k2 = b"k1" * 8, b"k2" * 8
    r0 = NexusKVWorkerMeta(stored={k1: ("dram", "n1", 1, 0b01, 1), k2: ("dram", "n1", 1, 0b01, 1)})
    r1 = NexusKVWorkerMeta(stored={k2: ("dram", "n1", 1, 0b10, 1)}, removed={b"gone" * 4: 0b10})
    step1 = r0.aggregate(r1)
    assert step1.stored[k2][3] == 0b11 and step1.stored[k1][3] == 0b01 and step1.removed == {b"gone" * 4: 0b10}
    sched.reported(step1)
    assert side.kernel.index.get(k2) is not None and side.kernel.index.get(k1) is None
    sched.reported(NexusKVWorkerMeta(stored={k1: ("dram", "n1", 1, 0b10, 1)}))  # rank 1, a step later
    assert side.kernel.index.get(k1) is not None
    sched.reported(NexusKVWorkerMeta(removed={k1: 0b10}))  # rank 1 lost it: no longer planned
    assert side.kernel.index.get(k1) is None
    sched.reported(NexusKVWorkerMeta(stored={k1: ("dram", "n1", 1, 0b10, 1)}))  # rank 1 stored it again
    assert side.kernel.index.get(k1) is not None  # rank 0 never stopped holding it


def test_reports_fold_ranks_and_groups():
    a = NexusKVWorkerMeta(stored={b"k": ("disk", "n", 1, 0b01, 0b11)}, removed={b"x": 0b01})
    b = NexusKVWorkerMeta(stored={b"k": ("disk", "n", 1, 0b10, 0b01)}, removed={b"x": 0b10, b"y": 0b10})
    got = a.aggregate(b)
    assert got.stored == {b"k": ("disk", "n", 1, 0b11, 0b01)} and got.removed == {b"x": 0b11, b"y": 0b10}


def test_metadata_crosses_a_process_boundary_and_its_plan_stays_sealed(side):
    worker = _worker(side.kernel)
    nreq, keys = _saved_request(side, worker)
    plan = side.kernel.plan(nreq, keys=keys[:3])
    meta = NexusKVMetadata(loads=[LoadSpec("r", nreq, keys[:3], plan, 0, [4, 5, 6], asynchronous=True)],
                           preempted=["p"])  # fmt: skip
    back = pickle.loads(pickle.dumps(meta))
    assert back.loads[0].plan == plan and side.kernel.plan_seal.check(back.loads[0].plan)
    assert back.loads[0].request == nreq and back.preempted == ["p"]


def test_a_removed_block_is_reported_removed(side):
    worker = _worker(side.kernel)
    _, keys = _saved_request(side, worker)
    assert set(worker.worker_meta().stored) == set(keys[:3])
    side.kernel.quarantine(keys[1], 0, "dram", "test: evicted behind the worker's back")
    report = worker.worker_meta()
    assert report is not None and set(report.removed) == {keys[1]} and not report.stored
    assert worker.worker_meta() is None  # nothing new


def _plan(side, nreq, keys, blocks: int = 3):
    plan = side.kernel.plan(nreq, keys=keys[:blocks])
    assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == blocks * BLOCK
    return plan


def _hold_materialize(worker: WorkerSide, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The fault: the worker's reads block until `release` is set; `entered` is set when one has started."""
    real, entered, release = worker.kernel.materialize, threading.Event(), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(worker.kernel, "materialize", held)
    return entered, release


def _wait_finished(worker: WorkerSide, rid: str, timeout_s: float = 20.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        _, done, _ = worker.finished(set())
        if rid in done:
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError(f"{rid} never finished loading")


def test_an_asynchronous_load_mounts_in_the_background_and_is_reported_finished(side):
    source = _worker(side.kernel)
    nreq, keys = _saved_request(side, source)
    worker = _worker(side.kernel)  # another engine's blocks: 4, 5, 6 receive the state source held in 1, 2, 3
    worker.start_load(NexusKVMetadata(loads=[LoadSpec("r", nreq, keys[:3], _plan(side, nreq, keys), 0, [4, 5, 6],
                                                      asynchronous=True)]))  # fmt: skip
    _wait_finished(worker, "r")
    assert worker.take_errors() == set()
    for name in worker.caches:
        assert torch.equal(worker.caches[name][4:7], source.caches[name][1:4])
    assert worker.stats["loads_async"] == 1 and worker.stats["blocks_loaded"] == 3


def test_a_hanging_asynchronous_load_is_given_up_and_never_writes_late(side, monkeypatch):
    source = _worker(side.kernel)
    nreq, keys = _saved_request(side, source)
    worker = _worker(side.kernel)
    worker.loader.grace_ms = 100.0
    _, release = _hold_materialize(worker, monkeypatch)  # a read that answers only after vLLM was told it failed
    before = {name: cache[4:7].clone() for name, cache in worker.caches.items()}
    worker.start_load(NexusKVMetadata(loads=[LoadSpec("r", nreq, keys[:3], _plan(side, nreq, keys), 0, [4, 5, 6],
                                                      asynchronous=True)]))  # fmt: skip
    waited = _wait_finished(worker, "r")
    limit = (worker.kernel.config.load_timeout_ms + worker.loader.grace_ms) / 1e3
    assert waited >= limit * 0.9 and worker.take_errors() == {4, 5, 6}
    assert worker.stats["loads_timed_out"] == 1 and worker.stats["blocks_failed"] == 3
    release.set()  # the read now completes: it must not reach vLLM's blocks, which vLLM may have reused
    time.sleep(0.3)
    for name, cache in worker.caches.items():
        assert torch.equal(cache[4:7], before[name])


def test_an_aborted_request_is_reported_received_only_once_its_load_cannot_write(side, monkeypatch):
    source = _worker(side.kernel)
    nreq, keys = _saved_request(side, source)
    worker = _worker(side.kernel)
    entered, release = _hold_materialize(worker, monkeypatch)
    before = {name: cache[4:7].clone() for name, cache in worker.caches.items()}
    worker.start_load(NexusKVMetadata(loads=[LoadSpec("r", nreq, keys[:3], _plan(side, nreq, keys), 0, [4, 5, 6],
                                                      asynchronous=True)]))  # fmt: skip
    assert entered.wait(10)
    assert worker.finished(set()) == (set(), set(), set())  # still loading: not over
    # vLLM finished (aborted) it while loading: it keeps the blocks until `finished_recving` names the request,
    # which happens now, once the load can no longer write
    assert worker.finished({"r"}) == (set(), {"r"}, set())
    release.set()
    time.sleep(0.3)
    for name, cache in worker.caches.items():
        assert torch.equal(cache[4:7], before[name])
    assert worker.finished({"r"}) == (set(), set(), set())  # reported once


@pytest.mark.parametrize("asynchronous", [False, True])
def test_vllm_may_free_every_finished_requests_blocks_at_once(side, asynchronous):
    """Saves never outlive their step; an aborted load is vLLM's to hold (until `finished_recving`)."""
    source = _worker(side.kernel)
    nreq, _ = _saved_request(side, source)
    side.load_async = asynchronous
    req = vllm_request("r", list(nreq.token_ids), "t")
    assert side.matched(req, 0) == 3 * BLOCK
    side.allocated(req, [[4, 5, 6, 7]], 3 * BLOCK)
    assert side.finished(req) is False
