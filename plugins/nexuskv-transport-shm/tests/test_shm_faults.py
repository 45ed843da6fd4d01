import json
import signal
import subprocess
import sys
import threading

from _shm_peer import keyed, seg, slot_n
from _shm_testing import PEER, eventually, ours, spawn

from nexuskv import verify_checksum
from nexuskv_transport_shm import ShmStore, ShmTransport, segments


def kill(proc, sig=signal.SIGKILL):
    proc.send_signal(sig)
    if sig == signal.SIGKILL:
        proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()


def test_sigkilled_writer_is_never_served_and_its_segments_are_reaped_by_lease(ns):
    writer, hello = spawn("store", ns=ns, ttl=0.5, n=3, size=64 << 10, partial=True)
    reader = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=3600))  # reaps when asked
    t = ShmTransport()
    try:
        held = t.fetch(reader, slot_n(1))
        assert bytes(held.payload) == b"\1" * (64 << 10)
        # 3 segments, the lease record and a half-written temp segment
        assert len(ours(ns)) == 5 and any(n.startswith(f"{ns}-t-{hello['lease']}") for n in ours(ns))
        kill(writer)
        # The very next read sees the owner is gone: a miss, even though the pages still exist ...
        assert reader.get(slot_n(0)) is None and t.fetch(reader, slot_n(2)) is None
        # ... and nothing but the lease reaper removes the rest: no resource tracker, no atexit ran in the peer.
        left = ours(ns)
        assert left and all(segments.parse_name(ns, n)[0] in "stl" for n in left)
        removed = reader.reap()
        assert sorted(removed) == left and ours(ns) == []
        # A view taken while the writer lived stays intact (mapped pages outlive the unlink).
        assert bytes(held.payload) == b"\1" * (64 << 10)
    finally:
        reader.close()
        t.close()
    assert ours(ns) == []


def test_any_process_reaps_on_open_and_periodically(ns):
    writer, _ = spawn("store", ns=ns, ttl=0.5, n=2, size=1000)
    kill(writer)
    assert ours(ns)
    ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=3600).close()  # a new opener reaps (keyed or not)
    assert ours(ns) == []
    writer, _ = spawn("store", ns=ns, ttl=0.5, n=2, size=1000)
    watcher = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=0.1))
    try:
        assert len(ours(ns)) == 3
        kill(writer)
        assert eventually(lambda: ours(ns) == [])  # the watcher's periodic round
        assert watcher.reaped >= 3
    finally:
        watcher.close()


def test_hung_writer_expires_with_its_lease_ttl(ns):
    writer, _ = spawn("store", ns=ns, ttl=0.5, n=2, size=1000)
    reader = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=0.1))
    try:
        assert reader.get(slot_n(1)) is not None
        kill(writer, signal.SIGSTOP)  # alive but not renewing: only the TTL can tell
        assert eventually(lambda: reader.get(slot_n(1)) is None)
        assert eventually(lambda: ours(ns) == [])
    finally:
        kill(writer, signal.SIGKILL)
        reader.close()
    assert ours(ns) == []


def test_reader_process_leaves_no_resource_tracker_warnings(ns):
    writer, _ = spawn("store", ns=ns, ttl=2.0, n=3, size=1 << 20)
    try:
        args = json.dumps({"ns": ns, "slots": [0, 1, 2, 7]})
        out = subprocess.run([sys.executable, "-W", "always", PEER, "reader", args], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.splitlines()[-1])["results"] == [[0, 1 << 20, "mmap"], [1, 1 << 20, "mmap"],
                                                                     [2, 1 << 20, "mmap"], None]  # fmt: skip
        assert "resource_tracker" not in out.stderr and "leaked" not in out.stderr, out.stderr
        # The reader exiting did not take the writer's segments with it (a tracker-owned attach would have).
        assert len(ours(ns)) == 4
    finally:
        writer.stdin.close()  # clean exit: the writer's close removes its segments and lease
        writer.wait(timeout=10)
        writer.stdout.close()
        writer.stderr.close()
    assert ours(ns) == []


def test_readers_never_see_a_torn_payload_while_a_writer_replaces_it_and_dies(ns):
    size = 256 << 10
    writer, _ = spawn("churn", ns=ns, ttl=0.5, size=size)
    reader = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=0.5, reap_interval_s=3600))
    t = ShmTransport()
    seen: set[int] = set()
    bad: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            got = t.fetch(reader, slot_n(0))
            if got is None:
                continue
            p = got.payload
            if len(p) != size or bytes(p) != bytes([p[0]]) * size:
                bad.append("torn")
            elif not verify_checksum(p, got.descriptor.checksum):
                bad.append("checksum")
            seen.add(p[0])

    th = threading.Thread(target=read)
    th.start()
    try:
        assert eventually(lambda: len(seen) >= 5)
        kill(writer)  # most likely mid-write: a temp segment is left behind
        stop.set()
        th.join()
        assert bad == []
        assert reader.get(slot_n(0)) is None  # the last published version died with its writer
        reader.reap()
        assert ours(ns) == []
    finally:
        stop.set()
        reader.close()
        t.close()


def test_segments_are_posix_shm_objects_and_why_readers_do_not_attach_with_shared_memory(ns):
    s = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=2.0, reap_interval_s=3600))
    try:
        payload = b"\5" * 1000
        from _shm_peer import descriptor

        assert s.put(slot_n(1), payload, descriptor(slot_n(1), payload))
        name = seg(ns, slot_n(1))
        code = ("import sys; from multiprocessing.shared_memory import SharedMemory as S; m = S(name=sys.argv[1]); "
                "sys.stdout.write(str(bytes(m.buf[-1000:]) == b'\\5' * 1000)); m.close()")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60)
        assert out.stdout == "True"  # any POSIX shm client can attach the segment by name
        if sys.version_info < (3, 13):
            # The trap: 3.11's SharedMemory registers an *attach* with its resource tracker, which unlinks the
            # segment when that reader exits (and warns of a leak). Our readers never attach that way.
            assert "leaked" in out.stderr and name not in ours(ns)
    finally:
        s.close()
    assert ours(ns) == []
