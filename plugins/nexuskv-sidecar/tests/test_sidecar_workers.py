"""Worker processes and the binary token encoding: the same answers as one process, and every fault handled.

The whole API suite (`test_sidecar_api.py`) runs against one process and against two workers (the `sidecar`
fixture); these tests add what only workers and the binary encoding have: the encoding's own errors, a reference
model under many threads, the report-once rule across workers, a malformed channel, a killed worker, and a kernel
process that stops answering.
"""

from __future__ import annotations

import array
import http.client
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from _sidecar_helpers import TOKENS, call, commit_all, make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv import Kernel, LoadReport, Request, Slo, from_dict, to_dict
from nexuskv_sidecar import Sidecar, SidecarClient, SidecarConfig, SidecarError, digest
from nexuskv_sidecar._backend import KernelBackend
from nexuskv_sidecar._binary import CONTENT_TYPE, Parsed, encode
from nexuskv_sidecar._channel import Channel, serve_channel


def post_binary(port: int, path: str, body: bytes, token: str = TOKENS["chat"]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {token}", "Content-Type": CONTENT_TYPE})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def binary_of(req: Request) -> bytes:
    head = to_dict(req)
    return encode(head, head.pop("token_ids"))


# ---------------------------------------------------------------------------------------------- the encoding


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.sampled_from(["", "salt"]), st.integers(0, 9))
def test_the_binary_encoding_gives_the_request_json_gives(ids, salt, priority):
    from nexuskv_sidecar._binary import head, split

    req = make_request(ids, cache_salt=salt, priority=priority)
    document, got_ids = split(binary_of(req), 1 << 19)
    parsed = Parsed(head(document), got_ids)
    assert parsed.request() == req == from_dict(Request, json.loads(json.dumps(to_dict(req))))
    assert pickle.loads(pickle.dumps(parsed)).request() == req  # what travels to the kernel's process
    assert Parsed.of(req).request() == req


def test_binary_plans_and_routes_equal_json_ones(sidecar, kernel):
    req = make_request(range(70_000, 70_000 + 320), request_id="bin")
    commit_all(kernel, req)
    status, by_json = call(sidecar.port, "POST", "/v1/plan", to_dict(req))
    status_b, by_binary = post_binary(sidecar.port, "/v1/plan", binary_of(req))
    assert status == status_b == 200
    same = ("action", "tokens_total", "tokens_reused", "spans", "request_id", "policy_revision")
    assert {k: by_binary[k] for k in same} == {k: by_json[k] for k in same}
    assert by_binary["tokens_reused"] == 320 and by_binary["mac"]
    nodes = [{"node": "n1", "queue_ms": 5.0}, {"node": "n2", "queue_ms": 0.0}]
    head = to_dict(req)
    ids = head.pop("token_ids")
    status, routed = post_binary(sidecar.port, "/v1/route", encode({"request": head, "nodes": nodes}, ids))
    assert status == 200
    assert routed == call(sidecar.port, "POST", "/v1/route", {"request": to_dict(req), "nodes": nodes})[1]


def test_binary_bodies_get_a_clear_400_naming_what_is_wrong(sidecar):
    req = make_request(range(64))
    good = binary_of(req)
    n = int.from_bytes(good[4:8], "little")
    cases = {
        b"JSON" + good[4:]: "starts with b'NKV1'",
        good[:4] + (len(good)).to_bytes(4, "little") + good[8:]: "runs past the body's end",
        good + b"\x01": "not a whole number of uint32 ids",
        good[:8] + b"[" + good[9:8 + n] + good[8 + n:]: "the JSON part is not JSON",
        encode(to_dict(req), []): "token_ids: given in the JSON part",
    }
    for body, why in cases.items():
        status, answer = post_binary(sidecar.port, "/v1/plan", body)
        assert status == 400 and why in answer["error"], (why, answer)
    head = to_dict(req)
    head.pop("token_ids")
    head["model"]["nmae"] = "typo"
    del head["tenant"]
    status, answer = post_binary(sidecar.port, "/v1/plan", encode(head, range(64)))
    assert status == 400 and {p["path"] for p in answer["problems"]} == {"model.nmae", "tenant"}
    assert post_binary(sidecar.port, "/v1/plan", good, token=TOKENS["rag"])[0] == 403
    status, answer = post_binary(sidecar.port, "/v1/route", encode({"request": {}, "nodes": [], "x": 1}, []))
    assert status == 400 and answer["error"] == "body: unknown field 'x'"


def test_binary_token_counts_are_capped_before_any_id_is_read(kernel):
    cfg = SidecarConfig(port=0, tokens={digest(TOKENS["chat"]): "chat"}, max_tokens=100, workers=2)
    with Sidecar(cfg, kernel=kernel) as sc:
        status, answer = post_binary(sc.port, "/v1/plan", binary_of(make_request(range(101))))
        assert status == 400 and answer["error"] == "request: 101 tokens, over the limit of 100"


def test_the_python_client_speaks_both_encodings(sidecar, kernel):
    req = make_request(range(5000, 5000 + 256), request_id="py-bin")
    commit_all(kernel, req)
    with SidecarClient(sidecar.url, TOKENS["chat"]) as j, SidecarClient(sidecar.url, TOKENS["chat"], binary=True) as b:
        pj, pb = j.plan(req), b.plan(req)
        assert (pb.action, pb.tokens_reused, pb.spans) == (pj.action, pj.tokens_reused, pj.spans)
        nodes = [{"node": "n1", "queue_ms": 1.0}]
        assert b.route(req, nodes) == j.route(req, nodes)
        assert b.fail_opens == j.fail_opens == 0
        for ids, problem in ((list(range(2**32, 2**32 + 16)), "not uint32 ids"), (None, "required field is missing")):
            body = to_dict(req)
            if ids is None:
                del body["token_ids"]
            else:
                body["token_ids"] = ids
            with pytest.raises(SidecarError) as err:  # the caller's mistake: raised, as the server's 400 would be
                b.plan(body)
            assert err.value.status == 400 and problem in err.value.problems[0][1]


# ---------------------------------------------------------------------------------------------- workers


def test_many_threads_through_two_workers_get_the_kernels_own_answers(kernel):
    """A reference model: each answer equals the plan the kernel makes in this process for the same request."""
    held = [make_request(range(1000 * i, 1000 * i + 64 * (i + 1)), request_id=f"h{i}") for i in range(6)]
    for req in held:
        commit_all(kernel, req)
    cold = [make_request(range(900_000 + 100 * i, 900_000 + 100 * i + 96), request_id=f"c{i}") for i in range(6)]
    reference = {r.request_id: (p.action, p.tokens_reused) for r in held + cold if (p := kernel.plan(r))}
    cfg = SidecarConfig(port=0, tokens={digest(TOKENS["chat"]): "chat"}, workers=2, tenant_concurrency=8)
    problems: list[str] = []
    with Sidecar(cfg, kernel=kernel) as sc:

        def caller(seed: int) -> None:
            with SidecarClient(sc.url, TOKENS["chat"], timeout_s=10, binary=seed % 2 == 0) as c:
                for i in range(30):
                    req = (held + cold)[(seed * 7 + i) % 12]
                    plan = c.plan(req)
                    if (plan.action, plan.tokens_reused) != reference[req.request_id]:
                        problems.append(f"{req.request_id}: {plan.action} {plan.tokens_reused} {plan.reasons}")

        threads = [threading.Thread(target=caller, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert problems == []


def served_channels(kernel: Kernel, n: int) -> list[Channel]:
    """`n` channels answered by one kernel backend, as the sidecar's workers' are (the other ends returned)."""
    import concurrent.futures

    backend = KernelBackend(kernel)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    ends = []
    for _ in range(n):
        ours, theirs = socket.socketpair()
        threading.Thread(target=serve_channel, args=(Channel(ours, strict=True), backend, pool), daemon=True).start()
        ends.append(Channel(theirs))
    return ends


def test_a_plan_is_reported_once_whichever_worker_carries_the_report(kernel):
    req = make_request(range(128))
    commit_all(kernel, req)
    plan = kernel.plan(req)
    first, second = served_channels(kernel, 2)
    report = LoadReport(ok=True)
    first.send((1, "report", (plan, report, None), None))
    assert first.recv() == (1, "ok", {"recompute_from": 128})
    second.send((2, "report", (plan, report, None), None))
    assert second.recv() == (2, "err", (409, f"plan {plan.decision_id} was reported already", []))


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))  # what pickle.loads would run


def test_a_malformed_channel_is_closed_and_an_unknown_call_refused(kernel, tmp_path):
    (chan,) = served_channels(kernel, 1)
    chan.send((5, "unlink", ("/etc/passwd",), None))
    assert chan.recv() == (5, "err", (500, "unknown call 'unlink'", []))
    chan.send((6, "status", (), time.monotonic() - 1))  # the worker stopped waiting: the call is not run at all
    assert chan.recv() == (6, "err", (503, "status expired in the kernel process's queue (the worker stopped "
                                           "waiting)", []))  # fmt: skip
    marker = tmp_path / "ran"
    chan.send((7, "status", (_RunsCode(str(marker)),), None))  # a pickle that runs code: refused, channel closed
    with pytest.raises(EOFError):
        chan.recv()
    assert not marker.exists()
    (chan,) = served_channels(kernel, 1)
    chan.sock.sendall((12).to_bytes(4, "little") + b"not a pickle")  # garbage: the kernel's side hangs up
    with pytest.raises(EOFError):
        chan.recv()
    (chan,) = served_channels(kernel, 1)
    chan.sock.sendall((1 << 31).to_bytes(4, "little"))  # a frame past the limit is never read into memory
    with pytest.raises(EOFError):
        chan.recv()


def test_an_answer_too_large_for_the_channel_fails_that_call_only(kernel, monkeypatch):
    import nexuskv_sidecar._channel as channel_module

    (chan,) = served_channels(kernel, 1)
    monkeypatch.setattr(channel_module, "MAX_FRAME", 200)  # a status document is larger than this
    chan.send((1, "status", (), None))
    kind, (status, detail, _) = chan.recv()[1:]
    assert kind == "err" and status == 507 and "too large for a worker" in detail
    chan.send((2, "healthz", (), None))  # the same channel goes on
    assert chan.recv() == (2, "ok", {"ok": True, "node": "n1", "control_ok": True})


def test_records_a_worker_drops_count_in_the_kernels_subscriber_drops(kernel):
    (chan,) = served_channels(kernel, 1)
    before = kernel.decision_log.subscriber_drops
    chan.send((9, "dropped", (7,), None))
    chan.send((9, "dropped", (-3,), None))  # not a count: ignored
    chan.send((3, "healthz", (), None))  # answered after both: they were handled in order
    assert chan.recv()[:2] == (3, "ok")
    assert kernel.decision_log.subscriber_drops == before + 7


def test_a_workers_full_stream_tells_the_kernels_process_what_it_dropped():
    import asyncio

    from nexuskv_sidecar._channel import take_frame
    from nexuskv_sidecar._remote import _STREAM_KEPT, RemoteBackend

    ours, theirs = socket.socketpair()

    async def scenario() -> list:
        backend = RemoteBackend("n1", 100.0)
        await backend.connect(theirs)
        sub = backend.decision_log.subscribe()
        for i in range(_STREAM_KEPT + 25):  # nobody reads the stream: the last 25 do not fit
            backend._arrived(sub.stream_id, "rec", {"decision_id": str(i)})
        await asyncio.sleep(1.5)  # the drops are sent within a second
        sub.close()
        await asyncio.sleep(0.1)
        return [sub.drops]

    (drops,) = asyncio.run(scenario())
    ours.settimeout(5)
    buf, frames = bytearray(), []
    while not any(f[1] == "unsubscribe" for f in frames):
        buf += ours.recv(1 << 16)
        while (data := take_frame(buf)) is not None:
            frames.append(pickle.loads(data))
    assert drops == 25
    assert [f[2] for f in frames if f[1] == "dropped"] == [(25,)]  # sent once, with the whole count
    ours.close()


def test_a_killed_worker_is_started_again_and_plans_go_on(kernel):
    cfg = SidecarConfig(port=0, tokens={digest(TOKENS["chat"]): "chat"}, workers=2)
    req = make_request(range(64))
    with Sidecar(cfg, kernel=kernel) as sc:
        before = sc.workers.pids
        procs = [w.proc for w in sc.workers.workers]
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = sc.workers.pids
            if len(pids) == 2 and before[0] not in pids and all(w.ready.is_set() for w in sc.workers.workers):
                break
            time.sleep(0.05)
        assert len(sc.workers.pids) == 2 and before[0] not in sc.workers.pids
        answers = [call(sc.port, "POST", "/v1/plan", to_dict(req))[0] for _ in range(20)]
        assert answers == [200] * 20
        procs += [w.proc for w in sc.workers.workers]
    assert all(p.poll() is not None for p in procs)  # every worker, the killed one's successor too, has stopped


def test_a_stop_signal_to_the_whole_process_group_starts_no_successor(kernel):
    cfg = SidecarConfig(port=0, tokens={digest(TOKENS["chat"]): "chat"}, workers=2)
    with Sidecar(cfg, kernel=kernel) as sc:
        before = sc.workers.pids
        for pid in before:  # what Ctrl-C or a service manager's SIGTERM to the group does to the workers first
            os.kill(pid, signal.SIGTERM)
        for w in sc.workers.workers:
            w.proc.wait(10)
        # the sidecar is stopped (here: leaving the block) while the workers' threads wait to see it stop
    assert [w.proc.pid for w in sc.workers.workers] == before  # no successor was started during the shutdown


def test_a_worker_stopped_by_a_signal_alone_is_started_again(kernel):
    cfg = SidecarConfig(port=0, tokens={digest(TOKENS["chat"]): "chat"}, workers=2)
    with Sidecar(cfg, kernel=kernel) as sc:
        before = sc.workers.pids
        os.kill(before[0], signal.SIGTERM)  # the sidecar itself was not stopped: after a short wait, a successor
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (len(sc.workers.pids) == 2 and before[0] not in sc.workers.pids):
            time.sleep(0.05)
        assert len(sc.workers.pids) == 2 and before[0] not in sc.workers.pids


def test_a_worker_whose_kernel_process_is_silent_fails_open_and_ends_when_it_is_gone():
    """This test plays the kernel's process: it answers nothing, then hangs up."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    ours, theirs = socket.socketpair()
    fds = (listener.fileno(), theirs.fileno())
    proc = subprocess.Popen([sys.executable, "-m", "nexuskv_sidecar.worker", *map(str, fds)], pass_fds=fds)
    theirs.close()
    chan = Channel(ours)
    try:
        chan.send({"node": "n1", "max_deadline_ms": 100.0, "tokens": {digest(TOKENS["chat"]): "chat"},
                   "max_body_bytes": 1 << 20, "limits": {}})  # fmt: skip
        assert chan.recv()[1] == "ready"
        port = listener.getsockname()[1]
        req = make_request(range(64), slo=Slo(deadline_ms=100.0))
        t0 = time.monotonic()
        status, plan = call(port, "POST", "/v1/plan", to_dict(req))
        waited = time.monotonic() - t0
        assert status == 200 and plan["action"] == "recompute" and plan["tokens_total"] == 64
        assert plan["reasons"] == ["fail-open: sidecar: the sidecar's kernel process did not answer plan within 1.1 s"]
        assert waited >= 1.0
        assert chan.recv()[1] == "plan"  # the call it made, never answered
        status, _ = call(port, "GET", "/v1/status", token=TOKENS["chat"])
        assert status == 403  # refused by the worker itself: no kernel needed to say no
        chan.close()  # the kernel's process is gone: the worker stops by itself
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()


def test_workers_are_bounded_in_the_config(tmp_path):
    from nexuskv import ConfigError

    for bad in (0, 65, True):
        with pytest.raises(ConfigError, match="workers"):
            SidecarConfig.from_mapping({"workers": bad})
    assert SidecarConfig.from_mapping({"workers": 4}).workers == 4


def test_the_workers_inherit_only_their_channel_and_the_listening_socket(kernel):
    """Nothing another process or user could connect to: no Unix path, no extra port, per worker."""
    cfg = SidecarConfig(port=0, tokens={digest(TOKENS["chat"]): "chat"}, workers=2)
    with Sidecar(cfg, kernel=kernel) as sc:
        for pid in sc.workers.pids:
            sockets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            sockets = [s for s in sockets if s.startswith("socket:")]
            inodes = {s[8:-1] for s in sockets}
            with open("/proc/net/unix") as f:  # Unix sockets of the worker: unnamed (no path) every one
                named = [line.split()[-1] for line in f if line.split()[6] in inodes and len(line.split()) > 7]
            assert named == []
            with open("/proc/net/tcp") as f:  # listening TCP sockets of the worker: the sidecar's port only
                listening = {int(line.split()[1].split(":")[1], 16) for line in list(f)[1:]
                             if line.split()[9] in inodes and line.split()[3] == "0A"}  # fmt: skip
            assert listening == {sc.port}
    assert array.array("I").itemsize == 4  # the encoding's uint32 on this platform


def test_a_send_that_fails_part_way_hangs_the_channel_up_so_no_frame_follows_half_of_one():
    ours, theirs = socket.socketpair()
    sender, reader = Channel(ours, send_timeout_s=0.2), Channel(theirs)
    with pytest.raises(OSError):
        sender.send(b"x" * (16 << 20))  # the reader reads nothing: the send times out part-way
    assert sender.closed
    with pytest.raises(BrokenPipeError):
        sender.send(("a", "small", "frame"))  # never written after the half frame
    with pytest.raises(EOFError):
        reader.recv()  # the half frame, then the hang-up: an end, never a message made of the wrong bytes
    reader.close()
    sender.close()


def test_frames_read_before_a_hang_up_are_not_handed_out():
    ours, theirs = socket.socketpair()
    writer, reader = Channel(ours), Channel(theirs)
    writer.send(("first",))
    writer.send(("second",))
    assert reader.recv() == ("first",)  # both frames are in the reader's buffer now
    reader.hangup()
    with pytest.raises(EOFError):
        reader.recv()
    reader.close()
    writer.close()


def test_the_kernels_loader_takes_contract_classes_by_their_own_name_only():
    import io

    from nexuskv_sidecar._channel import _checked_parsed, _Contracts

    loader = _Contracts(io.BytesIO(b""))
    assert loader.find_class("nexuskv.contracts.request", "Request") is Request
    for module, name in (("nexuskv.contracts.schema", "jsonschema.Draft202012Validator"),  # a dotted walk
                         ("nexuskv.paths.load", "StoredState"), ("nexuskv.contracts.request", "ContractError"),
                         ("nexuskv.contracts.request", "field"),
                         ("builtins", "eval"), ("posix", "system")):  # fmt: skip
        with pytest.raises(pickle.UnpicklingError):
            loader.find_class(module, name)
    with pytest.raises(pickle.UnpicklingError):
        _checked_parsed("not a request", b"")


def test_workers_refuse_a_port_another_process_listens_on(kernel):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            Sidecar(SidecarConfig(port=port, tokens={digest(TOKENS["chat"]): "chat"}, workers=2), kernel=kernel)
    finally:
        taken.close()


def test_route_candidates_are_capped_before_any_is_built(sidecar):
    nodes = [{"node": f"n{i}"} for i in range(4097)]
    status, answer = call(sidecar.port, "POST", "/v1/route", {"request": to_dict(make_request(range(16))),
                                                              "nodes": nodes})  # fmt: skip
    assert status == 400 and answer["error"] == "nodes: 4097 candidates, at most 4096 (pre-select them)"
