"""The cluster-wide index: kernels in this process, one real Redis; publishing, following, fencing, resync, threads."""

from __future__ import annotations

import os
import random
import threading

import pytest
import redis

from nexuskv import Kernel, KernelConfig, Location, PluginError
from nexuskv_tier_redis import ClusterIndex
from nexuskv_tier_redis._index_lua import REGISTER, all_keys
from nexuskv_tier_redis._index_sync import publish_ops, stale
from nexuskv_tier_redis.cluster_testing import Cluster

wait_until = Cluster.wait_until


@pytest.fixture
def kernels(redis_server, prefix):
    made: list[Kernel] = []

    def make(node: str, **matcher) -> Kernel:
        cfg = {"name": "redis", "url": redis_server.url, "prefix": f"{prefix}/", "poll_s": 0.02, **matcher}
        k = Kernel(KernelConfig.from_mapping({"node": node, "lease_ttl_s": 1.0, "matcher": cfg}), secret=bytes(32))
        made.append(k)
        return k

    yield make
    for k in made:
        k.close()


def view_of(index, node: str) -> dict[bytes, int]:
    """What `index` believes `node` holds: key -> group mask in tier dram."""
    out: dict[bytes, int] = {}
    for loc in index.holdings():
        if loc.node == node:
            for key in index.keys_at(loc):
                out[key] = out.get(key, 0) | index.get(key).mask_at("dram", node)
    return out


def test_a_peer_sees_stores_and_removals(kernels):
    a, b = kernels("a"), kernels("b")
    keys = [os.urandom(16) for _ in range(50)]
    here = Location("dram", "a", a.epoch)
    a.index.insert_many(keys, here, 1)
    a.index.insert(keys[0], here, 2)
    assert wait_until(lambda: view_of(b.index, "a") == view_of(a.index, "a"), 10) is not None
    assert b.index.get(keys[0]).mask_at("dram", "a") == 3
    a.index.remove(keys[1], here, 1)
    assert wait_until(lambda: b.index.get(keys[1]) is None, 10) is not None
    a.index.drop_location(here)
    assert wait_until(lambda: view_of(b.index, "a") == {}, 10) is not None
    assert b.index.stats()["follow.events"] >= 1
    assert b.index.peers()["a"].startswith(f"{a.epoch}:")


def test_a_node_whose_lease_ends_is_dropped_everywhere(kernels, redis_server, prefix):
    a, b = kernels("a"), kernels("b")
    keys = [os.urandom(16) for _ in range(10)]
    a.index.insert_many(keys, Location("dram", "a", a.epoch), 1)
    assert wait_until(lambda: len(view_of(b.index, "a")) == 10, 10) is not None
    a.membership.stop()  # no more renewals: its lease, and its keys in Redis, run out
    assert wait_until(lambda: view_of(b.index, "a") == {}, 10) is not None
    r = redis_server.client()
    assert wait_until(lambda: not r.exists(f"{prefix}/idx:held:a") and not r.exists(f"{prefix}/idx:alive:a"), 10)


def test_the_server_refuses_a_stale_identity_and_a_lower_epoch(kernels, redis_server, prefix):
    a = kernels("a")
    r = redis_server.client()
    assert wait_until(lambda: a.index.publisher.ident, 10) is not None
    with pytest.raises(redis.ResponseError) as exc:
        publish_ops(r, f"{prefix}/", "a", "999:not-the-token", [("S", "dram", 1, os.urandom(16))], 1000)
    assert stale(exc.value)
    with pytest.raises(redis.ResponseError) as low:  # a registration at or below the fence: never again
        r.eval(REGISTER, 7, *all_keys(f"{prefix}/", "a", 1), "a", a.epoch, "x", 1000, 1)
    assert stale(low.value) and "fence" in str(low.value)
    ident = a.index.publisher.ident
    assert publish_ops(r, f"{prefix}/", "a", ident, [("S", "dram", 1, os.urandom(16))], 1000) > 0  # the live one


def test_a_gap_in_the_stream_means_a_resync_and_the_same_view(kernels, redis_server, prefix):
    a, b = kernels("a"), kernels("b")
    here = Location("dram", "a", a.epoch)
    a.index.insert_many([os.urandom(16) for _ in range(5)], here, 1)
    assert wait_until(lambda: len(view_of(b.index, "a")) == 5, 10) is not None
    redis_server.client().incr(f"{prefix}/idx:seq:a")  # an event b will never see: the next one skips a number
    a.index.insert_many([os.urandom(16) for _ in range(5)], here, 1)
    assert wait_until(lambda: b.index.stats()["follow.gaps"] >= 1, 10) is not None
    assert wait_until(lambda: view_of(b.index, "a") == view_of(a.index, "a"), 10) is not None
    assert len(view_of(b.index, "a")) == 10


def test_many_threads_change_holdings_and_every_view_agrees_with_a_reference(kernels, redis_server, prefix):
    a, b = kernels("a"), kernels("b")
    here = Location("dram", "a", a.epoch)
    reference: dict[bytes, int] = {}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine = [seed.to_bytes(2, "big") + os.urandom(14) for _ in range(40)]  # keys no other thread touches
        for _ in range(300):
            key, mask = rng.choice(mine), rng.choice((1, 2, 3))
            if rng.random() < 0.7:
                a.index.insert(key, here, mask)
                with lock:
                    reference[key] = reference.get(key, 0) | mask
            else:
                a.index.remove(key, here, mask)
                with lock:
                    left = reference.get(key, 0) & ~mask
                    if left:
                        reference[key] = left
                    else:
                        reference.pop(key, None)
        with lock:
            done.append(seed)

    done: list[int] = []
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(done) == list(range(8))  # every worker made all its changes
    assert view_of(a.index, "a") == reference
    assert wait_until(lambda: view_of(b.index, "a") == reference, 20) is not None
    held = redis_server.client().hgetall(f"{prefix}/idx:held:a")
    assert {f[:16]: int(m) for f, m in held.items()} == reference


def test_redis_unreachable_at_start_costs_nothing_but_sharing(kernels):
    k = kernels("solo", url="redis://127.0.0.1:1/0")  # nothing listens on port 1
    k.index.insert(os.urandom(16), Location("dram", "solo", k.epoch), 1)
    assert len(k.index) == 1  # the local index works as always
    assert wait_until(lambda: k.index.stats().get("publish.errors", 0) > 0, 10) is not None


def test_bad_options_are_config_errors(redis_server):
    with pytest.raises(ValueError, match="prefix must end"):
        ClusterIndex(url=redis_server.url, prefix="nope")
    with pytest.raises(ValueError, match="poll_s"):
        ClusterIndex(url=redis_server.url, poll_s=1.0, timeout_s=0.5)
    with pytest.raises(PluginError, match=r"ConfigError: \[matcher\] \(redis\).*pole_s"):
        Kernel(KernelConfig.from_mapping({"matcher": {"name": "redis", "url": redis_server.url, "pole_s": 1}}),
               secret=bytes(32))  # fmt: skip


def test_a_redis_hiccup_keeps_the_epoch_and_the_views_agree_again(kernels, redis_server):
    a, b = kernels("a"), kernels("b")
    here = Location("dram", "a", a.epoch)
    a.index.insert_many([os.urandom(16) for _ in range(5)], here, 1)
    assert wait_until(lambda: len(view_of(b.index, "a")) == 5, 10) is not None
    epoch = a.epoch
    redis_server.client().execute_command("CLIENT", "PAUSE", 800)  # longer than the clients' 0.5 s timeout
    a.index.insert_many([os.urandom(16) for _ in range(5)], here, 1)  # its write may time out: outcome unknown
    assert wait_until(lambda: view_of(b.index, "a") == view_of(a.index, "a") and len(view_of(b.index, "a")) == 10,
                      15) is not None  # fmt: skip
    assert a.epoch == epoch  # a hiccup is not a lost lease: the same epoch publishes everything again


def test_node_names_with_colons_are_followed(kernels):
    a, b = kernels("host-a:8000"), kernels("host-b:8000")
    keys = [os.urandom(16) for _ in range(5)]
    a.index.insert_many(keys, Location("dram", "host-a:8000", a.epoch), 1)
    assert wait_until(lambda: len(view_of(b.index, "host-a:8000")) == 5, 10) is not None
