"""WritePath: commits from many threads all land, each payload under its own keys, and describe is exact."""

from __future__ import annotations

import random
import threading

import pytest

from nexuskv import Kernel, KernelConfig, slot_of
from tests.conftest import SECRET, layout_of, make_request


def test_commits_from_many_threads_all_land_under_their_own_keys():
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": "256MiB"}})
    with Kernel(cfg, secret=SECRET) as k:
        expected: dict[bytes, bytes] = {}  # the reference model: block key -> the payload committed for it
        lock = threading.Lock()
        refused = [0]

        def worker(n: int) -> None:
            r = random.Random(n)
            for i in range(25):
                req = make_request([r.randrange(40_000) for _ in range(16 * r.randrange(1, 9))],
                                   tenant=r.choice(["acme", "globex"]), request_id=f"w{n}-{i}")  # fmt: skip
                keys = k.keys(req)
                payloads = [r.randbytes(256) for _ in keys]
                res = k.commit(req, payloads, keys=keys)
                with lock:
                    refused[0] += res.refused
                    expected.update(zip(keys, payloads, strict=True))

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert k.flush(30)
        assert refused[0] == 0 and k.writer.stats["failed"] == 0
        assert len(k.index) == len(expected) == len(k.tiers["dram"])
        for key, payload in expected.items():
            got = k.load(key)
            assert got is not None and bytes(got.payload) == payload


def test_describe_is_exact_for_pages_and_checkpoints():
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as k:
        req = make_request(range(64), layout=layout_of("dense", "recurrent"))
        keys = k.keys(req)
        page = k.describe(req, 2, b"p", tier="dram", group=0)
        ckpt = k.describe(req, 2, b"c", tier="dram", group=1)
        assert (page.span.start, page.span.end) == (32, 48) and (ckpt.span.start, ckpt.span.end) == (0, 48)
        assert page.key == keys[2].hex() and page.parent_key == keys[1].hex()
        assert page.placement.node == "n1" and page.placement.epoch == k.epoch
        with pytest.raises(IndexError, match="block 4 is not a full block"):
            k.describe(req, 4, b"x", tier="dram")
        with pytest.raises(IndexError, match="group 2 is not in the layout"):
            k.describe(req, 0, b"x", tier="dram", group=2)
        assert slot_of(keys[2], 1) == keys[2] + b"\x01"


@pytest.mark.parametrize("algo", ["xxh3-128", "blake2b-128"])
def test_committed_state_carries_the_configured_checksum_and_loads(algo):
    with Kernel(KernelConfig(node="n1", checksum=algo), secret=SECRET) as k:
        req = make_request(range(64))
        keys = k.keys(req)
        k.commit(req, [bytes([i]) * 512 for i in range(len(keys))], keys=keys)
        assert k.flush(5)
        got = k.tiers["dram"].get(slot_of(keys[2]))
        assert got.descriptor.checksum.startswith(f"{algo}:")
        assert bytes(k.load(keys[2]).payload) == bytes([2]) * 512


def test_prefetch_obeys_the_place_rules_as_promotion_does(tmp_path):
    """Archived state a place rule keeps on disk is never prefetched into DRAM; other state is."""
    (tmp_path / "default.toml").write_text(
        'name = "default"\nmin_gain_ms = 0.0\n\n[[place]]\nname = "archive-stays-on-disk"\n'
        'when = \'request.tenant == "archive"\'\ntier = "disk"\n\n[[place]]\nname = "hot"\n'
        'tier = "dram"\n')  # fmt: skip
    for tenant, expect in (("archive", False), ("chat", True)):
        cfg = KernelConfig(node="n1", policies=str(tmp_path), promote_on_hit=False, bandwidth_scale={"disk": 1e-4},
                           tiers={"dram": {"store": "dram", "capacity_bytes": "8MiB"},
                                  "disk": {"store": "dram", "capacity_bytes": "64MiB"}})  # fmt: skip
        with Kernel(cfg, secret=SECRET) as k:
            req = make_request(range(16 * 20), tenant=tenant)
            keys = k.keys(req)
            for b in range(len(keys)):
                payload = bytes([b]) * 4096
                assert k.put(k.describe(req, b, payload, tier="disk", keys=keys), payload)
            plan = k.plan(req)
            assert plan.prefetch and plan.prefetch[0].target_tier == "dram", plan.reasons  # a slow disk: proposed
            assert k.prefetcher.wait_idle(10)
            assert k.prefetcher.stats["submitted"] == 1
            in_dram = [slot_of(key) in k.tiers["dram"] for key in keys]
            assert all(in_dram) if expect else not any(in_dram), (tenant, in_dram)


@pytest.mark.parametrize("eviction", ["cost", "lru"])
def test_a_request_larger_than_its_tier_keeps_its_prefix_not_its_deepest_blocks(eviction):
    cfg = KernelConfig(node="n1", eviction=eviction, tiers={"dram": {"store": "dram", "capacity_bytes": 16 * 1024}})
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(16 * 62))
        keys = k.keys(req)
        assert k.commit(req, [bytes([b]) * 1024 for b in range(62)], keys=keys).refused == 0
        assert k.flush(5)
        held = [b for b, key in enumerate(keys) if k.index.get(key) is not None]
        assert held == list(range(16))  # the old code kept blocks 46..61, and the next plan reused nothing
        assert k.plan(req).tokens_reused == 256
        assert k.writes.orphans == 62 - 17  # block 16 was refused; the blocks after it had no prefix anywhere
