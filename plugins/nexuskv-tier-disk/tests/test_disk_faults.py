from __future__ import annotations

import errno
import os
import re
import selectors
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nexuskv import verify_checksum
from nexuskv_tier_disk import durable_files, file_format


def _leftovers(path):
    return [n for n in os.listdir(path) if n.startswith((file_format.TEMP_PREFIX, file_format.EVICT_PREFIX))]


def test_disk_full_drops_the_payload_reports_it_and_leaves_no_file(open_store, item, monkeypatch):
    store = open_store()
    a, b = item(1), item(2)
    real = os.writev

    def full(fd, views):
        real(fd, [bytes(views[0])[:10]])  # part of the header lands, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(durable_files.os, "writev", full)
    assert store.put(a.slot, a.payload, a.desc)  # accepted: the write fails later, on the writer thread
    store.flush()
    assert a.slot not in store and store.get(a.slot) is None and store.used_bytes() == 0
    assert store.write_errors == 1
    assert store.events == [(a.slot, a.desc, a.payload)]  # payload attached: the kernel can demote it
    assert os.listdir(store.path) == [".lock"]
    monkeypatch.setattr(durable_files.os, "writev", real)
    assert store.put(b.slot, b.payload, b.desc)
    store.flush()
    assert bytes(store.get(b.slot).payload) == b.payload


def test_io_error_on_an_overwrite_drops_the_older_file_too(open_store, item, monkeypatch):
    store = open_store()
    a = item(1)
    store.put(a.slot, a.payload, a.desc)
    store.flush()

    def broken(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(durable_files.os, "fsync", broken)
    store.fsync = True
    store.put(a.slot, a.payload, a.desc)
    store.flush()
    assert a.slot not in store and os.listdir(store.path) == [".lock"]
    assert len(store.events) == 1


@pytest.mark.parametrize("where", ["truncate", "flip-payload", "flip-header", "flip-descriptor", "empty"])
def test_damaged_file_at_runtime_is_never_served(open_store, item, where):
    store = open_store()
    a, b = item(1), item(2)
    store.put(a.slot, a.payload, a.desc)
    store.put(b.slot, b.payload, b.desc)
    store.flush()
    path = store.file_of(a.slot)
    _damage(path, where)
    assert store.get(a.slot) is None
    assert a.slot not in store and not os.path.exists(path)
    assert store.corrupt_reads == 1 and store.problems[-1][0] == os.path.basename(path)
    assert store.events == [(a.slot, a.desc, None)]  # the kernel's index forgets it
    assert bytes(store.get(b.slot).payload) == b.payload


@pytest.mark.parametrize("where", ["truncate", "flip-header", "flip-descriptor", "empty"])
def test_damaged_header_or_size_is_reported_at_start(open_store, item, where):
    store = open_store()
    a, b = item(1), item(2)
    store.put(a.slot, a.payload, a.desc)
    store.put(b.slot, b.payload, b.desc)
    store.close()
    _damage(store.file_of(a.slot), where)
    again = open_store()
    ((name, reason),) = again.recovery.corrupt
    assert name == os.path.basename(store.file_of(a.slot)) and reason
    assert a.slot not in again and not os.path.exists(store.file_of(a.slot))
    assert [s for s, _ in again.descriptors()] == [b.slot]


def test_flipped_payload_byte_after_restart(open_store, item):
    store = open_store()
    a = item(1)
    store.put(a.slot, a.payload, a.desc)
    store.close()
    _damage(store.file_of(a.slot), "flip-payload")
    lazy = open_store()  # headers only at start: found on the first read
    assert lazy.recovery.recovered == 1 and lazy.get(a.slot) is None and lazy.corrupt_reads == 1
    lazy.close()
    store = open_store()
    store.put(a.slot, a.payload, a.desc)
    store.close()
    _damage(store.file_of(a.slot), "flip-payload")
    eager = open_store(verify_on_start=True)
    assert eager.recovery.corrupt == [(os.path.basename(store.file_of(a.slot)), "payload checksum mismatch")]


def _damage(path, where):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    header, meta, _ = file_format.read_header(path)
    if where == "truncate":
        data = data[: len(data) - 100]
    elif where == "empty":
        data = bytearray()
    elif where == "flip-payload":
        data[header.data_offset + header.stored_len // 2] ^= 0x01
    elif where == "flip-header":
        data[20] ^= 0x01  # inside the raw length field
    elif where == "flip-descriptor":
        data[file_format.FIXED_SIZE + len(meta) // 2] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)


# The child reports on its own channel, one os.write per line: a line written by a single write(2) of at most
# PIPE_BUF bytes to a pipe is atomic, so the writer thread's IN-WRITE never lands inside the main thread's PUT line
# (print() writes "PUT", " ", "5" and "\n" separately, and an interleaved "PUTIN-WRITE 5" used to hide the IN-WRITE,
# leaving the parent reading forever). Anything else on stdout (structlog prints there when unconfigured) goes to
# stderr instead.
_CHILD = textwrap.dedent(
    """
    import os, sys, time
    report = os.dup(1)
    os.dup2(2, 1)
    sys.path.insert(0, {tests!r})
    from conftest import NAME_KEY, Item
    from nexuskv_tier_disk import DiskStore, durable_files

    def say(line):
        os.write(report, (line + "\\n").encode())

    path, hang_at = sys.argv[1], int(sys.argv[2])
    store = DiskStore(1 << 30, path=path, fsync=True)
    store.use_name_key(NAME_KEY)
    real = durable_files.write_file
    calls = [0]

    def write_file(p, chunks, fsync):
        calls[0] += 1
        if calls[0] == hang_at:  # half a temporary file on disk, then hang until killed
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            os.write(fd, bytes(chunks[0]) + bytes(chunks[1])[: len(chunks[1]) // 2])
            say("IN-WRITE")
            time.sleep(60)
        return real(p, chunks, fsync)

    durable_files.write_file = write_file if hang_at else real
    i = 0
    while True:  # payload i is put until accepted: the accepted payloads are exactly 0, 1, 2, ...
        it = Item(i, 64 << 10)
        while not store.put(it.slot, it.payload, it.desc):
            time.sleep(0.005)  # the write queue is full: wait for the writer instead of spinning
        say(f"PUT {{i}}")
        i += 1
    """
)

_LINE = re.compile(r"PUT \d+|IN-WRITE")


def _read_until(proc, err, done, deadline_s=120.0):
    """The child's report lines until `done(lines)`, and the start of the next; fails with what it saw (never
    hangs) if the child dies first or `done` does not come within `deadline_s` (generous: a few seconds do)."""
    fd, lines, rest = proc.stdout.fileno(), [], b""
    deadline = time.monotonic() + deadline_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not done(lines):
            left = deadline - time.monotonic()
            chunk = os.read(fd, 1 << 16) if left > 0 and sel.select(left) else None
            if not chunk:
                why = "exited" if chunk is not None else f"did not get there within {deadline_s:.0f} s"
                pytest.fail(f"the child {why}; last lines {lines[-5:]}; stderr: {err.read_text()[-2000:]}")
            *new, rest = (rest + chunk).split(b"\n")
            lines += [x.decode() for x in new]
    return lines, rest


@pytest.mark.parametrize("hang_at", [0, 5])
def test_sigkill_during_writes_never_serves_a_corrupt_payload(tmp_path, open_store, item, hang_at):
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=os.path.dirname(__file__)))
    data, err = tmp_path / "tier", tmp_path / "child.err"
    with open(err, "wb") as errf:
        proc = subprocess.Popen([sys.executable, str(script), str(data), str(hang_at)], stdout=subprocess.PIPE,
                                stderr=errf)  # fmt: skip
    try:
        if hang_at:
            lines, rest = _read_until(proc, err, lambda ls: "IN-WRITE" in ls)
        else:
            lines, rest = _read_until(proc, err, lambda ls: sum(x.startswith("PUT") for x in ls) >= 40)
    finally:
        proc.send_signal(signal.SIGKILL)
        tail, _ = proc.communicate(timeout=30)  # the child is dead: what it wrote before lies in the pipe
    later = (rest + tail).decode().splitlines()  # what the child printed after the parent stopped reading
    assert all(_LINE.fullmatch(x) for x in lines + later), lines + later  # whole lines only: nothing interleaved
    puts = sum(x.startswith("PUT") for x in lines)
    assert puts >= 4
    # The last put accepted may have been written to disk, killed before its PUT line: one past the last printed.
    accepted = 1 + max(int(x.split()[1]) for x in lines + later if x.startswith("PUT"))
    store = open_store(path=str(data))
    rec = store.recovery
    if hang_at:
        assert len(rec.temp_removed) == 1 and rec.recovered == hang_at - 1  # each earlier write landed
    assert not rec.corrupt and not _leftovers(str(data))
    served = 0
    for slot, desc in store.descriptors():
        i = next(i for i in range(accepted + 1) if item(i, 64).slot == slot)
        got = store.get(slot)
        assert got is not None and bytes(got.payload) == item(i, 64 << 10).payload
        assert verify_checksum(got.payload, desc.checksum)
        served += 1
    assert served == rec.recovered and store.corrupt_reads == 0
