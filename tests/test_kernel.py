import attrs
import pytest

from nexuskv import ChecksumError, ConfigError, Kernel, KernelConfig, Location
from tests.conftest import SECRET, layout_of, make_request


def commit_all(kernel, req, size=100, group=0):
    keys = kernel.keys(req)
    for b in range(len(keys)):
        payload = bytes([b % 256]) * size
        assert kernel.put(kernel.describe(req, b, payload, tier="dram", group=group, keys=keys), payload)
    return keys


def test_put_match_load_roundtrip(kernel):
    req = make_request(range(100))
    keys = commit_all(kernel, req)
    m = kernel.match(req)
    assert m.longest() == 6 and m.tokens() == 96 and m.by_node() == {"n1": 6}
    got = kernel.load(keys[2])
    assert bytes(got.payload) == bytes([2]) * 100
    assert got.descriptor.span.start == 32 and got.descriptor.parent_key == keys[1].hex()
    assert got.descriptor.placement == attrs.evolve(got.descriptor.placement, tier="dram", node="n1")


def test_other_tenant_sees_nothing(kernel):
    commit_all(kernel, make_request(range(64)))
    assert kernel.match(make_request(range(64), tenant="globex")).longest() == 0


def test_eviction_keeps_index_exact():
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "dram", "capacity_bytes": 1000}})
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(16 * 30))
        commit_all(k, req, size=100)
        store = k.tiers["dram"]
        assert len(k.index) == len(store) == 10
        held = {slot[:-1] for slot in store.slots()}
        assert held == set(k.index.keys_at(Location("dram", "n1", k.epoch)))
        assert k.match(req).longest() == 0  # the oldest (first) blocks went first: no prefix survives


def test_corrupt_payload_is_quarantined_never_returned(kernel):
    req = make_request(range(64))
    keys = commit_all(kernel, req)
    store = kernel.tiers["dram"]
    slot = keys[1] + b"\x00"
    good = store.get(slot)
    store.put(slot, b"\xff" * 100, good.descriptor)  # bit rot behind the kernel's back
    assert kernel.load(keys[1]) is None
    assert slot not in store
    assert kernel.index.get(keys[1]) is None
    assert kernel.match(req).longest() == 1


def test_put_refuses_payload_that_does_not_match_its_checksum(kernel):
    req = make_request(range(32))
    desc = kernel.describe(req, 0, b"abc", tier="dram")
    with pytest.raises(ChecksumError):
        kernel.put(desc, b"abd")
    assert len(kernel.index) == 0


def test_put_to_unknown_tier(kernel):
    req = make_request(range(32))
    desc = kernel.describe(req, 0, b"abc", tier="ssd")
    with pytest.raises(ConfigError, match="no tier named 'ssd'"):
        kernel.put(desc, b"abc")


def test_describe_checkpoint_spans_and_bounds(kernel):
    req = make_request(range(64), layout=layout_of("dense", "recurrent"))
    d = kernel.describe(req, 2, b"x", tier="dram", group=1)
    assert (d.span.start, d.span.end, d.group) == (0, 48, 1)
    with pytest.raises(IndexError):
        kernel.describe(req, 4, b"x", tier="dram")
    with pytest.raises(IndexError):
        kernel.describe(req, 0, b"x", tier="dram", group=2)


def test_hybrid_groups_are_separate_slots(kernel):
    req = make_request(range(64), layout=layout_of("dense", "recurrent"))
    keys = commit_all(kernel, req)
    assert kernel.match(req).longest() == 0  # pages only: no recurrent checkpoint yet
    p = b"state"
    kernel.put(kernel.describe(req, 2, p, tier="dram", group=1, keys=keys), p)
    assert kernel.match(req).longest() == 3
    assert bytes(kernel.load(keys[2], group=1).payload) == p


def test_session_chain_matches_request_keys(kernel):
    req = make_request(range(50))
    chain = kernel.session(req)
    assert chain.keys == kernel.keys(req)
    chain.extend(range(50, 70))
    assert chain.keys == kernel.keys(make_request(range(70)))


def test_from_config_toml(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text('node = "edge-1"\npage_size = 32\nsecret = "' + "ab" * 16 + '"\n'
                 '[tiers.hot]\nstore = "dram"\ncapacity_bytes = "2MiB"\n')
    with Kernel.from_config(p) as k:
        assert k.node == "edge-1" and k.keyer.page_size == 32
        assert k.tiers["hot"].capacity_bytes == 2 << 20 and k.tiers["hot"].name == "hot"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("node = 'a'\nbogus = 1\n", "bogus"),
        ("page_size = 'big'\n", "page_size"),
        ("node = \n", "k.toml"),
        ("[tiers.hot]\nstore = 'nvme'\n", "no tier store plugin named 'nvme'"),
        ("[tiers.hot]\nstore = 'dram'\ncapacity_bytes = 'lots'\n", "tiers.hot.capacity_bytes"),
        ("[tiers.hot]\nstore = 'dram'\nspeed = 3\n", "tiers.hot"),
        ("transports = ['rdma']\n", "no transport plugin named ['rdma']"),
    ],
)
def test_bad_config_is_a_precise_error(tmp_path, text, fragment):
    p = tmp_path / "k.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        Kernel.from_config(p, secret=SECRET)
    assert fragment in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        KernelConfig.from_toml(tmp_path / "nope.toml")


def test_close_revokes_lease(kernel):
    lease = kernel.lease
    kernel.close()
    assert not kernel.control.alive(lease.lease_id)
