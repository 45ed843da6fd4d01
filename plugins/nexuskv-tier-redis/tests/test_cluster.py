"""Three node processes on loopback with etcd and Redis: remote reuse, and what each failure does.

Every node is a real process (a kernel on the etcd control plane, the Redis cluster index, the TCP transport);
faults are real signals to real processes. No test measures wall-clock time against a threshold: each waits for
an outcome with a generous limit, and the benchmark (`bench/cluster.py`) measures how fast.
"""

from __future__ import annotations

import os
import time

import pytest
import redis

from nexuskv_tier_redis._index_sync import publish_ops, stale

pytest.importorskip("nexuskv_etcd")
pytest.importorskip("nexuskv_transport_tcp")

from nexuskv_tier_redis.cluster_testing import Cluster

TTL = 1.0
PREFIX = "nexuskv/"


def tokens(seed: int, n: int = 640) -> list[int]:
    """A prompt of `n` tokens (40 blocks of 16), different per seed."""
    return [(seed * 7919 + i * 31) % 1990 + 3 for i in range(n)]


def peers_in(plan: dict) -> set[str]:
    """Nodes a plan loads from over the network."""
    return {node for _, node, transport in plan["spans"] if transport == "tcp"}


@pytest.fixture
def cluster():
    with Cluster(("a", "b", "c"), lease_ttl_s=TTL) as c:
        yield c


def warm(cluster: Cluster, node: str, prompt: list[int]) -> None:
    """Serve `prompt` on `node` and wait until its state is stored and published."""
    cluster.call(node, "serve", tokens=prompt)
    assert cluster.call(node, "flush")


def until_planned_from(cluster: Cluster, node: str, prompt: list[int], peer: str, timeout_s: float = 10.0) -> dict:
    """Wait until `node` plans `prompt` from `peer`; return that plan."""
    found: dict = {}

    def check() -> bool:
        found.update(cluster.call(node, "plan", tokens=prompt))
        return peer in peers_in(found)

    assert cluster.wait_until(check, timeout_s) is not None, f"{node} never planned from {peer}: {found}"
    return found


def test_a_request_reuses_state_another_node_holds(cluster):
    prompt = tokens(1)
    warm(cluster, "a", prompt)
    plan = until_planned_from(cluster, "b", prompt, "a")
    assert plan["action"] == "materialize"
    out = cluster.call("b", "serve", tokens=prompt)
    assert out["reused"] >= plan["reused"] > 0
    assert {n for _, n, t in out["spans"] if t == "tcp"} == {"a"}
    assert not out["fallback"]
    stats = cluster.call("b", "stats")
    assert stats["peers"].keys() == {"a", "c"}
    assert "peer:a" in stats["links"]  # the load measured the link to a


def test_a_killed_node_vanishes_from_every_plan_and_no_request_fails(cluster):
    prompt = tokens(2)
    warm(cluster, "c", prompt)
    until_planned_from(cluster, "a", prompt, "c")
    until_planned_from(cluster, "b", prompt, "c")
    cluster.kill("c")
    for node in ("a", "b"):  # requests keep being served while c's lease runs out: fallbacks, never failures
        assert cluster.wait_until(lambda n=node: "c" not in peers_in(cluster.call(n, "plan", tokens=prompt)),
                                  timeout_s=TTL + 10) is not None  # fmt: skip
        out = cluster.call(node, "serve", tokens=prompt)
        assert out["total"] == len(prompt)
    r = cluster.redis.client()
    assert cluster.wait_until(lambda: not r.exists(f"{PREFIX}idx:held:c"), TTL + 5) is not None
    assert all(not k.endswith("@c") for k in cluster.call("a", "stats")["blocks"])


def test_a_node_frozen_past_its_lease_has_its_old_epoch_refused(cluster):
    prompt = tokens(3)
    warm(cluster, "b", prompt)
    before = cluster.call("b", "stats")
    old_ident = before["ident"]
    assert old_ident.startswith(f"{before['epoch']}:")
    r = cluster.redis.client()
    key = os.urandom(16)
    publish_ops(r, PREFIX, "b", old_ident, [("S", "dram", 1, key)], 5000)  # accepted while b's lease lives
    cluster.pause("b")
    assert cluster.wait_until(lambda: not r.exists(f"{PREFIX}idx:alive:b"), TTL + 5) is not None
    with pytest.raises(redis.ResponseError) as refused:  # the server compares: the old identity writes nothing
        publish_ops(r, PREFIX, "b", old_ident, [("S", "dram", 1, key)], 5000)
    assert stale(refused.value)
    cluster.resume("b")
    assert cluster.wait_until(lambda: cluster.call("b", "stats")["epoch"] > before["epoch"], TTL + 10) is not None
    assert cluster.wait_until(lambda: cluster.call("b", "stats")["ident"] not in ("", old_ident), TTL + 10)
    with pytest.raises(redis.ResponseError) as again:  # and never again, now that b has a new epoch
        publish_ops(r, PREFIX, "b", old_ident, [("S", "dram", 1, key)], 5000)
    assert stale(again.value)
    plan = until_planned_from(cluster, "a", prompt, "b")  # b's state is back, under its new epoch
    assert plan["reused"] > 0
    new_epoch = cluster.call("b", "stats")["epoch"]
    assert r.get(f"{PREFIX}idx:fence:b") == str(new_epoch).encode()


def test_etcd_down_means_recompute_then_new_epochs(cluster):
    prompt = tokens(4)
    warm(cluster, "a", prompt)
    until_planned_from(cluster, "b", prompt, "a")
    epochs = {n: cluster.call(n, "stats")["epoch"] for n in ("a", "b", "c")}
    cluster.etcd.kill()
    assert cluster.wait_until(lambda: not cluster.call("b", "stats")["ok"], TTL + 10) is not None
    other = tokens(8)
    out = cluster.call("b", "serve", tokens=other)  # served, by recomputing: in doubt, never wait
    assert out["action"] == "recompute" and out["reused"] == 0
    assert any("control plane unavailable" in r for r in out["reasons"])
    time.sleep(TTL * 2)  # down for longer than a lease: no node may trust its old epoch afterwards
    cluster.etcd.restart()
    for n in ("a", "b", "c"):
        assert cluster.wait_until(lambda n=n: cluster.call(n, "stats")["epoch"] > epochs[n], TTL + 20) is not None
    until_planned_from(cluster, "b", prompt, "a", timeout_s=20)


def test_redis_killed_and_restarted_the_index_resyncs(cluster):
    prompt_a, prompt_c = tokens(5), tokens(6)
    warm(cluster, "a", prompt_a)
    warm(cluster, "c", prompt_c)
    until_planned_from(cluster, "b", prompt_a, "a")
    cluster.redis.kill()  # it saves nothing: everything in it is lost
    other = tokens(7)
    out = cluster.call("b", "serve", tokens=other)  # served while Redis is away
    assert out["total"] == len(other)
    cluster.redis.restart()
    r = cluster.redis.client()
    # Every node registers again and republishes what it holds; b follows the new registrations.
    assert cluster.wait_until(lambda: r.hlen(f"{PREFIX}idx:held:a") and r.hlen(f"{PREFIX}idx:held:c"), 20)
    for peer in ("a", "c"):
        assert cluster.wait_until(lambda p=peer: cluster.call("b", "stats")["peers"].get(p)
                                  == cluster.call(p, "stats")["ident"] != "", 20) is not None  # fmt: skip
    until_planned_from(cluster, "b", prompt_a, "a", timeout_s=20)
    until_planned_from(cluster, "b", prompt_c, "c", timeout_s=20)
    assert cluster.call("b", "stats")["index"]["follow.resyncs"] >= 4  # a and c, before and after


def test_a_shaped_link_flips_the_decision_to_recompute_and_back():
    """The reference engine; `far` behind a veth shaped with tc tbf; `near` decides by what it measures."""
    from nexuskv_tier_redis.cluster_testing import NetNS, shaped_link_flip

    why = NetNS.available()
    if why:
        pytest.skip(why)
    pytest.importorskip("nexuskv_transformers")
    result = shaped_link_flip(tokens=tokens(9, 1024)[:1024], suffix=lambda i: tokens(100 + i, 32), timeout_s=60)
    assert result["flip"] == 1, result["phases"]
    assert result["phases"]["fast"][-1] == "load"
    assert "recompute" in result["phases"]["slowed"]
    assert result["phases"]["recovered"][-1] == "load"
    assert result["links"]["peer:far"]["samples"] >= 3


def test_a_router_grants_the_chosen_node_a_third_nodes_state_and_that_node_follows_no_one():
    """The fleet design: nodes hold their own, a router holds the fleet (sharded streams) and grants what it routes."""
    with Cluster((), lease_ttl_s=TTL) as c:
        c.start_node("a", matcher={"shards": 4, "follow": "none"})
        c.start_node("b", matcher={"shards": 4, "follow": "none"})  # nodes hold only their own, follow no peer
        c.start_node("r", matcher={"shards": 4})  # the router: follows every shard of every node
        prompt = tokens(11)
        warm(c, "a", prompt)
        assert c.call("b", "plan", tokens=prompt)["action"] == "recompute"  # b knows nothing of a's state
        assert c.wait_until(lambda: c.call("r", "stats")["blocks"].get("dram@a", 0) >= 40, 10) is not None
        assert c.call("a", "stats")["blocks"] == {"dram@a": 40}  # a holds no entry of any peer

        got = c.call("r", "route", tokens=prompt, loads={"a": 200_000, "b": 0})  # a is busy: b should run it
        assert got["node"] == "b" and got["spans"][0][3] == "a", got
        grant = got["grant"]
        assert grant is not None and grant["node"] == "a" and grant["runs"][-1][0] == 40

        forged = {**grant, "epoch": grant["epoch"] + 1}  # a grant changed on its way is refused
        assert "MAC does not check" in c.call("b", "accept", tokens=prompt, grant=forged)["reason"]
        other = c.call("b", "accept", tokens=tokens(12), grant=grant)  # the grant is for this prompt only
        assert other["blocks"] == 0 and "MAC does not check" in other["reason"]

        assert c.call("b", "accept", tokens=prompt, grant=grant) == {"blocks": 40, "node": "a", "reason": ""}
        served = c.call("b", "serve", tokens=prompt)
        assert served["action"] == "materialize" and peers_in(served) == {"a"} and served["reused"] == 640, served
