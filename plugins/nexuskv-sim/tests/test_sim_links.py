import pytest
import simpy

from nexuskv_sim.links import Link, hold
from nexuskv_sim.profile import LinkProfile

MB = 1_000_000


def _transfer(env, links, blocks, done, name):
    for _ in range(blocks):
        yield from hold(env, links, MB)
    done[name] = env.now


def test_one_transfer_takes_bytes_over_bandwidth():
    env = simpy.Environment()
    link = Link(env, "h/disk", "disk", LinkProfile(bandwidth=1e9, latency_ms=0.0))  # 1 ms per MB
    done = {}
    env.process(_transfer(env, [link], 10, done, "a"))
    env.run()
    assert done["a"] == pytest.approx(10.0)
    assert link.bytes == 10 * MB and link.busy_ms == pytest.approx(10.0)


def test_two_concurrent_transfers_share_the_link():
    env = simpy.Environment()
    link = Link(env, "h/disk", "disk", LinkProfile(bandwidth=1e9, latency_ms=0.0))
    done = {}
    env.process(_transfer(env, [link], 10, done, "a"))
    env.process(_transfer(env, [link], 10, done, "b"))
    env.run()
    alone = 10.0
    for t in done.values():
        assert 1.8 * alone <= t <= 2.0 * alone + 1e-9


def test_a_pair_of_links_goes_at_the_slower_pace_and_busies_both():
    env = simpy.Environment()
    out = Link(env, "a/nic-out", "nic", LinkProfile(bandwidth=2e9, latency_ms=0.0))
    inn = Link(env, "b/nic-in", "nic", LinkProfile(bandwidth=1e9, latency_ms=0.0))
    other = Link(env, "c/nic-in", "nic", LinkProfile(bandwidth=1e9, latency_ms=0.0))
    done = {}
    env.process(_transfer(env, [out, inn], 4, done, "ab"))
    env.process(_transfer(env, [out, other], 4, done, "ac"))  # shares a's NIC out
    env.run()
    assert done["ab"] > 4.0 and done["ac"] > 4.0  # each alone would take 4 ms at 1 GB/s
    assert out.bytes == 8 * MB and inn.bytes == 4 * MB
