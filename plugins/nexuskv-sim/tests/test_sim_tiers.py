from _sim_fakes import request

from nexuskv_sim.tiers import BlockMeta, BlockTier, LRUTier, block_keys


def meta(n=10):
    return BlockMeta("m", "t", 0, 0, 512, n)


def test_lru_evicts_least_recently_used_at_capacity():
    t = LRUTier("dram", 30)
    assert isinstance(t, BlockTier)
    for k in "abc":
        assert t.insert(k, meta()) == []
    t.touch("a")  # order now b, c, a
    assert t.insert("d", meta()) == ["b"]
    assert t.insert("e", meta(20)) == ["c", "a"]
    assert t.keys() == ["d", "e"] and t.used_bytes == 30 and len(t) == 2
    assert not t.contains("a") and t.contains("e")


def test_insert_of_held_key_touches_and_oversized_block_is_not_stored():
    t = LRUTier("hbm", 20)
    t.insert("a", meta())
    t.insert("b", meta())
    assert t.insert("a", meta()) == []
    assert t.insert("c", meta()) == ["b"]
    assert t.insert("huge", meta(21)) == [] and not t.contains("huge")


def test_block_keys_separate_models_and_tenants():
    a = block_keys(request(0, [1, 2]))
    assert a == (("m", "default", 1), ("m", "default", 2))
    assert block_keys(request(1, [1, 2], tenant="acme")) != a
    assert block_keys(request(2, [1, 2], model="other")) != a
