"""Hybrid models under vLLM's hybrid KV cache manager (the connector is `SupportsHMA`): vLLM's own KV cache config
objects become NexusKV state groups; a sliding-window group's state at a cut is the blocks in its window and is
restored only where saved; a failed hybrid load fails its request whole (vLLM recomputes it); and on the real
engine (a tiny Mistral alternating sliding-window and full attention) a shared prefix loads and outputs equal vLLM
alone."""

from __future__ import annotations

import pytest
import torch
from nexuskv_vllm.hybrid import kv_groups, window_blocks
from nexuskv_vllm.metadata import NexusKVMetadata
from nexuskv_vllm.scheduler import SchedulerSide
from nexuskv_vllm.testing import connector_config, write_tiny_hybrid
from nexuskv_vllm.testing import tokens as prompt
from nexuskv_vllm.worker import WorkerSide
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from conftest import run_engine, vllm_request
from nexuskv import Kernel, KernelConfig, PlanAction, StateKind, slot_of

BLOCK, WINDOW = 128, 256
SW_LAYERS, FULL_LAYERS = ["l0", "l2"], ["l1", "l3"]


def _config(*specs) -> KVCacheConfig:
    names = [SW_LAYERS, FULL_LAYERS, ["m0"]]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=names[i], kv_cache_spec=spec) for i, spec in enumerate(specs)])  # fmt: skip


SW = SlidingWindowSpec(BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=WINDOW)
FULL = FullAttentionSpec(BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)


def test_vllms_groups_become_dense_and_windowed_state_and_other_kinds_are_refused_by_name():
    groups = kv_groups(_config(SW, FULL))
    assert [(g.kind, g.layers, g.window) for g in groups] == [("windowed", ("l0", "l2"), WINDOW),
                                                               ("dense", ("l1", "l3"), 0)]  # fmt: skip
    assert [g.state_group().kind for g in groups] == [StateKind.WINDOWED, StateKind.DENSE]
    assert kv_groups(_config(FULL)) is None  # one group: the single-group path
    assert window_blocks(WINDOW, BLOCK) == 2 and window_blocks(129, BLOCK) == 1 and window_blocks(4096, BLOCK) == 32
    mamba = MambaSpec(BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match=r"KV cache group 2 \(MambaSpec, layers \['m0'\]"):
        kv_groups(_config(SW, FULL, mamba))


@pytest.fixture
def hybrid(model_dir):
    """A scheduler side and two workers (two engines' KV tensors) for a hybrid layout, on one DRAM-only kernel."""
    from attrs import evolve
    from nexuskv_vllm.identity import EngineIdentity

    groups = kv_groups(_config(SW, FULL))
    ident = EngineIdentity.build(model=str(model_dir), dtype="float32", layers=4, kv_heads=2, head_dim=32,
                                 block_size=BLOCK)  # fmt: skip
    ident = evolve(ident, layout=evolve(ident.layout, groups=tuple(g.state_group() for g in groups)))
    with Kernel(KernelConfig(node="n1", page_size=BLOCK), secret=bytes(range(32))) as k:
        sched = SchedulerSide(k, ident, groups=groups)
        workers = []
        for seed in (1, 2):
            w = WorkerSide(k, groups=groups)
            torch.manual_seed(seed)
            w.register({name: torch.randn(32, 2, BLOCK, 32) for name in ("l0", "l1", "l2", "l3")})
            workers.append(w)
        yield sched, workers


def _wait(worker, rid: str) -> tuple[set, set]:
    import time

    for _ in range(2000):
        _, done, failed = worker.finished(set())
        if rid in done:
            return done, failed
        time.sleep(0.005)
    raise AssertionError("load never finished")


def test_a_hybrid_prefix_saves_every_group_and_loads_into_another_engines_blocks(hybrid):
    sched, (source, target) = hybrid
    toks = prompt(4 * BLOCK + 20, 5)
    req = vllm_request("r", toks, "t")
    sw_ids, full_ids = [1, 2, 3, 4], [5, 6, 7, 8]
    spec = sched._save("r", 0, 4 * BLOCK, req, [sw_ids, full_ids])
    assert spec.blocks == [0, 1, 2, 3]
    assert spec.group_ids[3] == [[3, 4], [8]] and spec.group_ids[0] == [[1], [5]]  # window: its last 2 blocks
    source.end_step(NexusKVMetadata(saves=[spec]))
    assert sched.kernel.flush(10)
    sched.finished(req)

    again = vllm_request("r2", toks, "t")
    assert sched.matched(again, 0) == 4 * BLOCK and sched.load_async  # hybrid: always asynchronous
    sched.allocated(again, [[0, 0, 11, 12], [13, 14, 15, 16]], 4 * BLOCK)  # vLLM: out-of-window blocks are null
    load = sched._loads.pop("r2")  # what `step` sends the workers
    assert load.group_ids == [[11, 12], [13, 14, 15, 16]] and load.asynchronous
    target.start_load(NexusKVMetadata(loads=[load]))
    _, failed = _wait(target, "r2")
    assert not failed and target.take_errors() == set()
    for name in FULL_LAYERS:
        assert torch.equal(target.caches[name][13:17], source.caches[name][5:9])
    for name in SW_LAYERS:
        assert torch.equal(target.caches[name][11:13], source.caches[name][3:5])


def test_restore_points_respect_the_window_and_a_failed_hybrid_load_fails_its_request_whole(hybrid, monkeypatch):
    sched, (source, target) = hybrid
    toks = prompt(4 * BLOCK + 20, 6)
    req = vllm_request("r", toks, "t")
    spec = sched._save("r", 0, 4 * BLOCK, req, [[1, 2, 3, 4], [5, 6, 7, 8]])
    source.end_step(NexusKVMetadata(saves=[spec]))
    assert sched.kernel.flush(10)
    sched.finished(req)
    keys = sched.kernel.keys(sched.request(req, toks))
    sched.kernel.quarantine(keys[3], 0, "dram", "test: the window checkpoint at block 3 is gone")
    plan = sched.kernel.plan(sched.request(vllm_request("p", toks, "t"), toks), keys=keys[:4])
    assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 3 * BLOCK  # not 4: no state at 3

    again = vllm_request("r3", toks, "t")
    assert sched.matched(again, 0) == 3 * BLOCK
    sched.allocated(again, [[0, 21, 22], [23, 24, 25]], 3 * BLOCK)
    store, bad = target.kernel.tiers["dram"], slot_of(keys[1], 1)
    real = store.get
    monkeypatch.setattr(store, "get", lambda slot: None if slot == bad else real(slot))  # a dense block gone
    before = {name: target.caches[name].clone() for name in target.caches}
    target.start_load(NexusKVMetadata(loads=[sched._loads.pop("r3")]))
    _, failed = _wait(target, "r3")
    assert failed == {"r3"} and target.take_errors() == set()  # per request: vLLM's hybrid manager needs that
    for name in target.caches:
        assert torch.equal(target.caches[name], before[name])  # all or nothing: nothing was mounted


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_a_hybrid_model_on_the_real_engine_loads_a_shared_prefix_and_outputs_equal_vllm_alone(workdir, kernel_toml,
                                                                                              executor):  # fmt: skip
    """With `mp` the scheduler's index learns the windowed checkpoints from the worker's reports (group masks)."""
    model = workdir / "hybrid-model"
    if not (model / "config.json").exists():
        write_tiny_hybrid(model, seed=3)
    shared = prompt(640, 51)
    cases = [shared + prompt(20, 52), shared + prompt(25, 53), prompt(530, 54) + prompt(9, 55),
             prompt(530, 54) + prompt(12, 56)]  # fmt: skip
    reference = run_engine(workdir, {"model": str(model), "kv_transfer_config": None,
                                     "requests": [{"tokens": t} for t in cases]})["outputs"]  # fmt: skip
    toml = kernel_toml.read_text().replace(str(workdir / "disk"), str(workdir / f"disk-hybrid-{executor}"))
    (workdir / f"kernel-hybrid-{executor}.toml").write_text(toml)
    disk = workdir / f"disk-hybrid-{executor}"
    res = run_engine(workdir, {"model": str(model), "executor": executor, "kv_transfer_config": connector_config(
        workdir / f"kernel-hybrid-{executor}.toml", tenant="t1"), "requests": [
        {"tokens": cases[0]}, {"tokens": cases[1]}, {"tokens": cases[2]},
        {"tokens": cases[3], "delete": [f"{disk}/**/*.nkv"]}]})  # fmt: skip
    assert res["outputs"] == reference
    counters = res["counters"]
    loaded = [counters[i].get("blocks_loaded", 0) - (counters[i - 1].get("blocks_loaded", 0) if i else 0)
              for i in range(4)]  # fmt: skip
    # The writer had written every block before the files were removed (the kernel flushed first): a write still
    # queued would land after the deletion and load. Any block loaded then is a read of what the disk no longer holds.
    (gone,) = res["deletes"]
    assert gone["flushed"] == [True] and gone["removed"] > 0, gone
    assert loaded[1] == 5 and loaded[3] == 0 and counters[3].get("blocks_failed", 0) >= 4, (loaded, gone)
    assert counters[1].get("loads_async", 0) == 1  # hybrid loads are asynchronous
