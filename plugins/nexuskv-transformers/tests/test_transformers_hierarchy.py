"""The reference engine's state spilled DRAM -> disk -> Redis by demotion, and restored from each tier exactly.

Real tiers: the disk plugin on a temporary directory, the Redis plugin on a redis-server this test starts on
127.0.0.1. The kernel's config is `examples/hierarchy.toml` with only the path, URL and capacities changed.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from conftest import SECRET, connector, model, tokens
from nexuskv import Kernel, KernelConfig, PlanAction, slot_of
from nexuskv_tier_redis.testing import RedisServer, RedisServerMissing

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hierarchy.toml"
BLOCK = 16 * 512  # one page of the test dense model: 16 tokens x 512 bytes


@pytest.fixture
def redis_url():
    try:
        srv = RedisServer()
    except RedisServerMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield srv.url
    srv.stop()


def hierarchy(tmp_path, url, **over) -> Kernel:
    cfg = KernelConfig.from_toml(EXAMPLE)
    tiers = {
        "dram": {**cfg.tiers["dram"], "capacity_bytes": 6 * BLOCK},  # one 6-block prompt
        "disk": {**cfg.tiers["disk"], "path": str(tmp_path / "disk"), "capacity_bytes": 6 * BLOCK + 6 * 1500,
                 "codec": "raw", "fsync": False},  # one prompt (files carry a header and the descriptor)
        "redis": {**cfg.tiers["redis"], "url": url, "capacity_bytes": "64MiB", "prefix": tmp_path.name},
    }  # fmt: skip
    cfg = attrs.evolve(cfg, tiers=tiers, policies=None, prefetch_max_tasks=0, **over)
    return Kernel(cfg, secret=SECRET)


def settle(k: Kernel) -> None:
    for _ in range(3):  # writer -> disk writer -> its evictions demoted to Redis
        assert k.flush(10)


def where(k: Kernel, keys) -> set[str]:
    return {t for t in k.tiers for key in keys if slot_of(key) in k.tiers[t]}


def test_state_spills_down_the_hierarchy_and_restores_exactly_from_each_tier(tmp_path, redis_url):
    ref = model("dense")
    prompts = {name: tokens(100, seed=s) for name, s in (("a", 11), ("b", 12), ("c", 13))}
    with hierarchy(tmp_path, redis_url, promote_on_hit=False) as k:
        assert k.tier_order == ("dram", "disk", "redis")
        c = connector(k, ref)
        for ids in prompts.values():  # a, then b pushes a to disk, then c pushes b to disk and a on to Redis
            c.run(c.request(ids, tenant="t"))
            settle(k)
        keys = {n: k.keys(c.request(ids, tenant="t")) for n, ids in prompts.items()}
        assert where(k, keys["c"]) == {"dram"}
        assert where(k, keys["b"]) == {"disk"}
        assert where(k, keys["a"]) == {"redis"}
        for name, tier in (("c", "dram"), ("b", "disk"), ("a", "redis")):
            ids = prompts[name]
            out = c.run(c.request(ids, tenant="t"), all_logits=True)
            assert out.plan.action == PlanAction.MATERIALIZE and out.tier == tier and out.tokens_reused == 96
            full = c.engine.prefill(ids, all_logits=True).logits[96:]
            assert (out.logits - full).abs().max().item() <= 1e-5, tier
            assert bool((out.logits.argmax(-1) == full.argmax(-1)).all())
            settle(k)


def test_a_hit_in_redis_is_promoted_to_dram(tmp_path, redis_url):
    ref = model("dense")
    ids = tokens(100, seed=21)
    with hierarchy(tmp_path, redis_url) as k:
        c = connector(k, ref, commit=False)
        req = c.request(ids, tenant="t")
        out = c.engine.prefill(ids)
        keys = k.keys(req)
        for b in range(6):  # placed straight on the slowest tier
            raw, specs = c.codec.page_payload(out.cache, b, 0)
            k.put(k.describe(req, b, raw, tier="redis", keys=keys, tensors=specs), raw)
        first = c.run(req)
        assert first.tier == "redis" and first.tokens_reused == 96
        settle(k)
        assert where(k, keys[:6]) == {"dram", "redis"}
        again = c.run(c.request(ids, tenant="t"))
        assert again.tier == "dram" and again.tokens_reused == 96
