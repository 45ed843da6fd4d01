"""Sealed P/D handoffs: a producer's grant lets a consumer plan, fetch and verify the producer's state, and
nothing else: changed, forged, expired, replayed for another tenant or prompt, oversized or malformed grants are
refused with the reason; accepted grants are bounded and forgotten when they expire."""

from __future__ import annotations

import random
import threading
from typing import ClassVar

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nexuskv import DictIndex, HandoffResult, Kernel, KernelConfig, Location, PlanAction
from nexuskv.storage.handoff import Handoffs
from tests.conftest import SECRET, make_request, run_threads, with_transport


class Peers:
    """A remote transport between kernels of this process: `serve` registers a node, `fetch_remote` reads its tier."""

    name, remote = "tcp", True
    registry: ClassVar[dict[str, dict]] = {}

    def __init__(self, node: str) -> None:
        self.node = node
        self.fetches = 0
        self.fault = ""

    def authenticate(self, key):
        self.key = key

    def serve(self, tiers):
        Peers.registry[f"inproc:{self.node}"] = tiers
        return f"inproc:{self.node}"

    def fetch(self, store, slot):
        return store.get(slot)

    def fetch_remote(self, address, tier, slots, timeout_s=None, *, namespace):
        self.fetches += 1
        if self.fault == "down":
            raise ConnectionError(f"{address}: connection refused")
        tiers = Peers.registry[address]
        got = [tiers[tier].get(s) for s in slots]
        got = [g if g is None or g.descriptor.namespace == namespace else None for g in got]
        if self.fault == "corrupt" and got and got[-1] is not None:
            got[-1] = attrs.evolve(got[-1], payload=b"x" + bytes(got[-1].payload)[1:])
        return got

    def close(self):
        pass


def kernel(node: str, **cfg) -> tuple[Kernel, Peers]:
    mover = Peers(node)
    pm = with_transport(mover)
    tiers = {"dram": {"store": "dram", "capacity_bytes": "64MiB"}}
    k = Kernel(KernelConfig(node=node, deadline_ms=60_000.0, tiers=tiers, transports=("local", "tcp"), **cfg),
               plugins=pm, secret=SECRET)  # fmt: skip
    return k, mover


@pytest.fixture
def pd():
    """(producer n-p holding a 8-block prompt, consumer n-d, the request, its keys, the payloads)."""
    p, _ = kernel("n-p")
    d, mover = kernel("n-d")
    req = make_request(range(16 * 8))
    keys = p.keys(req)
    payloads = [random.Random(i).randbytes(512) for i in range(len(keys))]
    p.commit(req, payloads, keys=keys)
    assert p.flush(10)
    yield p, d, mover, req, keys, payloads
    p.close()
    d.close()


def test_a_grant_lets_the_consumer_plan_fetch_and_verify_the_producers_state(pd):
    p, d, mover, req, keys, payloads = pd
    grant = p.handoff(req)
    assert grant is not None and grant["node"] == "n-p" and grant["runs"] == [[8, "dram", 1]]
    assert not any(k.hex() in repr(grant) for k in keys)  # no key leaves the producer
    assert d.plan(req).action == PlanAction.RECOMPUTE  # before the grant, the consumer knows nothing
    assert d.accept_handoff(req, grant) == HandoffResult(8, "n-p", "")
    plan = d.plan(req)
    assert plan.action == PlanAction.MATERIALIZE and [(s.node, s.tier) for s in plan.spans] == [("n-p", "dram")]
    got = d.materialize(plan, req)
    assert got.complete and [bytes(got.states[(b, 0)].payload) for b in range(8)] == payloads
    assert mover.fetches == 1 and d.links.snapshot()["peer:n-p"]["samples"] == 1


def test_a_grant_covers_only_what_the_producer_holds_and_at_most_blocks(pd):
    p, _d, _, req, _keys, _ = pd
    assert p.handoff(req, blocks=3)["runs"] == [[3, "dram", 1]]
    longer = make_request(range(16 * 12))
    assert p.handoff(longer)["runs"] == [[8, "dram", 1]]  # the prompt's next blocks are nowhere
    assert p.handoff(make_request(range(1000, 1000 + 16 * 4))) is None


def refused(d, req, grant, fragment: str | tuple[str, ...]):
    got = d.accept_handoff(req, grant)
    fragments = fragment if isinstance(fragment, tuple) else (fragment,)
    assert not got.ok and got.blocks == 0 and any(f in got.reason for f in fragments), got
    assert d.plan(req).action == PlanAction.RECOMPUTE


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda g: g.update(address="inproc:attacker"), "MAC does not check"),
    (lambda g: g.update(epoch=g["epoch"] + 1), "MAC does not check"),
    (lambda g: g.update(runs=[[7, "disk", 1]]), "MAC does not check"),
    (lambda g: g.update(expires=g["expires"] + 1), "MAC does not check"),
    (lambda g: g.update(mac="0" * 32), "MAC does not check"),
    (lambda g: g.update(node="n-d"), "this very node"),
    (lambda g: g.update(transport="shm"), "peer transport"),
    (lambda g: g.update(runs=[[9, "dram", 1]]), "within the request's 7"),
    (lambda g: g.update(runs=[[4, "gpu", 1]]), "cannot be fetched from a peer"),
    (lambda g: g.update(runs=[[4, "dram", 3]]), "group mask"),
    (lambda g: g.update(runs=[[4, "dram", 1], [4, "dram", 1]]), "not after 4"),
    (lambda g: g.update(runs=[]), "runs are not"),
    (lambda g: g.update(extra=1), "exactly the fields"),
    (lambda g: g.update(v=2), "grant version"),
    (lambda g: g.update(expires=float("nan")), "not a time"),
    (lambda g: g.update(expires=g["expires"] + 3600), "further ahead"),
    (lambda g: g.update(epoch=True), "epoch"),
    (lambda g: g.update(node="x" * 300), "not a name"),
    (lambda g: g.update(runs=[[1, "dram", 1]] * 2000), "over 4096 bytes"),
    (lambda g: g.update(mac="\u00e9" * 32), "MAC does not check"),  # compare_digest raises on non-ASCII
    (lambda g: g.update(mac=g["mac"].upper()), "MAC does not check"),
    (lambda g: g.update(expires=10**400), "not a time"),  # math.isfinite raises OverflowError
    (lambda g: g.update(expires=-(10**400)), "not a time"),
    (lambda g: g.update(runs=__import__("functools").reduce(lambda a, _: [a], range(5000), [])),
     ("malformed", "over 4096 bytes")),  # repr's recursion: too deep on 3.11 and 3.12, too long on 3.13
])  # fmt: skip
def test_a_changed_or_malformed_grant_is_refused_with_the_reason(pd, change, fragment):
    p, d, _, req, _, _ = pd
    grant = p.handoff(req, blocks=7)
    req7 = make_request(range(16 * 8 - 1))  # the consumer plans the blocks before the last token: 7 here
    change(grant)
    refused(d, req7, grant, fragment)


@pytest.mark.parametrize("other", [
    dict(tenant="globex"), dict(cache_salt="s2"), dict(scope="team"),
    dict(model=__import__("nexuskv").ModelIdentity(name="tiny", revision="2")),
])  # fmt: skip
def test_a_grant_replayed_for_another_tenant_salt_scope_or_model_is_refused(pd, other):
    p, d, _, req, _, _ = pd
    grant = p.handoff(req)
    refused(d, make_request(range(16 * 8), **other), grant, "MAC does not check")


def test_a_grant_for_another_prompt_is_refused(pd):
    p, d, _, req, _, _ = pd
    grant = p.handoff(req)
    refused(d, make_request([*range(16 * 8 - 1), 99_999]), grant, "MAC does not check")


def test_a_grant_of_another_deployment_is_refused(pd):
    p, d, _, req, _, _ = pd
    other = Handoffs(b"another deployment's secret", "n-p", DictIndex(), lambda: 1, lambda: {"tcp": "inproc:n-p"},
                     "tcp")  # fmt: skip
    for key in p.keys(req):
        other.index.insert(key, Location("dram", "n-p", 1), 1)
    refused(d, req, other.issue(req, p.keys(req)), "MAC does not check")


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=8)))
def test_any_json_as_a_grant_is_refused_never_raises(junk):
    h = Handoffs(SECRET, "n-d", DictIndex(), lambda: 1, lambda: {}, "tcp")
    req = make_request(range(64))
    got = h.accept(req, junk, [bytes([i]) * 16 for i in range(3)])
    assert not got.ok and got.reason


def test_an_expired_grant_is_refused_and_an_accepted_one_is_forgotten_when_it_expires(pd):
    p, _d, _, req, keys, _ = pd
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    prod = Handoffs(SECRET, "n-p", p.index, lambda: p.epoch, lambda: {"tcp": "inproc:n-p"}, "tcp", ttl_s=5, clock=clock)
    cons = Handoffs(SECRET, "n-d", DictIndex(), lambda: 1, lambda: {}, "tcp", ttl_s=5, clock=clock)
    grant = prod.issue(req, keys)
    assert cons.accept(req, grant, keys).blocks == 8 and cons.address("n-p", "tcp") == "inproc:n-p"
    assert cons.index.get(keys[0]).mask_at("dram", "n-p") == 1
    now[0] += 5
    assert cons.address("n-p", "tcp") is None and cons.live() == 0
    assert cons.index.get(keys[0]) is None  # its entries went with it
    assert "expired" in cons.accept(req, grant, keys).reason


def test_accepted_grants_are_bounded_oldest_first_and_shared_blocks_stay(pd):
    p, _, _, req, keys, _ = pd
    prod = Handoffs(SECRET, "n-p", p.index, lambda: p.epoch, lambda: {"tcp": "inproc:n-p"}, "tcp")
    cons = Handoffs(SECRET, "n-d", DictIndex(), lambda: 1, lambda: {}, "tcp", max_grants=2)
    first = prod.issue(req, keys, blocks=2)
    assert cons.accept(req, first, keys).ok
    assert cons.accept(req, prod.issue(req, keys, blocks=8), keys).ok
    assert cons.accept(req, prod.issue(req, keys, blocks=4), keys).ok  # the first one is dropped
    assert cons.live() == 2
    assert all(cons.index.get(k) is not None for k in keys)  # blocks 0-1 are still vouched for by the others


def test_a_dead_producer_or_a_corrupt_payload_means_recompute(pd):
    p, d, mover, req, _keys, payloads = pd
    assert d.accept_handoff(req, p.handoff(req)).ok
    mover.fault = "down"
    got = d.materialize(d.plan(req), req)
    assert got.blocks == 0 and "connection refused" in got.reason
    mover.fault = "corrupt"
    got = d.materialize(d.plan(req), req)
    assert got.blocks == 7 and [bytes(got.states[(b, 0)].payload) for b in range(7)] == payloads[:7]
    assert "corrupt" in got.reason


def test_a_node_without_a_peer_transport_issues_and_accepts_nothing(pd):
    p, _, _, req, _keys, _ = pd
    alone = Kernel(KernelConfig(node="solo"), secret=SECRET)
    with alone:
        assert alone.handoff(req) is None
        assert "peer transport" in alone.accept_handoff(req, p.handoff(req)).reason


def test_concurrent_accepts_and_expiries_match_a_reference():
    """Many threads accept grants of many prompts while the clock moves: what is live is exactly the unexpired."""
    now = [0.0]
    lock = threading.Lock()
    index = DictIndex()
    prod = Handoffs(SECRET, "n-p", index, lambda: 1, lambda: {"tcp": "a"}, "tcp", ttl_s=10, clock=lambda: now[0])
    cons = Handoffs(SECRET, "n-d", DictIndex(), lambda: 1, lambda: {}, "tcp", ttl_s=10, clock=lambda: now[0],
                    max_grants=10_000)  # fmt: skip
    reqs = [make_request(range(i * 1000, i * 1000 + 64), request_id=f"r{i}") for i in range(40)]
    keyed = []
    for i, r in enumerate(reqs):
        ks = [bytes([i, b]) * 8 for b in range(4)]
        for k in ks:
            index.insert(k, Location("dram", "n-p", 1), 1)
        keyed.append((r, ks))
    issued: dict[int, float] = {}

    def worker(t: int) -> None:
        for i in range(t, len(keyed), 4):
            with lock:
                now[0] += 0.5
                grant = prod.issue(*keyed[i])
                issued[i] = grant["expires"]
            assert cons.accept(keyed[i][0], grant, keyed[i][1]).ok

    run_threads(worker, 4)
    live = {i for i, exp in issued.items() if exp > now[0]}
    assert cons.live() == len(live)
    for i, (_, ks) in enumerate(keyed):
        assert (cons.index.get(ks[0]) is not None) == (i in live)


def test_an_expiring_grant_never_removes_entries_it_did_not_add(pd):
    """A block the index knew before the grant (a cluster index's entry, the same location) outlives the grant."""
    p, _, _, req, keys, _ = pd
    now = [1000.0]
    index = DictIndex()
    loc = Location("dram", "n-p", p.epoch)
    index.insert(keys[0], loc, 1)  # learnt elsewhere, before any grant
    prod = Handoffs(SECRET, "n-p", p.index, lambda: p.epoch, lambda: {"tcp": "inproc:n-p"}, "tcp", ttl_s=5,
                    clock=lambda: now[0])  # fmt: skip
    cons = Handoffs(SECRET, "n-d", index, lambda: 1, lambda: {}, "tcp", ttl_s=5, clock=lambda: now[0])
    assert cons.accept(req, prod.issue(req, keys), keys).blocks == 8
    assert cons.accept(req, prod.issue(req, keys, blocks=3), keys).blocks == 3  # vouches for 0-2 again
    now[0] += 10
    assert cons.live() == 0
    assert index.get(keys[0]).at(loc) == 1 and all(index.get(k) is None for k in keys[1:])


def test_many_grants_touch_only_their_own_blocks():
    """4,200 grants of 16 blocks from one producer (4,096 kept), then all expire: each index entry is written once
    and removed once (the bookkeeping is per block, never a scan of every live grant)."""
    now = [0.0]
    pidx, cidx = DictIndex(), DictIndex()
    prod = Handoffs(SECRET, "n-p", pidx, lambda: 1, lambda: {"tcp": "a"}, "tcp", ttl_s=10, clock=lambda: now[0])
    cons = Handoffs(SECRET, "n-d", cidx, lambda: 1, lambda: {}, "tcp", ttl_s=10, clock=lambda: now[0])
    reqs = []
    for i in range(4200):
        req = make_request(range(64), request_id=f"r{i}", cache_salt=f"s{i}")
        ks = [i.to_bytes(4, "big") + bytes([b]) * 12 for b in range(16)]
        for k in ks:
            pidx.insert(k, Location("dram", "n-p", 1), 1)
        reqs.append((req, ks))
    ops = {"insert": 0, "remove": 0}
    real_insert, real_remove = cidx.insert, cidx.remove

    def insert(*a, **k):
        ops["insert"] += 1
        return real_insert(*a, **k)

    def remove(*a, **k):
        ops["remove"] += 1
        return real_remove(*a, **k)

    cidx.insert, cidx.remove = insert, remove
    for req, ks in reqs:
        assert cons.accept(req, prod.issue(req, ks), ks).ok
    assert cons.live() == 4096 and sum(cidx.holdings().values()) == 4096 * 16
    assert ops == {"insert": 4200 * 16, "remove": 104 * 16}  # the oldest 104 dropped at the bound
    now[0] += 11
    assert cons.live() == 0 and sum(cidx.holdings().values()) == 0
    assert ops == {"insert": 4200 * 16, "remove": 4200 * 16}


def test_a_replayed_older_grant_does_not_redirect_fetches_to_its_address(pd):
    """A tenant keeps a grant from before the producer restarted on another port and replays it after a fresh one:
    the directory keeps the address of the grant that expires last."""
    p, _, _, req, keys, _ = pd
    now = [1000.0]
    where = {"tcp": "10.0.0.5:40001"}
    prod = Handoffs(SECRET, "n-p", p.index, lambda: 1, lambda: where, "tcp", ttl_s=60, clock=lambda: now[0])
    cons = Handoffs(SECRET, "n-d", DictIndex(), lambda: 1, lambda: {}, "tcp", ttl_s=60, clock=lambda: now[0])
    old = prod.issue(req, keys)
    now[0] += 20
    where["tcp"] = "10.0.0.5:40777"  # restarted on a new port (the embedded plane's epoch is 1 again)
    assert cons.accept(req, prod.issue(req, keys), keys).ok
    assert cons.accept(req, old, keys).ok  # still unexpired, MAC good: accepted, but not the address to use
    assert cons.address("n-p", "tcp") == "10.0.0.5:40777"


def test_a_router_grants_what_a_third_node_holds_under_that_nodes_live_epoch_and_address():
    """A router's index follows the fleet: it grants the node it routed to the holder's prefix, never more."""
    published = {("n-p", "tcp"): ("10.0.0.7:7000", 7)}  # the control plane's view: address and live epoch
    fleet = DictIndex()
    router = Handoffs(SECRET, "n-r", fleet, lambda: 1, lambda: {"tcp": "10.0.0.1:7000"}, "tcp",
                      peer=lambda node, transport: published.get((node, transport)))  # fmt: skip
    consumer = Handoffs(SECRET, "n-d", DictIndex(), lambda: 1, lambda: {}, "tcp")
    req = make_request(range(16 * 8))
    keys = [bytes([9, b]) * 8 for b in range(8)]
    fleet.insert(keys[0], Location("dram", "n-p", 6), 1)  # block 0 of the holder's older registration, listed first
    for b in range(5):
        fleet.insert(keys[b], Location("dram", "n-p", 7), 1)
    fleet.insert(keys[5], Location("dram", "n-p", 6), 1)  # only the older registration holds block 5
    for b in range(5, 8):
        fleet.insert(keys[b], Location("dram", "n-q", 3), 1)
    assert fleet.get(keys[0]).locations[0][0].epoch == 6  # the older entry comes first: the grant must skip it
    grant = router.issue(req, keys, holder="n-p")
    assert grant is not None and (grant["node"], grant["epoch"], grant["address"]) == ("n-p", 7, "10.0.0.7:7000")
    assert grant["runs"] == [[5, "dram", 1]]  # the live epoch's entries only
    published[("n-q", "tcp")] = ("10.0.0.8:7000", 3)
    assert router.issue(req, keys, holder="n-q") is None  # n-q is known but holds no prefix from block 0
    published[("n-x", "tcp")] = ("10.0.0.9:7000", 1)
    assert router.issue(req, keys, holder="n-x") is None  # n-x is known and holds nothing
    published[("n-p", "tcp")] = ("10.0.0.7:7000", 8)
    assert router.issue(req, keys, holder="n-p") is None  # n-p registered again: the entries of 7 are not granted
    published[("n-p", "tcp")] = ("10.0.0.7:7000", 7)
    got = consumer.accept(req, grant, keys)
    assert got == HandoffResult(5, "n-p", "") and consumer.index.get(keys[4]).at(Location("dram", "n-p", 7)) == 1
    assert consumer.address("n-p", "tcp") == "10.0.0.7:7000"
    del published[("n-p", "tcp")]
    assert router.issue(req, keys, holder="n-p") is None  # unknown to the control plane: nothing to fetch from
    no_view = Handoffs(SECRET, "n-r", fleet, lambda: 1, lambda: {"tcp": "x"}, "tcp")
    assert no_view.issue(req, keys, holder="n-p") is None  # a node that cannot learn peers grants none
