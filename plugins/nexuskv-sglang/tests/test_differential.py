"""NexusKV against SGLang's own file backend (`HiCacheFile`): the same sets, existence checks and gets give the
same pages; where NexusKV answers otherwise, it is a decision its plan gives the reason for."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from nexuskv_sglang.backend import NexusKVStorage
from sglang.srt.mem_cache.hicache_storage import HiCacheFile

from conftest import mha_host, storage_config


@pytest.mark.parametrize("seed", range(4))
def test_the_same_operations_give_the_same_pages_as_the_file_backend(kernel, tmp_path, seed):
    rng = random.Random(seed)
    host = mha_host()
    cfg = storage_config()
    ours = NexusKVStorage(cfg, kernel=kernel)
    ours.register_mem_pool_host(host)
    theirs = HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
    theirs.register_mem_pool_host(host)
    shape, dtype = host.get_dummy_flat_data_page().shape, host.dtype
    runs = {f"r{r}": [f"r{r}-{i}" for i in range(rng.randint(1, 6))] for r in range(8)}
    stored: set[str] = set()
    differences = agreed = 0
    for _ in range(60):
        keys = rng.choice(list(runs.values()))
        op = rng.random()
        if op < 0.35:  # SGLang writes a run back (some of it may be stored already)
            cut = rng.randint(1, len(keys))
            pages = [torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(k.encode()))).to(dtype)
                     for k in keys[:cut]]  # fmt: skip
            assert ours.batch_set(keys[:cut], pages) == theirs.batch_set(keys[:cut], pages) is True
            assert kernel.flush(10)
            stored.update(keys[:cut])
        elif op < 0.55:
            key = rng.choice(keys)
            assert ours.exists(key) == theirs.exists(key) == (key in stored)
        elif op < 0.8:  # how many leading pages to prefetch
            got, want = ours.batch_exists(keys), theirs.batch_exists(keys)
            if got != want:  # a decision, never a miss: fetching those pages would not pay
                plan = ours.plan(keys[:want])
                assert got == 0 and plan.action.value == "recompute", (got, want, plan.reasons)
                assert any("does not beat min gain" in r for r in plan.reasons), plan.reasons
                differences += 1
            elif got:
                agreed += 1
        else:  # a get of the run: every page NexusKV serves is the file backend's page, byte for byte
            n = theirs.batch_exists(keys)
            if n == 0:
                continue
            a = ours.batch_get(keys[:n], [host.get_dummy_flat_data_page() for _ in range(n)])
            b = theirs.batch_get(keys[:n], [host.get_dummy_flat_data_page() for _ in range(n)])
            for x, y in zip(a, b, strict=True):
                assert y is not None and (x is None or torch.equal(x, y))
            served = sum(x is not None for x in a)
            assert served in (0, n)  # all or nothing: a run of this size is worth fetching or it is not
    assert agreed >= 1 and ours.stats()["got_pages"] >= 1  # the comparison was not vacuous


def test_on_a_slow_tier_nexuskv_says_recompute_where_the_file_backend_says_fetch(tmp_path):
    """Pages behind a link slower than recomputing them: the file backend's answer would make SGLang wait for them."""
    import json

    import attrs

    from nexuskv import Kernel, KernelConfig, LinkCost, default_profile, to_dict

    prof = default_profile()
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(to_dict(attrs.evolve(prof, tiers={**prof.tiers, "remote": LinkCost(1e6, 20.0)}))))
    policies = tmp_path / "slow-policies"
    policies.mkdir()
    (policies / "default.toml").write_text('name = "default"\nfailure = "deny"\nmin_gain_ms = 0.5\n'
                                           'default_tier = "remote"\n')  # fmt: skip
    tiers = {"remote": {"store": "shaped-link", "capacity_bytes": "64MiB", "bandwidth_bytes_per_s": 1e6,
                        "latency_ms": 20.0}}  # fmt: skip
    with Kernel(KernelConfig(node="n1", page_size=4, policies=str(policies), profile=str(profile), tiers=tiers),
                secret=bytes(32)) as k:  # fmt: skip
        host = mha_host()
        cfg = storage_config()
        ours, theirs = NexusKVStorage(cfg, kernel=k), HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
        for b in (ours, theirs):
            b.register_mem_pool_host(host)
        keys = [f"s{i}" for i in range(6)]
        pages = [host.get_dummy_flat_data_page() + i for i in range(6)]
        assert ours.batch_set(keys, pages) and theirs.batch_set(keys, pages) and k.flush(10)
        assert all(ours.exists(key) for key in keys)  # held, in the slow tier
        assert theirs.batch_exists(keys) == 6  # present: SGLang would wait for six slow fetches
        assert ours.batch_exists(keys) == 0  # NexusKV: recomputing them is faster
        plan = ours.plan(keys)
        assert plan.action.value == "recompute" and any("would lose" in r for r in plan.reasons), plan.reasons
