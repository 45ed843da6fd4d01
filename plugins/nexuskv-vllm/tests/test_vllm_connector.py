"""The connector on the real vLLM CPU engine: reuse through NexusKV gives the same greedy tokens as a run without
any connector; restarts reuse the disk tier; corrupt, deleted and hanging state gives recompute and the same
tokens; tenants, policies, adapters and weights never share state they must not."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from nexuskv_vllm.testing import connector_config, write_tiny_llama
from nexuskv_vllm.testing import tokens as prompt

from conftest import run_engine, vllm_request
from nexuskv import slot_of

pytestmark = pytest.mark.slow

SHARED = prompt(640, 1)  # five 128-token blocks
CASES = {
    "a": SHARED + prompt(20, 2), "b": SHARED + prompt(25, 3),
    "corrupt1": prompt(530, 4) + prompt(9, 5), "corrupt2": prompt(530, 4) + prompt(11, 6),
    "deleted1": prompt(530, 7) + prompt(9, 8), "deleted2": prompt(530, 7) + prompt(13, 9),
    "hang1": prompt(530, 10) + prompt(9, 11), "hang2": prompt(530, 10) + prompt(10, 12),
    "tenant1": prompt(300, 13) + prompt(5, 14), "tenant2": prompt(300, 13) + prompt(7, 15),
    "lora": prompt(300, 16) + prompt(5, 17),
}
LORA_CASES = ("lora-a", "lora-b", None)


@pytest.fixture(scope="session")
def reference(workdir, model_dir, loras) -> dict:
    """Greedy outputs of every case from vLLM without any connector (a separate engine process)."""
    reqs = [{"tokens": t} for t in CASES.values()]
    reqs += [{"tokens": CASES["lora"], "lora": [n, i + 1, loras[n]] if n else None}
             for i, n in enumerate(LORA_CASES)]  # fmt: skip
    out = run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": None, "enable_lora": True,
                               "requests": reqs})["outputs"]  # fmt: skip
    got = dict(zip(CASES, out, strict=False))
    got.update({("lora", n): o for n, o in zip(LORA_CASES, out[len(CASES):], strict=True)})
    return got


def _run(engine, name: str, **kw) -> tuple[list[int], int, int]:
    """(output ids, blocks loaded, blocks that failed to load) of one request."""
    before = engine.connector.worker.stats
    out = engine.generate(CASES[name], tenant=kw.pop("tenant", "t1"), **kw)
    assert engine.connector.worker.kernel.flush(30)  # what this request saved is on disk before the next one
    after = engine.connector.worker.stats
    return out, after["blocks_loaded"] - before["blocks_loaded"], after["blocks_failed"] - before["blocks_failed"]


def _disk_files(engine, name: str, blocks: range) -> list[str]:
    """The disk tier's files of a case's blocks (tenant t1)."""
    conn = engine.connector
    nreq = conn.scheduler.request(vllm_request("probe", CASES[name], "t1"), CASES[name])
    keys = conn.kernel.keys(nreq)
    store = conn.kernel.tiers["disk"]
    return [store._file(slot_of(keys[b], 0)) for b in blocks]


def test_shared_prefix_is_loaded_through_nexuskv_and_output_is_unchanged(engine, reference):
    out_a, loaded_a, _ = _run(engine, "a")
    out_b, loaded_b, failed_b = _run(engine, "b")
    assert (loaded_a, loaded_b, failed_b) == (0, 5, 0)  # the 640-token prefix: five blocks from the disk tier
    assert out_a == reference["a"] and out_b == reference["b"]


def test_corrupt_payload_gives_recompute_from_that_block_and_same_output(engine, reference):
    _run(engine, "corrupt1")
    path = _disk_files(engine, "corrupt1", range(2, 3))[0]
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit in the payload
    Path(path).write_bytes(bytes(data))
    out, loaded, failed = _run(engine, "corrupt2")
    assert (loaded, failed) == (2, 2) and out == reference["corrupt2"]  # blocks 0-1 restored, 2-3 recomputed


def test_deleted_file_gives_recompute_and_same_output(engine, reference):
    _run(engine, "deleted1")
    os.remove(_disk_files(engine, "deleted1", range(1, 2))[0])
    out, loaded, failed = _run(engine, "deleted2")
    assert loaded == 1 and out == reference["deleted2"]
    assert failed in (0, 3)  # a file gone before planning is a miss (plan shorter); after planning, a failed load


def test_denied_tenant_gets_no_load_and_tenants_never_share(engine, reference):
    _run(engine, "tenant1", tenant="t1")
    out_denied, loaded_denied, _ = _run(engine, "tenant2", tenant="denied")
    out_t2, loaded_t2, _ = _run(engine, "tenant2", tenant="t2")  # same prompt, another tenant
    _, loaded_t2_again, _ = _run(engine, "tenant2", tenant="t2")  # t2's own state: reused
    assert (loaded_denied, loaded_t2, loaded_t2_again) == (0, 0, 2)
    assert out_denied == out_t2 == reference["tenant2"]


def test_another_lora_adapter_never_loads_the_others_state(engine, reference, loras):
    def run(name):
        lora = (name, LORA_CASES.index(name) + 1, loras[name]) if name else None
        return _run(engine, "lora", lora=lora)

    out_a, loaded_a, _ = run("lora-a")
    out_b, loaded_b, _ = run("lora-b")
    out_base, loaded_base, _ = run(None)
    out_a2, loaded_a2, _ = run("lora-a")
    assert (loaded_a, loaded_b, loaded_base, loaded_a2) == (0, 0, 0, 2)
    assert out_a == out_a2 == reference[("lora", "lora-a")] and out_b == reference[("lora", "lora-b")]
    assert out_base == reference[("lora", None)] and out_a != out_base


def test_tier_hanging_mid_load_gives_recompute_within_the_timeout(engine, reference, monkeypatch):
    """Last in this file: the hang opens the disk tier's breaker."""
    _run(engine, "hang1")
    store = engine.connector.kernel.tiers["disk"]
    real_get, reads = store.get, []

    def hanging_get(slot):
        reads.append(slot)
        if len(reads) >= 2:  # the first block arrives, then the tier stops answering
            time.sleep(5.0)
        return real_get(slot)

    monkeypatch.setattr(store, "get", hanging_get)
    t0 = time.perf_counter()
    out, loaded, failed = _run(engine, "hang2")
    assert out == reference["hang2"] and loaded == 0 and failed == 4 and len(reads) >= 2
    assert time.perf_counter() - t0 < 60  # bounded by load_timeout_ms, not by the hang (generous for CI)


def test_restart_reuses_disk_state_and_other_weights_never_do(workdir, model_dir, reference):
    """Three engine processes on one disk tier, one after another: the second (same model) reuses the first's
    state; the third, with other weights under the same name, loads nothing."""
    toml = (workdir / "kernel.toml").read_text().replace(str(workdir / "disk"), str(workdir / "disk-restart"))
    (workdir / "kernel-restart.toml").write_text(toml)
    config = connector_config(workdir / "kernel-restart.toml", tenant="t1")
    other = write_tiny_llama(workdir / "other" / "model", seed=7)

    def run(model, case):
        res = run_engine(workdir, {"model": str(model), "kv_transfer_config": config,
                                   "requests": [{"tokens": CASES[case]}]})  # fmt: skip
        return res["outputs"][0], res["stats"]["blocks_loaded"]

    out1, loaded1 = run(model_dir, "a")
    out2, loaded2 = run(model_dir, "b")
    _, loaded3 = run(other, "b")
    assert (loaded1, loaded2, loaded3) == (0, 5, 0)
    assert out1 == reference["a"] and out2 == reference["b"]
