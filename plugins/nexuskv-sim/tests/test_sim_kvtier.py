"""KernelTier: the simulator's tier on the kernel's own store and eviction priorities."""

from nexuskv_sim.calibrate import measured_profile
from nexuskv_sim.kvtier import KernelTier
from nexuskv_sim.profile import default_profile
from nexuskv_sim.tiers import BlockMeta, BlockTier

PROFILES = {m: measured_profile(default_profile(), m) for m in ("llama-8b", "llama-70b")}
NB = {"llama-8b": 64 << 20, "llama-70b": 160 << 20}


def put(tier, model, hid, parent=None):
    key = (model, "t", hid)
    return tier.insert(key, BlockMeta(model, "t", hid, 0, 512, NB[model], parent))


def test_is_a_block_tier_and_accounts_real_bytes():
    t = KernelTier("h/dram", 4 * (64 << 20), PROFILES)
    assert isinstance(t, BlockTier)
    assert put(t, "llama-8b", 1) == [] and t.contains(("llama-8b", "t", 1)) and t.used_bytes == 64 << 20
    assert len(t) == 1


def test_lru_evicts_least_recently_used_first():
    t = KernelTier("h/dram", 3 * (64 << 20), PROFILES, eviction="lru")
    for h in (1, 2, 3):
        put(t, "llama-8b", h)
    t.touch(("llama-8b", "t", 1))
    assert put(t, "llama-8b", 4) == [("llama-8b", "t", 2)]


def test_cost_eviction_keeps_the_block_that_saves_more_recompute_per_byte():
    t = KernelTier("h/dram", 2 * (160 << 20), PROFILES)
    put(t, "llama-70b", 1)  # older, but 70b's blocks save far more prefill time per byte
    put(t, "llama-8b", 2)
    put(t, "llama-8b", 3)
    gone = put(t, "llama-8b", 4)
    assert ("llama-70b", "t", 1) not in gone and t.contains(("llama-70b", "t", 1))
    lru = KernelTier("h/dram", 2 * (160 << 20), PROFILES, eviction="lru")
    put(lru, "llama-70b", 1)
    put(lru, "llama-8b", 2)
    put(lru, "llama-8b", 3)
    assert ("llama-70b", "t", 1) in put(lru, "llama-8b", 4)


def test_a_prefix_is_never_evicted_while_its_continuation_stays():
    t = KernelTier("h/dram", 2 * (64 << 20), PROFILES, eviction="lru")
    put(t, "llama-8b", 1)
    put(t, "llama-8b", 2, parent=1)
    assert put(t, "llama-8b", 3) == [("llama-8b", "t", 2)]  # the leaf goes, though the root is older


def test_without_read_counting_reads_only_refresh_recency():
    t = KernelTier("h/disk", 3 * (64 << 20), PROFILES, count_reads=False)
    for h in (1, 2, 3):
        put(t, "llama-8b", h)
    for _ in range(5):
        t.touch(("llama-8b", "t", 1))  # read often, then 2 is read last
    t.touch(("llama-8b", "t", 2))
    put(t, "llama-8b", 4)
    put(t, "llama-8b", 5)
    assert t.contains(("llama-8b", "t", 2)) and not t.contains(("llama-8b", "t", 1))  # recency, not reads
