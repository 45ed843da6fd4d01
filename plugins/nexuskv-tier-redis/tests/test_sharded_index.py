"""The cluster index split into shards: per-(node, shard) streams and holdings, partial followers, shard loss.

Kernels in this process, one real Redis. What each test attacks: a peer's view against the publisher's own, a
gap in one shard's stream, a process that follows some shards or none, a node configured with another shard
count, a stale writer in every shard, a lost router view rebuilt from every shard at once, and many threads
against a reference model.
"""

from __future__ import annotations

import os
import random
import threading

import pytest
import redis

from nexuskv import Kernel, KernelConfig, Location, PluginError
from nexuskv_tier_redis import ClusterIndex
from nexuskv_tier_redis._index_lua import shard_keys, shard_of
from nexuskv_tier_redis._index_sync import publish_ops, stale
from nexuskv_tier_redis.cluster_testing import Cluster

wait_until = Cluster.wait_until
S = 4


@pytest.fixture
def kernels(redis_server, prefix):
    made: list[Kernel] = []

    def make(node: str, **matcher) -> Kernel:
        cfg = {"name": "redis", "url": redis_server.url, "prefix": f"{prefix}/", "poll_s": 0.02, "shards": S,
               **matcher}  # fmt: skip
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


def held_in_redis(r: redis.Redis, prefix: str, node: str, shard: int) -> dict[bytes, int]:
    return {f[:16]: int(m) for f, m in r.hgetall(shard_keys(f"{prefix}/", node, shard, S)[0]).items()}


def test_every_change_lands_in_its_keys_shard_and_a_peer_sees_the_same_view(kernels, redis_server, prefix):
    a, b = kernels("a"), kernels("b")
    here = Location("dram", "a", a.epoch)
    keys = [os.urandom(16) for _ in range(200)]
    a.index.insert_many(keys, here, 1)
    a.index.insert(keys[0], here, 2)
    for k in keys[100:150]:
        a.index.remove(k, here)
    assert wait_until(lambda: view_of(b.index, "a") == view_of(a.index, "a"), 10) is not None
    r = redis_server.client()
    for s in range(S):  # each shard's holding has exactly the keys of that shard, with their masks
        want = {k: m for k, m in view_of(a.index, "a").items() if shard_of(k, S) == s}
        assert want and held_in_redis(r, prefix, "a", s) == want
        assert r.xlen(shard_keys(f"{prefix}/", "a", s, S)[2]) >= 1  # every shard got its own events
    assert not r.exists(f"{prefix}/idx:held:a")  # no unsharded holding besides
    assert a.index.stats()["publish.events"] >= S


def test_a_gap_in_one_shards_stream_resyncs_that_shard_only(kernels, redis_server, prefix):
    a, b = kernels("a"), kernels("b")
    here = Location("dram", "a", a.epoch)
    a.index.insert_many([os.urandom(16) for _ in range(100)], here, 1)
    assert wait_until(lambda: len(view_of(b.index, "a")) == 100, 10) is not None
    full = b.index.stats()["follow.resyncs"]
    redis_server.client().incr(shard_keys(f"{prefix}/", "a", 2, S)[1])  # shard 2 skips an event number
    a.index.insert_many([os.urandom(16) for _ in range(100)], here, 1)  # lands in every shard
    assert wait_until(lambda: b.index.stats()["follow.gaps"] >= 1, 10) is not None
    assert wait_until(lambda: view_of(b.index, "a") == view_of(a.index, "a"), 10) is not None
    assert len(view_of(b.index, "a")) == 200
    stats = b.index.stats()
    assert stats["follow.shard_resyncs"] == 1 and stats["follow.resyncs"] == full  # the other shards kept going


def test_a_process_following_some_shards_holds_only_their_keys(kernels):
    a, router = kernels("a"), kernels("router", follow=[0, 1])
    here = Location("dram", "a", a.epoch)
    keys = [os.urandom(16) for _ in range(400)]
    a.index.insert_many(keys, here, 1)
    mine = {k: 1 for k in keys if shard_of(k, S) in (0, 1)}
    assert 100 < len(mine) < 300
    assert wait_until(lambda: view_of(router.index, "a") == mine, 10) is not None
    a.index.drop_location(here)
    assert wait_until(lambda: view_of(router.index, "a") == {}, 10) is not None


def test_a_node_following_none_holds_only_its_own_and_its_peers_still_see_it(kernels):
    a, lone = kernels("a"), kernels("lone", follow="none")
    assert lone.index.follower is None
    a.index.insert_many([os.urandom(16) for _ in range(50)], Location("dram", "a", a.epoch), 1)
    own = [os.urandom(16) for _ in range(30)]
    lone.index.insert_many(own, Location("dram", "lone", lone.epoch), 1)
    assert wait_until(lambda: len(view_of(a.index, "lone")) == 30, 10) is not None
    assert view_of(lone.index, "a") == {} and set(view_of(lone.index, "lone")) == set(own)


def test_a_node_with_another_shard_count_is_refused_and_publishes_nothing(kernels, redis_server, prefix):
    a = kernels("a")
    assert wait_until(lambda: a.index.publisher.ident, 10) is not None
    odd = kernels("odd", shards=2)
    odd.index.insert(os.urandom(16), Location("dram", "odd", odd.epoch), 1)
    assert wait_until(lambda: odd.index.stats()["publish.refused_shards"] >= 1, 10) is not None
    r = redis_server.client()
    assert not r.exists(f"{prefix}/idx:alive:odd") and int(r.get(f"{prefix}/idx:shards")) == S
    assert "odd" not in a.index.peers()


def test_a_stale_identity_is_refused_in_every_shard(kernels, redis_server, prefix):
    a = kernels("a")
    assert wait_until(lambda: a.index.publisher.ident, 10) is not None
    r = redis_server.client()
    for s in range(S):
        with pytest.raises(redis.ResponseError) as exc:
            publish_ops(r, f"{prefix}/", "a", f"{a.epoch}:forged", [("S", "dram", 1, os.urandom(16))], 1000,
                        shard=s, shards=S)  # fmt: skip
        assert stale(exc.value)
        assert held_in_redis(r, prefix, "a", s) == {}


def test_a_lost_router_is_survived_by_its_replica_and_rebuilt_from_every_shard(kernels):
    a, b = kernels("a"), kernels("b")
    r1, r2 = kernels("r1", resync_threads=4), kernels("r2")
    for k in (a, b):
        k.index.insert_many([os.urandom(16) for _ in range(2_000)], Location("dram", k.node, k.epoch), 1)
    truth = {n: view_of(k.index, n) for n, k in (("a", a), ("b", b))}
    for r in (r1, r2):
        assert wait_until(lambda r=r: all(view_of(r.index, n) == v for n, v in truth.items()), 15) is not None
    r1.close()  # one replica of the fleet view is lost; the other answers as before
    assert all(view_of(r2.index, n) == v for n, v in truth.items())
    r3 = kernels("r3", resync_threads=4)  # its replacement rebuilds the view from every shard's holding at once
    assert wait_until(lambda: all(view_of(r3.index, n) == v for n, v in truth.items()), 15) is not None
    assert r3.index.stats()["follow.resyncs"] >= 2 and r3.index.stats()["follow.gaps"] == 0


def test_many_threads_and_every_shards_view_agrees_with_a_reference(kernels, redis_server, prefix):
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

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert view_of(a.index, "a") == reference
    assert wait_until(lambda: view_of(b.index, "a") == reference, 20) is not None
    r = redis_server.client()
    merged: dict[bytes, int] = {}
    for s in range(S):
        merged.update(held_in_redis(r, prefix, "a", s))
    assert merged == reference


@pytest.mark.parametrize(("options", "message"), [
    ({"shards": 0}, "shards is a whole number from 1 to 1024"),
    ({"shards": 4, "follow": [4]}, "follow is .* shards from 0 to 3"),
    ({"shards": 4, "follow": "some"}, "follow is"),
    ({"shards": 4, "follow": []}, "non-empty list"),
    ({"resync_threads": 0}, "resync_threads is a whole number from 1 to 64"),
])  # fmt: skip
def test_bad_shard_options_are_refused_with_what_is_allowed(redis_server, options, message):
    with pytest.raises(ValueError, match=message):
        ClusterIndex(url=redis_server.url, **options)
    with pytest.raises(PluginError, match=message):
        Kernel(KernelConfig.from_mapping({"matcher": {"name": "redis", "url": redis_server.url, **options}}),
               secret=bytes(32))  # fmt: skip


def test_the_readmes_matcher_examples_are_valid_options(redis_server):
    import re
    import tomllib
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", readme, re.S)]
    matchers = [b["matcher"] for b in blocks if "matcher" in b]
    assert len(matchers) >= 2 and any(m.get("follow") == "none" for m in matchers)
    for m in matchers:
        index = ClusterIndex(**{k: v for k, v in m.items() if k != "name"} | {"url": redis_server.url})
        assert index.shards == m.get("shards", 1)
        index.close()


def test_a_node_refused_for_its_shard_count_keeps_no_queue(kernels, redis_server, prefix):
    a = kernels("a")
    assert wait_until(lambda: a.index.publisher.ident, 10) is not None
    odd = kernels("odd", shards=2)
    assert wait_until(lambda: odd.index.stats()["publish.refused_shards"] >= 1, 10) is not None
    for _ in range(20):
        odd.index.insert_many([os.urandom(16) for _ in range(100)], Location("dram", "odd", odd.epoch), 1)
    assert wait_until(lambda: not odd.index._queue, 10) is not None  # its changes are not held for a registration
    assert len(odd.index) == 2000  # its own index is whole: a registration's snapshot would publish all of it


def test_the_shard_count_lives_with_the_leases_and_a_new_fleet_may_choose_another(kernels, redis_server, prefix):
    a = kernels("a")
    assert wait_until(lambda: a.index.publisher.ident, 10) is not None
    r = redis_server.client()
    assert int(r.get(f"{prefix}/idx:shards")) == S and 0 < r.pttl(f"{prefix}/idx:shards") <= 1000
    a.close()  # the whole fleet (one node) is gone: its lease, and the deployment's shard count, run out
    assert wait_until(lambda: not r.exists(f"{prefix}/idx:shards"), 10) is not None
    b = kernels("b", shards=2)
    assert wait_until(lambda: b.index.publisher.ident, 10) is not None
    assert int(r.get(f"{prefix}/idx:shards")) == 2 and b.index.stats()["publish.refused_shards"] == 0


def test_a_follower_of_another_shard_count_follows_no_one(kernels):
    a = kernels("a")
    a.index.insert_many([os.urandom(16) for _ in range(100)], Location("dram", "a", a.epoch), 1)
    assert wait_until(lambda: a.index.publisher.ident, 10) is not None
    wrong = kernels("wrong", shards=2)  # it would read two of the four shards under the wrong split
    assert wait_until(lambda: wrong.index.stats()["follow.wrong_shards"] >= 1, 10) is not None
    assert view_of(wrong.index, "a") == {} and wrong.index.peers() == {}


def test_keys_published_in_another_shard_are_not_indexed(kernels, redis_server, prefix):
    a, b = kernels("a"), kernels("b", follow=[0])
    assert wait_until(lambda: a.index.publisher.ident and "a" in b.index.peers(), 10) is not None
    stray = next(k for k in iter(lambda: os.urandom(16), None) if shard_of(k, S) == 3)
    here = next(k for k in iter(lambda: os.urandom(16), None) if shard_of(k, S) == 0)
    publish_ops(redis_server.client(), f"{prefix}/", "a", a.index.publisher.ident,
                [("S", "dram", 1, stray + here)], 1000, shard=0, shards=S)  # a writer of the shared Redis  # fmt: skip
    assert wait_until(lambda: b.index.get(here) is not None, 10) is not None
    assert b.index.get(stray) is None and b.index.stats()["follow.misplaced_keys"] >= 1


def test_an_old_identity_is_refused_in_every_shard_after_the_node_registered_again(kernels, redis_server, prefix):
    a = kernels("a")
    assert wait_until(lambda: a.index.publisher.ident, 10) is not None
    old = a.index.publisher.ident
    a.index.publisher._reset = True  # what a write of unknown outcome does: the registration starts over
    a.index.publisher.wake.set()
    assert wait_until(lambda: a.index.publisher.ident not in ("", old), 10) is not None
    r = redis_server.client()
    for s in range(S):
        with pytest.raises(redis.ResponseError) as exc:
            publish_ops(r, f"{prefix}/", "a", old, [("S", "dram", 1, os.urandom(16))], 1000, shard=s, shards=S)
        assert stale(exc.value)
