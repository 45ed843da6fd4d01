"""The NexusKV HiCache backend on SGLang's real classes: identity, decisions, verification, both interfaces."""

from __future__ import annotations

import json
import random
import shlex
import threading

import pytest
import torch
from click.testing import CliRunner
from nexuskv_sglang.backend import NexusKVStorage
from nexuskv_sglang.commands import sglang_args, sglang_args_command
from sglang.srt.mem_cache.storage import StorageBackendFactory

from conftest import PAGE, fill, indices, mha_host, mla_host, page_bytes, storage_config
from nexuskv import slot_of


def backend(kernel, host=None, **cfg) -> NexusKVStorage:
    extra = cfg.pop("extra", None)
    b = NexusKVStorage(storage_config(extra, **cfg), kernel=kernel)
    b.register_mem_pool_host(host if host is not None else mha_host())
    b.on_host_pools_registered()  # as SGLang's cache controller does once its pools are registered
    return b


def keys_for(n: int, tag: str = "p") -> list[str]:
    return [f"{tag}{i:04d}" for i in range(n)]


def test_sglangs_factory_loads_it_as_a_dynamic_backend(kernel_toml):
    extra = json.loads(sglang_args(str(kernel_toml), "chat")[-1])
    host = mha_host()
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), host)
    try:
        assert type(b).__name__ == "NexusKVStorage" and b.identity.tenant == "chat"
        b.register_mem_pool_host(host)
        fill(host, range(0, 3))
        assert b.batch_set_v1(keys_for(3), indices(range(0, 3))) == [True] * 3
        assert b.kernel.flush(10)
        assert b.batch_exists(keys_for(3)) == 3
    finally:
        b.close()


def test_the_command_prints_flags_sglang_parses(kernel_toml):
    out = CliRunner().invoke(sglang_args_command, [str(kernel_toml), "--tenant", "chat"])
    assert out.exit_code == 0, out.output
    args = shlex.split(out.output)
    assert args[args.index("--hicache-storage-backend") + 1] == "dynamic"
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["class_name"] == "NexusKVStorage" and extra["interface_v1"] == 1 and extra["tenant"] == "chat"


def test_pages_round_trip_through_the_host_pool_zero_copy_interface(kernel):
    host = mha_host()
    b = backend(kernel, host)
    fill(host, range(0, 5), seed=1)
    want = [page_bytes(host, i) for i in range(5)]
    assert b.batch_set_v1(keys_for(5), indices(range(0, 5))) == [True] * 5
    assert kernel.flush(10)
    assert b.batch_exists([*keys_for(5), "missing"]) == 5
    assert b.batch_get_v1(keys_for(5), indices(range(8, 13))) == [True] * 5
    assert [page_bytes(host, i) for i in range(8, 13)] == want
    metrics = b.get_stats()  # what SGLang's metrics loop reads every step: its own type, NexusKV's counts beside
    assert type(metrics).__name__ == "StorageMetrics" and metrics.prefetch_pgs == [5] and metrics.backup_pgs == [5]
    assert metrics.nexuskv["stored_pages"] == 5 and metrics.nexuskv["got_pages"] == 5
    assert metrics.nexuskv["decisions"] >= 1  # the get was served as the existence answer approved: no second plan
    assert b.get_stats().prefetch_pgs == []  # drained


def test_pages_round_trip_through_the_legacy_interface(kernel):
    host = mha_host()
    b = backend(kernel, host)
    fill(host, range(0, 2), seed=2)
    pages = [host.get_data_page(i * PAGE).clone() for i in range(2)]
    assert b.batch_set(keys_for(2), pages)
    assert kernel.flush(10)
    assert b.exists(keys_for(2)[0]) and not b.exists("nope")
    got = b.batch_get(keys_for(2), [host.get_dummy_flat_data_page() for _ in range(2)])
    assert all(torch.equal(g, p) for g, p in zip(got, pages, strict=True))
    assert b.get("nope", host.get_dummy_flat_data_page()) is None


def test_another_model_tenant_or_salt_never_sees_the_pages(kernel):
    b = backend(kernel)
    fill(b.mem_pool_host, range(0, 3))
    b.batch_set_v1(keys_for(3), indices(range(0, 3)))
    assert kernel.flush(10) and b.batch_exists(keys_for(3)) == 3
    others = [backend(kernel, model="other/model"), backend(kernel, extra={"tenant": "rag"}),
              backend(kernel, extra={"cache_salt": "s1"}), backend(kernel, extra={"model_revision": "v2"}),
              backend(kernel, tp_rank=1, tp_size=2)]  # fmt: skip
    for other in others:
        assert other.batch_exists(keys_for(3)) == 0 and not other.exists(keys_for(3)[0])
        assert other.batch_get_v1(keys_for(3), indices(range(8, 11))) == [False] * 3
        assert "nothing reusable" in " ".join(other.plan(keys_for(3)).reasons) or \
            other.plan(keys_for(3)).tokens_reused == 0  # fmt: skip


def test_a_tenant_whose_policy_refuses_reuse_is_told_to_recompute(kernel):
    blocked = backend(kernel, extra={"tenant": "blocked"})
    fill(blocked.mem_pool_host, range(0, 3))
    assert blocked.batch_set_v1(keys_for(3), indices(range(0, 3))) == [True] * 3
    assert kernel.flush(10)
    assert blocked.exists(keys_for(3)[0])  # held ...
    assert blocked.batch_exists(keys_for(3)) == 0  # ... but not to be reused: recompute
    plan = blocked.plan(keys_for(3))
    assert plan.rules == ("never",) and plan.action.value == "recompute", plan.reasons
    assert blocked.batch_get_v1(keys_for(3), indices(range(8, 11))) == [False] * 3  # a get is planned too


@pytest.mark.parametrize("threads", [False, True], ids=["in-caller", "reader-threads"])
def test_a_corrupt_page_is_refused_quarantined_and_its_tail_recomputed(kernel, threads):
    host = mha_host()
    b = backend(kernel, host)
    if threads:  # every run through the reader threads, as large pages go
        b.reader.parallel_bytes = 0
    fill(host, range(0, 4), seed=3)
    b.batch_set_v1(keys_for(4), indices(range(0, 4)))
    assert kernel.flush(10)
    dram = kernel.tiers["dram"]
    key = b.pages.keys(keys_for(4))[2]
    stored = dram.get(slot_of(key, 0))
    bad = bytearray(stored.payload)
    bad[0] ^= 0xFF
    assert dram.put(slot_of(key, 0), bytes(bad), stored.descriptor)  # a writer of the tier changed page 2
    got = b.batch_get_v1(keys_for(4), indices(range(8, 12)))
    assert got == [True, True, False, False]  # the bad page and what follows it are recomputed by SGLang
    assert [page_bytes(host, i) for i in (8, 9)] == [page_bytes(host, i) for i in (0, 1)]
    assert not b.exists(keys_for(4)[2])  # quarantined: gone from the index
    assert b.batch_exists(keys_for(4)) == 2


def test_mla_pages_are_stored_once_for_every_tensor_parallel_rank(kernel):
    r0, r1 = backend(kernel, mla_host(), mla=True, tp_rank=0, tp_size=2), backend(kernel, mla_host(), mla=True,
                                                                                    tp_rank=1, tp_size=2)  # fmt: skip
    assert r0.pages.layout.kind == "latent"
    fill(r0.mem_pool_host, range(0, 2), seed=4)
    assert r0.batch_set_v1(keys_for(2), indices(range(0, 2))) == [True, True]
    assert kernel.flush(10)
    assert r1.batch_exists(keys_for(2)) == 2
    assert r1.batch_get_v1(keys_for(2), indices(range(0, 2))) == [True, True]
    assert [page_bytes(r1.mem_pool_host, i) for i in range(2)] == [page_bytes(r0.mem_pool_host, i) for i in range(2)]


def test_a_kernel_of_another_page_size_is_a_clear_error(policies):
    from nexuskv import Kernel, KernelConfig

    with Kernel(KernelConfig(node="n1", page_size=16, policies=str(policies)), secret=bytes(32)) as k:
        b = NexusKVStorage(storage_config(), kernel=k)
        b.register_mem_pool_host(mha_host())
        with pytest.raises(ValueError, match="page size 4 is not the kernel's page_size 16"):
            b.on_host_pools_registered()  # SGLang's attach fails, saying why
        for ttl in (float("inf"), float("nan"), -1.0):  # an approval must expire: a policy change applies soon
            with pytest.raises(ValueError, match=r"approval_ttl_s must be 0\.\.3600 seconds"):
                NexusKVStorage(storage_config({"approval_ttl_s": ttl}), kernel=k)
        no_tenant = storage_config()
        no_tenant.extra_config.pop("tenant")
        with pytest.raises(ValueError, match="needs 'tenant'"):
            NexusKVStorage(no_tenant, kernel=k)


def test_many_threads_store_and_read_their_own_pages_and_agree_with_a_reference(kernel):
    host = mha_host()
    b = backend(kernel, host)
    reference: dict[str, bytes] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        for step in range(20):
            keys = [f"t{t}-s{step}-{j}" for j in range(2)]
            payloads = [torch.randn(host.get_dummy_flat_data_page().shape, generator=torch.Generator().manual_seed(
                rng.randrange(1 << 30))).to(torch.bfloat16) for _ in keys]  # fmt: skip
            if b.batch_set(keys, payloads):
                with lock:
                    for k, p in zip(keys, payloads, strict=True):
                        reference[k] = p.view(torch.uint8).numpy().tobytes()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert kernel.flush(20)
    assert len(reference) == 6 * 20 * 2
    runs = sorted({key.rsplit("-", 1)[0] for key in reference})  # each step's two pages, read as the run they were
    for run in runs:
        keys = [f"{run}-{j}" for j in range(2)]
        got = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
        errors += [k for k, g in zip(keys, got, strict=True)
                   if g is None or g.view(torch.uint8).numpy().tobytes() != reference[k]]  # fmt: skip
    assert errors == []
