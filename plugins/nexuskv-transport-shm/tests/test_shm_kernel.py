import mmap
import os
import signal
import time

from _shm_peer import kernel_config, request, seg
from _shm_testing import SHM, ours, spawn

from nexuskv import Kernel
from nexuskv_transport_shm import ShmStore, ShmTransport, segments


def test_kernel_in_another_process_loads_zero_copy_and_misses_once_the_writer_dies(ns):
    writer, hello = spawn("kernel", ns=ns, ttl=0.5, tokens=64, size=32 << 10)
    keys = [bytes.fromhex(k) for k in hello["keys"]]
    k = Kernel(kernel_config(ns, 0.5))  # started after the writer: the shm tier is re-indexed at start
    try:
        assert isinstance(k.tiers["shm"], ShmStore) and isinstance(k.transports["shm"], ShmTransport)
        m = k.match(request(64))
        assert m.longest() == len(keys) == 4
        for b, key in enumerate(keys):
            got = k.load(key, 0, tier="shm", transport="shm")
            assert got is not None and bytes(got.payload) == bytes([b + 1]) * (32 << 10)
            assert isinstance(got.payload.obj, mmap.mmap)  # a view of the writer's segment, not a copy
            assert got.descriptor.placement.node == f"p{hello['pid']}"
        assert bytes(k.load(keys[0], 0, tier="shm", transport="local").payload) == b"\1" * (32 << 10)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
        # Its lease died with it: never served again, and the kernel's index forgets what was reclaimed.
        assert k.load(keys[1], 0, tier="shm", transport="shm") is None
        k.tiers["shm"].reap()
        assert ours(ns) == []
        assert k.match(request(64)).longest() == 0
    finally:
        k.close()
        for f in (writer.stdin, writer.stdout, writer.stderr):
            f.close()
    assert ours(ns) == []


def test_kernel_writes_into_shm_and_a_second_kernel_in_this_process_reads_it(ns):
    with Kernel(kernel_config(ns, 0.5)) as a:
        req = request(32)
        keys = a.keys(req)
        payload = b"kv" * 1000
        assert a.put(a.describe(req, 0, payload, tier="shm", keys=keys), payload)
        with Kernel(kernel_config(ns, 0.5)) as b:
            assert bytes(b.load(keys[0], 0, tier="shm", transport="shm").payload) == payload
        # a corrupt segment is quarantined by the kernel's checksum check, never returned
        path = SHM / seg(ns, keys[0] + b"\0")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        tmp = path.with_name(path.name + "x")
        tmp.write_bytes(bytes(data))
        os.rename(tmp, path)
        assert a.load(keys[0], 0, tier="shm", transport="shm") is None
        assert ours(ns) == [segments.lease_name(ns, a.tiers["shm"].lease_id)]
    deadline = time.monotonic() + 5
    while ours(ns) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ours(ns) == []
