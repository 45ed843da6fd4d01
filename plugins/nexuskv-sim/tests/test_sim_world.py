import pytest
from _sim_fakes import BLOCK, BLOCK_BYTES, Scripted, request, tiny_profile

from nexuskv_sim.api import Decision, Fetch, Prefetch
from nexuskv_sim.routers import RoundRobin
from nexuskv_sim.world import World

ONE = {"n0": "m"}


def world(reqs, strategy, profile=None, node_model=ONE, node_host=None, delay=0.0):
    return World(reqs, strategy, node_model=node_model, node_host=node_host or {n: f"h{n}" for n in node_model},
                 profile=profile or tiny_profile(), report_delay_ms=delay)


def test_second_identical_request_hits_hbm():
    p = tiny_profile()
    reqs = [request(0, [1, 2, 3]), request(1, [1, 2, 3], at=1000.0)]
    res = world(reqs, RoundRobin(), p).run()
    assert res.completed == 2 and res.fetches_by_source == {"local:hbm": 1}
    assert res.reused_tokens == 3 * BLOCK - 1  # the last token is always computed
    assert res.bytes_by_link == {}
    m = p.model("m")
    assert res.ttft_ms[1] == pytest.approx(m.overhead_ms + m.chunk_ms(1, 3 * BLOCK - 1))


def test_writes_go_through_to_dram_and_disk_and_dram_loads_use_pcie():
    p = tiny_profile(hbm_blocks=2)  # 3 blocks do not stay in hbm
    reqs = [request(0, [1, 2, 3]), request(1, [1, 2, 3], at=1000.0)]
    w = world(reqs, RoundRobin(), p)
    res = w.run()
    host = w.hosts["hn0"]
    assert all(host.dram.contains(("m", "default", h)) and host.disk.contains(("m", "default", h)) for h in (1, 2, 3))
    # hbm kept blocks 2 and 3 only, so the prefix in hbm is empty: all three come from dram, one by one, each
    # pushing an hbm block the next one needs out (1 ms of PCIe each)
    assert res.fetches_by_source == {"local:dram": 1}
    assert res.bytes_by_link == {"pcie": 3 * BLOCK_BYTES}
    m = p.model("m")
    assert res.ttft_ms[1] == pytest.approx(3 * 1.0 + m.overhead_ms + m.chunk_ms(1, 3 * BLOCK - 1))


def test_fetch_from_a_peer_goes_over_both_nics():
    p = tiny_profile()
    two = {"n0": "m", "n1": "m"}
    a = request(0, [1, 2, 3, 4])
    b = request(1, [1, 2, 3, 4, 5], at=1000.0)
    plan = {1: (Fetch("n0", "hbm", 0, 4),)}
    strat = Scripted("n0", plan)
    strat.decide = lambda req, view: Decision("n0" if req.rid == 0 else "n1", plan.get(req.rid, ()))
    res = world([a, b], strat, p, node_model=two).run()
    assert res.bytes_by_link == {"nic": 4 * BLOCK_BYTES}
    assert res.fetches_by_source == {"peer:hbm": 1}
    assert strat.transfers == [("nic", 4 * BLOCK_BYTES, pytest.approx(4 * 5.0))]
    m = p.model("m")
    assert res.ttft_ms[1] == pytest.approx(4 * 5.0 + m.overhead_ms + m.chunk_ms(BLOCK, 4 * BLOCK))


def test_fetch_of_evicted_blocks_is_a_load_miss_and_the_request_completes():
    # no hbm or dram, disk holds 2 blocks, a disk block takes 50 ms then 1 ms of PCIe
    p = tiny_profile(hbm_blocks=0, dram_blocks=0, disk_blocks=2, block_ms={"disk": 50.0, "pcie": 1.0})
    a = request(0, [1, 2])  # on disk at ~11 ms
    c = request(2, [1, 2, 3], at=20.0)  # fetches [0, 2) from disk: block 1 at 20-71 ms, block 2 from 71 ms
    b = request(1, [7, 8], at=30.0)  # its prefill (30-41 ms) evicts blocks 1 and 2 from disk
    strat = Scripted("n0", {2: (Fetch("n0", "disk", 0, 2),)})
    res = world([a, b, c], strat, p).run()
    assert res.completed == 3 and res.failed == 0
    assert res.load_misses == 1 and res.load_miss_blocks == 1
    assert res.bytes_by_link == {"disk": BLOCK_BYTES, "pcie": BLOCK_BYTES}
    ttft_c = dict((rid, t) for rid, _, t in strat.done)[2]
    m = p.model("m")
    assert ttft_c == pytest.approx(51.0 + m.overhead_ms + m.chunk_ms(2 * BLOCK, BLOCK))


def test_a_decision_for_a_node_without_the_model_is_rejected():
    two = {"n0": "m", "n1": "other"}
    with pytest.raises(ValueError, match="sent request"):
        world([request(0, [1])], Scripted("n1"), tiny_profile(), node_model=two).run()
    with pytest.raises(ValueError, match="contiguous"):
        world([request(0, [1, 2])], Scripted("n0", {0: (Fetch("n0", "hbm", 1, 2),)})).run()


def test_requests_for_unserved_models_fail_without_stopping_the_run():
    res = world([request(0, [1], model="other"), request(1, [2])], Scripted("n0")).run()
    assert (res.requests, res.failed, res.completed) == (2, 1, 1)
    assert res.slo_attainment == 0.5


def test_a_prefetch_moves_blocks_into_hbm_in_the_background():
    # a's blocks end up on disk only; b recomputes (a slow 4-second prefill) while a prefetch moves the 3 held
    # blocks into hbm (disk, then PCIe: 11 ms a block), long before b's own prefill would put them there
    p = tiny_profile(hbm_blocks=4, dram_blocks=0, disk_blocks=10, block_ms={"disk": 10.0, "pcie": 1.0},
                     per_token_ms=1.0)  # fmt: skip
    a = request(0, [1, 2, 3])
    flood = request(1, [7, 8, 9, 10], at=3000.0)  # pushes a's blocks out of hbm (4 blocks of room)
    b = request(2, [1, 2, 3, 4], at=9000.0)
    c = request(3, [1, 2, 3, 5], at=20000.0)  # finds them in hbm
    strat = Scripted("n0")
    strat.decide = lambda req, view: Decision(
        "n0", (Fetch("n0", "hbm", 0, 3),) if req.rid == 3 else (),
        prefetches=(Prefetch("disk", 0, 3),) if req.rid == 2 else ())  # fmt: skip
    res = world([a, flood, b, c], strat, p).run()
    assert res.prefetched_blocks == 3
    assert res.bytes_by_link == {"disk": 3 * BLOCK_BYTES, "pcie": 3 * BLOCK_BYTES}
    assert res.fetches_by_source == {"local:hbm": 1} and res.load_misses == 0
    assert res.reused_tokens == 3 * BLOCK  # c reused the prefetched blocks at no link cost
