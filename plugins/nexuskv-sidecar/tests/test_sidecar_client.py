"""The Python client against a real sidecar: plans like the kernel's, fails open when the sidecar cannot answer."""

from __future__ import annotations

import socket
import threading

import pytest
from _sidecar_helpers import TOKENS, commit_all, make_request

from nexuskv import LoadReport, NodeState, PlanAction
from nexuskv_sidecar import SidecarClient, SidecarError


def test_plan_commit_materialize_report_route(sidecar, kernel):
    req = make_request(range(160), request_id="c1")
    with SidecarClient(sidecar.url, TOKENS["chat"]) as client:
        assert client.commit(req, {b: bytes([b]) * 80 for b in range(10)}) == {"accepted": 10, "refused": 0}
        assert kernel.flush(30)
        plan = client.plan(req)
        assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 160 and plan.request_id == "c1"
        done = client.materialize(plan, req, payloads=True)
        assert done["complete"] and len(done["states"]) == 10
        assert client.report(plan, LoadReport(ok=False, failed_block=2, tier="dram", reason="mount")) == 32
        decision = client.route(req, [NodeState(node="n1"), NodeState(node="n2", waiting_requests=50)])
        assert decision["node"] == "n1"
        assert client.fail_opens == 0


def test_caller_mistakes_raise_with_the_servers_problems(sidecar):
    with SidecarClient(sidecar.url, TOKENS["chat"]) as client:
        with pytest.raises(SidecarError) as err:
            client.plan(make_request(range(32), tenant="rag"))
        assert err.value.status == 403
        with pytest.raises(SidecarError) as err:
            client.plan({"tenant": "chat"})
        assert err.value.status == 400 and ("request_id", "required field is missing") in err.value.problems
        assert client.fail_opens == 0


def test_an_unreachable_sidecar_gives_recompute():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SidecarClient(f"http://127.0.0.1:{port}", "t", timeout_s=0.5) as client:
        plan = client.plan(make_request(range(48), request_id="down"))
        assert plan.action == PlanAction.RECOMPUTE and plan.tokens_total == 48 and plan.request_id == "down"
        assert plan.reasons[0].startswith("fail-open: sidecar unreachable: ConnectionRefusedError")
        assert client.fail_opens == 1
        with pytest.raises(ConnectionError):
            client.status()


def test_a_sidecar_that_never_answers_gives_recompute_after_the_timeout():
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    try:
        with SidecarClient(f"http://127.0.0.1:{listener.getsockname()[1]}", "t", timeout_s=0.3) as client:
            plan = client.plan(make_request(range(32)))
            assert plan.action == PlanAction.RECOMPUTE and "timed out after 0.3 s" in plan.reasons[0]
            assert client.fail_opens == 1
    finally:
        stop.set()
        t.join()
        for c in accepted:
            c.close()
        listener.close()


def test_many_threads_share_one_client(sidecar, kernel):
    """16 threads x 25 plans through one client: every answer is its own request's, each counted once."""
    reqs = {f"t{i}": make_request(range(i * 1000, i * 1000 + 64 + 16 * (i % 4)), request_id=f"t{i}") for i in range(16)}
    for req in list(reqs.values())[::2]:
        commit_all(kernel, req)
    before = kernel.decisions
    got: dict[str, list] = {rid: [] for rid in reqs}
    errors = []

    def work(rid):
        try:
            for _ in range(25):
                got[rid].append(client.plan(reqs[rid]))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with SidecarClient(sidecar.url, TOKENS["chat"]) as client:
        threads = [threading.Thread(target=work, args=(rid,)) for rid in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and client.fail_opens == 0
    assert kernel.decisions - before == 16 * 25
    for i, (rid, plans) in enumerate(got.items()):
        want = kernel.plan(reqs[rid])  # the reference: the kernel asked directly
        assert len(plans) == 25
        assert {(p.request_id, p.action, p.tokens_reused) for p in plans} == {(rid, want.action, want.tokens_reused)}
        assert (want.tokens_reused > 0) == (i % 2 == 0)
