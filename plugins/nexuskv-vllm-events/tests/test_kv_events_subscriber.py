"""KVEventSubscriber over real ZMQ sockets: live batches, gaps replayed or lost, restarts, forged and oversized input.

The publisher is `nexuskv_vllm_events.testing.Publisher` (vLLM's protocol, with faults injected); a real
`vllm serve` is followed in plugins/nexuskv-vllm/tests/test_vllm_serve.py.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import pytest
import zmq
from kv_events_helpers import PAGE, request, residency, resident_tokens, router, vhash
from nexuskv_vllm_events import KVEventSubscriber
from nexuskv_vllm_events.testing import Publisher, encode_batch, removed, stored

from nexuskv import ConfigError
from tests.conftest import wait_for

TOKS = [(i * 31) % 50_000 for i in range(8 * PAGE)]
HASHES = [vhash("p", i) for i in range(8)]


@pytest.fixture
def ipc():
    d = tempfile.mkdtemp(prefix="kvev", dir="/tmp")  # ipc paths must be short
    yield lambda name: f"ipc://{d}/{name}"
    shutil.rmtree(d, ignore_errors=True)


def block(i: int, salt: str = "salt-a"):
    """The BlockStored of prompt block i (the first one from the root)."""
    return stored([HASHES[i]], HASHES[i - 1] if i else None, TOKS[i * PAGE:(i + 1) * PAGE], PAGE,
                  salt=salt if i == 0 else None)  # fmt: skip


def settled(sub: KVEventSubscriber, pub: Publisher) -> bool:
    """The subscriber has caught up with everything the publisher numbered."""
    return wait_for(lambda: sub.stats()["next_seq"] == pub.seq)


def connected(sub, pub) -> None:
    """Publish no-op batches until one arrives live (ZMQ's slow joiner: the first ones after connect are lost)."""
    assert wait_for(lambda: (pub.publish([]), sub.stats()["received"] > 0)[1])
    assert settled(sub, pub)


def test_live_batches_reach_the_index_and_routes_price_them(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub:
        with KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay")) as sub:
            connected(sub, pub)
            for i in range(4):
                pub.publish([block(i)])
            assert settled(sub, pub)
            assert resident_tokens(k, request(TOKS)) == 4 * PAGE
            pub.publish([removed(HASHES[2:4])])
            assert settled(sub, pub) and resident_tokens(k, request(TOKS)) == 2 * PAGE
            s = sub.stats()
            assert (s["gaps"], s["lost"], s["malformed"], s["held"]) == (0, 0, 0, 2)
        assert resident_tokens(k, request(TOKS)) == 0  # closed: nothing keeps it current, so nothing is claimed


def test_history_before_the_subscriber_started_comes_from_the_replay_endpoint(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub:
        for i in range(3):
            pub.publish([block(i)])  # nobody listening yet
        with KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay")) as sub:
            assert sub.stats()["replayed"] == 3 and sub.stats()["next_seq"] == 3
            assert resident_tokens(k, request(TOKS)) == 3 * PAGE


@pytest.mark.parametrize("replay_topic", [True, False], ids=["vllm-0.32-frames", "older-frames"])
def test_a_gap_is_filled_from_the_replay_endpoint(ipc, replay_topic):
    with router() as k, Publisher(ipc("pub"), ipc("replay"), topic="e1") as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay"), topic="e1") as sub:
        pub.replay_topic = replay_topic
        connected(sub, pub)
        pub.publish([block(0)])
        pub.publish([block(1)], send=False)  # dropped at the PUB socket's high-water mark
        pub.publish([block(2)], send=False)
        pub.publish([block(3)])
        assert settled(sub, pub)
        s = sub.stats()
        assert s["gaps"] == 1 and s["replays"] >= 2 and s["lost"] == 0
        assert resident_tokens(k, request(TOKS)) == 4 * PAGE  # blocks 1 and 2 came from the replay


def test_a_gap_nothing_can_fill_forgets_the_engines_cache(ipc):
    """A missed BlockRemoved would leave a block claimed that is gone: what came before the gap is dropped."""
    with router() as k, Publisher(ipc("pub")) as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub")) as sub:  # no replay endpoint
        connected(sub, pub)
        for i in range(3):
            pub.publish([block(i)])
        pub.publish([removed(HASHES[1:3])], send=False)  # lost
        pub.publish([stored([vhash("other")], None, TOKS[:PAGE], PAGE, salt="salt-b")])
        assert settled(sub, pub)
        assert sub.stats()["lost"] == 1 and sub.stats()["gaps"] == 1
        assert resident_tokens(k, request(TOKS)) == 0  # not the stale 3 blocks
        assert resident_tokens(k, request(TOKS, tenant="b")) == PAGE  # what came after the gap counts


def test_a_replay_of_another_topic_is_refused_and_the_gap_is_a_loss(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay"), topic="e1") as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay"), topic="e1") as sub:
        connected(sub, pub)
        pub.publish([block(0)])
        pub.replay_topic = b"e2"  # the replay endpoint answers with another engine's stream
        pub.publish([block(1)], send=False)
        pub.publish([block(2)])
        assert settled(sub, pub)
        assert sub.stats()["replay_failures"] >= 1 and sub.stats()["lost"] == 1
        assert resident_tokens(k, request(TOKS)) == 0  # block 2's parent was forgotten with the rest


def test_a_replay_that_no_longer_reaches_back_is_a_loss_too(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay"), buffer_steps=2) as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay")) as sub:
        connected(sub, pub)
        pub.publish([block(0)])
        for _ in range(4):
            pub.publish([], send=False)
        pub.publish([block(1)])
        assert settled(sub, pub)
        assert sub.stats()["lost"] == 1 and resident_tokens(k, request(TOKS)) == 0


def test_a_restarted_engine_starts_from_an_empty_cache(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay")) as sub:
        connected(sub, pub)
        for i in range(4):
            pub.publish([block(i)])
        assert settled(sub, pub)
        pub.restart()
        pub.publish([block(0)])
        assert wait_for(lambda: sub.stats()["restarts"] == 1) and settled(sub, pub)
        assert resident_tokens(k, request(TOKS)) == PAGE


def test_a_slow_replay_endpoint_is_bounded_and_counted(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub:
        pub.replay_delay_s = 1.0
        res = residency(k)
        t0 = time.monotonic()
        with KVEventSubscriber(res, endpoint=ipc("pub"), replay_endpoint=ipc("replay"), replay_timeout_s=0.2) as sub:
            assert time.monotonic() - t0 < 5  # start gave up on the replay, did not wait for it
            assert sub.stats()["replay_failures"] == 1
            connected(sub, pub)


def test_forged_malformed_and_foreign_messages_change_nothing_they_claim(ipc):
    """Bad frames are counted; a batch that does not decode forgets the cache (what it said is unknown)."""
    with router() as k, Publisher(ipc("pub"), ipc("replay"), topic="engine-1") as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay"),
                topic="engine-1") as sub:  # fmt: skip
        connected(sub, pub)
        for i in range(2):
            pub.publish([block(i)])
        assert settled(sub, pub)
        pub.raw([b"engine-10", (pub.seq).to_bytes(8, "big"), encode_batch([block(2)])])  # a longer topic
        pub.raw([b"engine-1", b"\x00\x01"])  # two frames
        pub.raw([b"engine-1", b"\x00" * 3, b"x"])  # a bad sequence frame
        assert wait_for(lambda: sub.stats()["malformed"] == 2)
        assert sub.stats()["other_topic"] == 1 and resident_tokens(k, request(TOKS)) == 0
        for i in range(2):
            pub.publish([block(i)])
        assert settled(sub, pub) and resident_tokens(k, request(TOKS)) == 2 * PAGE
        seq = pub.seq
        pub.seq += 1
        pub.raw([b"engine-1", seq.to_bytes(8, "big"), b"\x93\xcb garbage"])  # not a batch
        assert settled(sub, pub)
        assert sub.stats()["malformed"] == 3 and resident_tokens(k, request(TOKS)) == 0


def oversized(pub: Publisher, nbytes: int, *, buffered: bytes | None = None) -> None:
    """Send batch `pub.seq` with a payload of `nbytes`; the replay buffer keeps `buffered` (default: the same).

    Buffered before it is sent, as `Publisher.publish` does: the subscriber may ask the replay for it as soon as the
    oversized message drops its connection (sent first, a loaded machine let that replay find it missing).
    """
    payload = b"\x00" * nbytes
    seq = pub.seq
    pub.buffer.append((seq, payload if buffered is None else buffered))
    pub.seq += 1
    pub.raw([pub.topic, seq.to_bytes(8, "big"), payload])


def test_a_message_over_the_bound_drops_the_connection_and_the_replay_fills_in(ipc):
    """ZMQ drops an oversized message and the connection with it (and does not reconnect): the subscriber opens
    the socket again and asks the replay endpoint what it missed."""
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay"),
                max_message_bytes=1 << 16) as sub:  # fmt: skip
        connected(sub, pub)
        pub.publish([block(0)])
        oversized(pub, 1 << 20, buffered=encode_batch([block(1)]))  # the replay has a smaller copy of it
        assert wait_for(lambda: sub.stats()["disconnects"] == 1) and settled(sub, pub)
        assert resident_tokens(k, request(TOKS)) == 2 * PAGE
        pub.publish([block(2)])
        assert wait_for(lambda: resident_tokens(k, request(TOKS)) == 3 * PAGE)
        s = sub.stats()
        assert (s["lost"], s["malformed"]) == (0, 0)


def test_a_message_over_the_bound_that_the_replay_cannot_give_either_forgets_the_cache(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay"),
                max_message_bytes=1 << 16, replay_timeout_s=0.5) as sub:  # fmt: skip
        connected(sub, pub)
        pub.publish([block(0)])
        pub.publish([block(1)])
        assert wait_for(lambda: resident_tokens(k, request(TOKS)) == 2 * PAGE)
        oversized(pub, 1 << 20)  # it might have removed both: unknown, so nothing is claimed
        assert wait_for(lambda: sub.stats()["lost"] == 1)
        assert resident_tokens(k, request(TOKS)) == 0 and sub.stats()["malformed"] == 0
        pub.buffer.clear()
        assert wait_for(lambda: (pub.publish([block(0)]), resident_tokens(k, request(TOKS)) == PAGE)[1])


def test_remote_endpoints_need_an_explicit_yes():
    with router() as k:
        res = residency(k)
        with pytest.raises(ConfigError, match="not authenticated"):
            KVEventSubscriber(res, endpoint="tcp://10.0.0.5:5557")
        with pytest.raises(ConfigError, match="not authenticated"):
            KVEventSubscriber(res, endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://*:5558")
        with pytest.raises(ConfigError, match="ipc://PATH or tcp://HOST:PORT"):
            KVEventSubscriber(res, endpoint="udp://127.0.0.1:1")
        KVEventSubscriber(res, endpoint="tcp://10.0.0.5:5557", allow_remote=True)  # the operator vouches for it


def test_a_subscriber_that_cannot_bind_says_so():
    with router() as k, Publisher("tcp://127.0.0.1:0") as pub:
        taken = pub.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        with pytest.raises(ConfigError, match="could not subscribe"):
            KVEventSubscriber(residency(k), endpoint=taken, bind=True).start()  # the address is taken


def test_an_engine_that_restarted_while_the_connection_was_down_is_caught_by_the_replay(ipc):
    """The numbering a restarted engine reached can pass the old one's: the replay proves continuity by bytes."""
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub, \
            KVEventSubscriber(residency(k), endpoint=ipc("pub"), replay_endpoint=ipc("replay"),
                              max_message_bytes=1 << 16) as sub:  # fmt: skip
        connected(sub, pub)
        for i in range(4):
            pub.publish([block(i)])
        assert settled(sub, pub) and resident_tokens(k, request(TOKS)) == 4 * PAGE
        seen = pub.seq
        pub.restart()  # the engine restarts and publishes more batches than the subscriber saw, unheard
        for _ in range(seen):
            pub.publish([], send=False)
        pub.publish([stored([vhash("new")], None, TOKS[:PAGE], PAGE, salt="salt-b")], send=False)
        oversized(pub, 1 << 20, buffered=encode_batch([]))  # the connection drops: the subscriber reopens it
        assert wait_for(lambda: sub.stats()["disconnects"] == 1) and settled(sub, pub)
        assert sub.stats()["lost"] == 1  # the replay did not continue the batches it had applied
        assert resident_tokens(k, request(TOKS)) == 0  # not the old engine's blocks
        assert resident_tokens(k, request(TOKS, tenant="b")) == PAGE  # the new engine's, from its whole buffer


def test_a_batch_the_residency_fails_on_forgets_the_cache_and_the_subscriber_goes_on(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub:
        res = residency(k)
        real = res.apply
        calls = {"n": 0}

        def flaky(batch):  # a fault: the third batch fails inside the residency
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected")
            real(batch)

        res.apply = flaky
        with KVEventSubscriber(res, endpoint=ipc("pub"), replay_endpoint=ipc("replay")) as sub:
            connected(sub, pub)
            for i in range(4):
                pub.publish([block(i)])
            assert settled(sub, pub)
            s = sub.stats()
            assert s["alive"] and s["malformed"] == 1
            pub.publish([block(0)])
            assert settled(sub, pub) and resident_tokens(k, request(TOKS)) == PAGE


def test_nothing_is_claimed_once_close_returns_even_mid_replay(ipc):
    with router() as k, Publisher(ipc("pub"), ipc("replay")) as pub:
        for i in range(8):
            pub.publish([block(i % 4)])
        pub.replay_delay_s = 0.5
        res = residency(k)
        with pytest.raises(ConfigError):  # start gives up before the slow replay answers
            KVEventSubscriber(res, endpoint=ipc("pub"), replay_endpoint=ipc("replay"),
                              replay_timeout_s=5).start(timeout=0.1)  # fmt: skip
        time.sleep(1.0)  # the replay answers after close returned: what it brings is not applied
        assert resident_tokens(k, request(TOKS)) == 0 and res.stats()["held"] == 0


def test_a_bound_subscriber_survives_publishers_that_come_and_go():
    """Bind mode: a publisher (an engine restarting, or any local process) connecting and leaving never stops it."""
    with router() as k:
        for _ in range(5):  # a free port, found by a probe; the probe's close is asynchronous, so it may linger
            probe = zmq.Context.instance().socket(zmq.SUB)
            probe.bind("tcp://127.0.0.1:0")
            endpoint = probe.getsockopt_string(zmq.LAST_ENDPOINT)
            probe.close(0)
            sub = KVEventSubscriber(residency(k), endpoint=endpoint, bind=True)
            try:
                sub.start()
                break
            except ConfigError as exc:
                if "Address already in use" not in str(exc):
                    raise
        else:
            pytest.fail("no free port could be bound in five tries")
        try:
            for round_ in range(3):
                pub = zmq.Context.instance().socket(zmq.PUB)
                pub.setsockopt(zmq.LINGER, 0)
                pub.connect(endpoint)
                assert wait_for(lambda p=pub, r=round_: (p.send_multipart([b"", (0).to_bytes(8, "big"),
                                                                           encode_batch([])]),
                                                         sub.stats()["received"] > r)[1])  # fmt: skip
                pub.close(0)
                assert wait_for(lambda r=round_: sub.stats()["disconnects"] > r)
            assert sub.stats()["alive"]
        finally:
            sub.close()
