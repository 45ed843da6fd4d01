"""The multi-pool (`*_v2`) calls on SGLang's real host pools: KV with a Mamba pool (recurrent) or a sliding-window
pool (windowed), against SGLang's own file backend, with identity and verification as for the KV pool alone."""

from __future__ import annotations

import pytest
import torch
from nexuskv_sglang.backend import NexusKVStorage
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer

from conftest import PAGE, fill, indices, mamba_host, mha_host, storage_config
from nexuskv import slot_of

TRAILING = PoolHitPolicy.TRAILING_PAGES


def attach(b, kv, extra: dict) -> None:
    """What SGLang's hybrid cache controller does: the anchor, then every pool through v2, then the signal."""
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, host in extra.items():
        b.register_mem_host_pool_v2(host, name)
    b.on_host_pools_registered()


def fill_mamba(host, slots, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for s in slots:
        flat = host.get_dummy_flat_data_page()
        host.set_from_flat_data_page(s, torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))


def mamba_page(host, slot: int) -> bytes:
    return host.get_data_page(slot, flat=True).numpy().tobytes()


def kv_page(host, page: int) -> bytes:
    return host.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def write_back(kernel, backends, kv, mamba, keys: list[str], states: list[int], seed: int) -> None:
    """What SGLang's write-back does for a hybrid run: `keys`' KV pages (host pages 0..n) and the Mamba checkpoints
    at pages `states` (host slot = page index), through `batch_set_v2` of every backend, all accepted."""
    fill(kv, range(0, len(keys)), seed=seed)
    fill_mamba(mamba, states, seed=seed + 1)
    sets = [PoolTransfer(PoolName.KV, host_indices=indices(range(0, len(keys))), keys=keys),
            PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor(states), keys=[keys[i] for i in states])]
    want = {"kv": [True] * len(keys), "mamba": [True] * len(states)}
    for b in backends:
        assert b.batch_set_v2(sets) == want
    assert kernel.flush(10)


@pytest.fixture
def pair(kernel, tmp_path):
    """NexusKV and SGLang's file backend over the same KV and Mamba host pools."""
    kv, mamba = mha_host(), mamba_host()
    cfg = storage_config()
    ours, theirs = NexusKVStorage(cfg, kernel=kernel), HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
    for b in (ours, theirs):
        attach(b, kv, {PoolName.MAMBA: mamba})
    return ours, theirs, kv, mamba


def test_kv_with_mamba_checkpoints_agrees_with_the_file_backend(pair, kernel):
    ours, theirs, kv, mamba = pair
    keys = [f"h{i}" for i in range(6)]
    # SGLang writes six KV pages back, with the recurrent state checkpointed at pages 2 and 4
    write_back(kernel, (ours, theirs), kv, mamba, keys, [1, 3], seed=1)
    # the usable prefix: KV for every page, the state at its end (a prefix of 6 has none: cut at 4)
    query = [PoolTransfer(PoolName.MAMBA, keys=[keys[5]], hit_policy=TRAILING)]
    a, b = ours.batch_exists_v2(keys, query), theirs.batch_exists_v2(keys, query)
    assert (a.kv_hit_pages, a.restorable_prefix_pages) == (b.kv_hit_pages, b.restorable_prefix_pages) == (4, [2, 4])
    # each pool's own verdict: the file backend's KV is what is present (6), NexusKV's what its plan restores (4)
    assert b.extra_pool_hit_pages == {"kv": 6, "mamba": 4} and a.extra_pool_hit_pages == {"kv": 4, "mamba": 4}
    # SGLang loads the 4-page prefix and the state at its end into fresh host slots
    gets = [PoolTransfer(PoolName.KV, host_indices=indices(range(8, 12)), keys=keys[:4]),
            PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([9]), keys=[keys[3]],
                         hit_policy=TRAILING)]  # fmt: skip
    assert ours.batch_get_v2(gets) == {"kv": [True] * 4, "mamba": [True]}
    assert [kv_page(kv, 8 + i) for i in range(4)] == [kv_page(kv, i) for i in range(4)]
    assert mamba_page(mamba, 9) == mamba_page(mamba, 3)
    fill(kv, range(8, 12), seed=9)
    fill_mamba(mamba, [9], seed=9)
    assert theirs.batch_get_v2(gets) == {"kv": [True] * 4, "mamba": [True]}
    assert [kv_page(kv, 8 + i) for i in range(4)] == [kv_page(kv, i) for i in range(4)]
    assert mamba_page(mamba, 9) == mamba_page(mamba, 3)


def test_a_sliding_window_pool_needs_its_whole_trailing_window(kernel, tmp_path):
    kv, swa = mha_host(), mha_host()
    cfg = storage_config({"swa_window": 2 * PAGE})
    ours, theirs = NexusKVStorage(cfg, kernel=kernel), HiCacheFile(cfg, file_path=str(tmp_path / "hicache"))
    for b in (ours, theirs):
        attach(b, kv, {PoolName.SWA: swa})
    assert ours.pages.layout.kind == "hybrid" and ours.pages.layout.groups[1].kind.value == "windowed"
    keys = [f"w{i}" for i in range(5)]
    fill(kv, range(0, 5), seed=3)
    fill(swa, range(0, 5), seed=4)
    # the window pages of pages 2-4 are written back (page 1's was evicted before the write-back)
    sets = [PoolTransfer(PoolName.KV, host_indices=indices(range(0, 5)), keys=keys),
            PoolTransfer(PoolName.SWA, host_indices=indices(range(2, 5)), keys=keys[2:5])]  # fmt: skip
    assert ours.batch_set_v2(sets) == theirs.batch_set_v2(sets)
    assert kernel.flush(10)
    query = [PoolTransfer(PoolName.SWA, keys=keys[3:5], hit_policy=TRAILING)]  # a window of 2 pages
    a, b = ours.batch_exists_v2(keys, query), theirs.batch_exists_v2(keys, query)
    # a cut at 3 needs window pages 1-2 (page 1 missing); at 4 and 5 the windows are held
    assert (a.kv_hit_pages, a.restorable_prefix_pages) == (b.kv_hit_pages, b.restorable_prefix_pages) == (5, [4, 5])
    gets = [PoolTransfer(PoolName.KV, host_indices=indices(range(8, 13)), keys=keys),
            PoolTransfer(PoolName.SWA, host_indices=indices(range(8, 10)), keys=keys[3:5], hit_policy=TRAILING)]
    assert ours.batch_get_v2(gets) == {"kv": [True] * 5, "swa": [True, True]}
    assert [kv_page(swa, 8 + i) for i in range(2)] == [kv_page(swa, i) for i in (3, 4)]


def test_another_tenant_sees_no_pool_and_a_corrupt_checkpoint_is_recomputed(pair, kernel):
    ours, _, kv, mamba = pair
    keys = [f"c{i}" for i in range(3)]
    write_back(kernel, (ours,), kv, mamba, keys, [2], seed=5)
    query = [PoolTransfer(PoolName.MAMBA, keys=[keys[2]], hit_policy=TRAILING)]
    assert ours.batch_exists_v2(keys, query).kv_hit_pages == 3
    other = NexusKVStorage(storage_config({"tenant": "blocked"}), kernel=kernel)
    attach(other, mha_host(), {PoolName.MAMBA: mamba_host()})
    assert other.batch_exists_v2(keys, query).kv_hit_pages == 0  # other keys, and its policy refuses reuse
    gets = [PoolTransfer(PoolName.KV, host_indices=indices(range(8, 11)), keys=keys),
            PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([7]), keys=[keys[2]], hit_policy=TRAILING)]
    assert other.batch_get_v2(gets) == {"kv": [False] * 3, "mamba": [False]}
    # a store writer flips a byte of the stored checkpoint: it is refused, quarantined, and SGLang recomputes
    key = ours.pages.keys([keys[2]])[0]
    tier = kernel.hierarchy.tiers["dram"]
    stored = tier.get(slot_of(key, 1))
    raw = bytearray(stored.payload)
    raw[-1] ^= 0xFF
    assert tier.put(slot_of(key, 1), bytes(raw), stored.descriptor)
    got = ours.batch_get_v2(gets)
    assert got["mamba"] == [False]
    assert ours.batch_exists_v2(keys, query).kv_hit_pages == 0  # quarantined: no cut has its state any more


def test_a_pool_nexuskv_cannot_map_fails_the_attach_and_v2_calls_naming_it_get_nothing(kernel):
    b = NexusKVStorage(storage_config(), kernel=kernel)
    with pytest.raises(ValueError, match="'indexer' host pool has no NexusKV state kind"):
        attach(b, mha_host(), {PoolName.INDEXER: mha_host()})
    ok = NexusKVStorage(storage_config(), kernel=kernel)
    attach(ok, mha_host(), {})
    query = [PoolTransfer(PoolName.MAMBA, keys=["x"], hit_policy=TRAILING)]
    assert ok.batch_exists_v2(["x"], query).kv_hit_pages == 0
    assert ok.batch_get_v2(query) == {"mamba": [False]}


def test_sglangs_own_order_kv_in_batches_then_the_state_alone_is_served_as_promised(pair, kernel):
    """SGLang reads a hybrid hit as its controller does: the KV run through `batch_get_v1` in batches (at most 128
    pages each), then the Mamba checkpoint in a `batch_get_v2` of its own. Each fragment alone (one page, the state
    without its KV) would not be worth fetching; they are served because the existence answer approved them."""
    ours, _, kv, mamba = pair
    keys = [f"o{i}" for i in range(5)]
    write_back(kernel, (ours,), kv, mamba, keys, [4], seed=7)
    assert ours.plan(keys[4:]).action.value == "recompute"  # one page alone: not worth a fetch
    hit = ours.batch_exists_v2(keys, [PoolTransfer(PoolName.MAMBA, keys=[keys[4]], hit_policy=TRAILING)])
    assert hit.kv_hit_pages == 5
    assert ours.batch_get_v1(keys[:4], indices(range(8, 12))) == [True] * 4
    assert ours.batch_get_v1(keys[4:], indices(range(12, 13))) == [True]  # the last batch: one page
    state = [PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([10]), keys=[keys[4]], hit_policy=TRAILING)]
    assert ours.batch_get_v2(state) == {"mamba": [True]}
    assert [kv_page(kv, 8 + i) for i in range(5)] == [kv_page(kv, i) for i in range(5)]
    assert mamba_page(mamba, 10) == mamba_page(mamba, 4)
    other = [PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([11]), keys=["never-approved"],
                          hit_policy=TRAILING)]  # fmt: skip
    assert ours.batch_get_v2(other) == {"mamba": [False]}  # a state nobody approved is not read


def test_no_page_reaches_a_slot_after_the_read_returned(pair, kernel, monkeypatch):
    """Review finding: a read that fails at page 0 returned while pages 1-3 were still being read, and they were
    copied into slots SGLang had freed meanwhile. Now the sink closes when the read returns."""
    import threading
    import time as _time

    ours, _, kv, _ = pair
    keys = [f"r{i}" for i in range(4)]
    fill(kv, range(0, 4), seed=9)
    assert ours.batch_set_v1(keys, indices(range(0, 4))) == [True] * 4 and kernel.flush(10)
    ours.reader.parallel_bytes = 0
    real = ours.reader.page
    release = threading.Event()

    def injected(pool, block_key):  # a fault: page 0 is gone, the others arrive late
        if block_key == ours.pages.keys(keys[:1])[0]:
            return None
        release.wait(5)
        return real(pool, block_key)

    monkeypatch.setattr(ours.reader, "page", injected)
    ours.approvals.approve(keys)
    before = [kv_page(kv, i) for i in range(8, 12)]
    assert ours.batch_get_v1(keys, indices(range(8, 12))) == [False] * 4
    release.set()
    _time.sleep(0.3)
    assert [kv_page(kv, i) for i in range(8, 12)] == before  # the late pages were dropped


def test_a_hung_tier_costs_a_read_its_timeout_not_the_prefetch_thread(pair, kernel, monkeypatch):
    import threading
    import time as _time

    ours, _, kv, _ = pair
    keys = [f"h{i}" for i in range(3)]
    fill(kv, range(0, 3), seed=10)
    assert ours.batch_set_v1(keys, indices(range(0, 3))) == [True] * 3 and kernel.flush(10)
    ours.reader.parallel_bytes = 0
    ours.reader.timeout_s = 0.2
    hang = threading.Event()
    monkeypatch.setattr(ours.reader, "page", lambda pool, key: hang.wait(10) and None)  # a tier that never answers
    ours.approvals.approve(keys)
    t0 = _time.monotonic()
    assert ours.batch_get_v1(keys, indices(range(8, 11))) == [False] * 3
    assert _time.monotonic() - t0 < 5  # bounded by the timeout (0.2 s), whatever the hung reads do
    hang.set()


def test_mla_with_a_mamba_pool_at_tensor_parallel_two_is_refused_at_attach(kernel):
    from conftest import mla_host

    b = NexusKVStorage(storage_config(mla=True, tp_rank=1, tp_size=2), kernel=kernel)
    with pytest.raises(ValueError, match="MLA model with a Mamba or sliding-window pool at tensor parallel > 1"):
        attach(b, mla_host(), {PoolName.MAMBA: mamba_host()})
