"""The connector in vLLM's other shapes, each engine a subprocess (`nexuskv_vllm._run`): the `mp` executor with
tensor parallelism 2 (each rank in its own process, with its own kernel and tier directory), and asynchronous loads.
Greedy outputs equal vLLM alone in the same shape; a shared prefix loads on every rank; a rank that fails its load
makes every rank recompute; a load that hangs recomputes within the load timeout while other requests run. The
counters come from vLLM's own Prometheus registry (`vllm:nexuskv_*`), which is also what `/metrics` serves."""

from __future__ import annotations

import pytest
from nexuskv_vllm.testing import connector_config
from nexuskv_vllm.testing import tokens as prompt

from conftest import run_engine

pytestmark = pytest.mark.slow

SHARED = prompt(640, 21)  # five 128-token blocks
CASES = {"a": SHARED + prompt(20, 22), "b": SHARED + prompt(25, 23),
         "fail1": prompt(530, 24) + prompt(9, 25), "fail2": prompt(530, 24) + prompt(11, 26),
         "hang1": prompt(530, 27) + prompt(9, 28), "hang2": prompt(530, 27) + prompt(10, 29),
         "other": prompt(200, 30)}  # fmt: skip
TP2 = {"executor": "mp", "tensor_parallel_size": 2}


def _config(kernel_toml, name: str, **extra) -> dict:
    """A connector config over a disk tier of its own (`disk-<name>`)."""
    workdir = kernel_toml.parent
    toml = kernel_toml.read_text().replace(str(workdir / "disk"), str(workdir / f"disk-{name}"))
    (workdir / f"kernel-{name}.toml").write_text(toml)
    return connector_config(workdir / f"kernel-{name}.toml", tenant="t1", **extra)


def _delta(counters: list[dict], i: int, name: str) -> float:
    """How much a connector counter moved while request i ran."""
    return counters[i].get(name, 0.0) - (counters[i - 1].get(name, 0.0) if i else 0.0)


@pytest.fixture(scope="module")
def tp2_reference(workdir, model_dir) -> dict:
    """vLLM alone, `mp` executor, tensor parallelism 2 (a reduction over two ranks: not TP 1's exact floats)."""
    names = ["a", "b", "fail1", "fail2"]
    out = run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": None, **TP2,
                               "requests": [{"tokens": CASES[n]} for n in names]})["outputs"]  # fmt: skip
    return dict(zip(names, out, strict=True))


def test_tp2_loads_a_shared_prefix_on_both_ranks_and_a_failed_rank_makes_both_recompute(
        workdir, model_dir, kernel_toml, tp2_reference):  # fmt: skip
    config = _config(kernel_toml, "tp2")
    rank1 = workdir / "disk-tp2" / "rank-1-of-2"
    res = run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": config, **TP2, "requests": [
        {"tokens": CASES["a"]}, {"tokens": CASES["b"]}, {"tokens": CASES["fail1"]},
        {"tokens": CASES["fail2"], "delete": [f"{rank1}/**/*.nkv"]},  # rank 1's shards gone, rank 0's not
    ]})  # fmt: skip
    out, counters = res["outputs"], res["counters"]
    assert out == [tp2_reference[n] for n in ("a", "b", "fail1", "fail2")]
    assert _delta(counters, 1, "blocks_loaded") == 10  # five blocks, on each of two ranks
    assert _delta(counters, 1, "tokens_planned") == 640
    # Both ranks' writers had written fail1's blocks before rank 1's files were removed (a's five and fail1's four):
    # deleted before that, a write still queued landed after the deletion and was loaded (8 blocks, not 4).
    (gone,) = res["deletes"]
    assert gone["flushed"] == [True, True] and gone["removed"] == 9, gone
    # fail2: rank 0 mounted its four blocks, rank 1 found none; vLLM recomputed them on both (same output). More
    # than four loaded would be a read serving what the disk no longer holds.
    assert _delta(counters, 3, "blocks_loaded") == 4 and _delta(counters, 3, "blocks_failed") == 4, gone
    assert (workdir / "disk-tp2" / "rank-0-of-2").is_dir() and rank1.is_dir()
    assert not any((workdir / "disk-tp2").glob("*.nkv"))  # no process writes the shared top directory


def test_tp2_asynchronous_loads_give_the_same_output(workdir, model_dir, kernel_toml, tp2_reference):
    res = run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": _config(kernel_toml, "tp2-async",
                                                                                      load_async=True),
                               **TP2, "requests": [{"tokens": CASES["a"]}, {"tokens": CASES["b"]}]})  # fmt: skip
    assert res["outputs"] == [tp2_reference["a"], tp2_reference["b"]]
    assert _delta(res["counters"], 1, "loads_async") == 2 and _delta(res["counters"], 1, "blocks_loaded") == 10


def test_an_asynchronous_load_that_hangs_recomputes_in_time_while_another_request_runs(workdir, model_dir,
                                                                                      kernel_toml):  # fmt: skip
    reference = run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": None, "requests": [
        {"tokens": CASES[n]} for n in ("hang1", "hang2", "other")]})["outputs"]  # fmt: skip
    res = run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": _config(kernel_toml, "async",
                                                                                      load_async=True),
                               "requests": [{"tokens": CASES["hang1"]},
                                            {"tokens": CASES["hang2"], "hang_s": 8.0,
                                             "alongside": [CASES["other"]]}]})  # fmt: skip
    assert res["outputs"][0] == reference[0]
    hung, other = res["outputs"][1]["race"]
    assert hung["output"] == reference[1] and other["output"] == reference[2]
    assert other["done_s"] < hung["done_s"]  # the other request ran while this one waited for its load
    assert hung["done_s"] < 8.0  # given up at the load timeout (1.5 s), not held for the hang
    assert _delta(res["counters"], 1, "blocks_failed") >= 3 and _delta(res["counters"], 1, "loads_async") == 1
