"""The sidecar's HTTP API against a real kernel on a real port: every operation, auth, bad bodies, fail-open."""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time

import pytest
from _sidecar_helpers import SECRET, TOKENS, call, commit_all, make_request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv import Plan, PlanAction, checksum, from_dict, json_schema, to_dict
from nexuskv_sidecar import openapi


def test_plan_matches_the_kernels_own(sidecar, kernel):
    req = make_request(range(256))
    commit_all(kernel, req)
    status, body = call(sidecar.port, "POST", "/v1/plan", to_dict(req))
    assert status == 200
    plan = from_dict(Plan, body)  # the answer is a valid plan.v1
    direct = kernel.plan(req)
    assert (plan.action, plan.tokens_reused, plan.spans) == (direct.action, direct.tokens_reused, direct.spans)
    assert plan.action == PlanAction.MATERIALIZE and plan.tokens_reused == 256
    assert plan.mac and plan.policy_revision == kernel.policy_revision


def test_tokens_act_for_their_tenant_only(sidecar):
    req = to_dict(make_request(range(64), tenant="rag"))
    assert call(sidecar.port, "POST", "/v1/plan", req, token=None)[0] == 401
    assert call(sidecar.port, "POST", "/v1/plan", req, token="no-such-token")[0] == 401
    status, body = call(sidecar.port, "POST", "/v1/plan", req, token=TOKENS["chat"])
    assert status == 403 and body["error"] == "this token acts for tenant 'chat', not 'rag'"
    assert call(sidecar.port, "POST", "/v1/plan", req, token=TOKENS["rag"])[0] == 200
    assert call(sidecar.port, "POST", "/v1/plan", req, token=TOKENS["*"])[0] == 200  # the operator: any tenant
    assert call(sidecar.port, "GET", "/v1/status", token=TOKENS["chat"])[0] == 403


def test_bad_bodies_name_every_problem(sidecar):
    req = to_dict(make_request(range(64)))
    req["token_ids"][3] = -1
    req["model"]["nmae"] = "typo"
    status, body = call(sidecar.port, "POST", "/v1/plan", req)
    assert status == 400 and body["error"] == "invalid request"
    assert {p["path"] for p in body["problems"]} == {"token_ids[3]", "model.nmae"}
    status, body = call(sidecar.port, "POST", "/v1/plan", raw=b'{"tenant": ')
    assert status == 400 and body["error"].startswith("body is not JSON")
    status, body = call(sidecar.port, "POST", "/v1/plan", raw=b"")
    assert status == 400 and "empty body" in body["error"]
    req = to_dict(make_request(range(64)))
    req["token_ids"][0] = True  # a boolean is not a token id, whatever Python thinks of it
    status, body = call(sidecar.port, "POST", "/v1/plan", req)
    assert status == 400 and body["problems"] == [{"path": "token_ids[0]", "problem": "expected integer, got boolean"}]
    status, body = call(sidecar.port, "POST", "/v1/plan", raw=b"x" * ((1 << 20) + 1))
    assert status == 413 and "over the limit" in body["error"]
    status, body = call(sidecar.port, "POST", "/v1/route", {"request": to_dict(make_request(range(16))), "nodes": []})
    assert status == 400 and body["error"] == "nodes: expected a non-empty list"


def test_commit_then_plan_then_materialize_then_report(sidecar, kernel):
    req = make_request(range(128))
    payloads = [{"block": b, "group": 0, "data": base64.b64encode(bytes([b]) * 96).decode()} for b in range(8)]
    status, body = call(sidecar.port, "POST", "/v1/commit", {"request": to_dict(req), "payloads": payloads})
    assert status == 200 and body == {"accepted": 8, "refused": 0}
    assert kernel.flush(30)
    status, plan = call(sidecar.port, "POST", "/v1/plan", to_dict(req))
    assert status == 200 and plan["action"] == "materialize" and plan["tokens_reused"] == 128
    status, done = call(sidecar.port, "POST", "/v1/materialize?payloads=1", {"plan": plan, "request": to_dict(req)})
    assert status == 200 and done["complete"] and done["blocks"] == 8 and done["tokens"] == 128
    for state in done["states"]:
        data = base64.b64decode(state["data"])
        assert data == bytes([state["block"]]) * 96
        assert state["descriptor"]["checksum"] == checksum(data, state["descriptor"]["checksum"].split(":")[0])
    status, meta = call(sidecar.port, "POST", "/v1/materialize", {"plan": plan, "request": to_dict(req)})
    assert status == 200 and all("data" not in s for s in meta["states"]) and len(meta["states"]) == 8
    report = {"ok": False, "failed_block": 5, "tier": "dram", "reason": "engine could not mount it"}
    status, body = call(sidecar.port, "POST", "/v1/report", {"plan": plan, "report": report})
    assert status == 200 and body == {"recompute_from": 80}


def test_a_tampered_plan_loads_nothing(sidecar, kernel):
    req = make_request(range(128))
    commit_all(kernel, req)
    status, plan = call(sidecar.port, "POST", "/v1/plan", to_dict(req))
    plan["tenant"] = "chat"
    plan["spans"][0]["node"] = "elsewhere"  # the MAC covers where state is loaded from
    status, done = call(sidecar.port, "POST", "/v1/materialize", {"plan": plan, "request": to_dict(req)})
    assert status == 403 and "MAC does not check" in done["error"]  # as /v1/report answers it (issue 35)


def test_route_prices_each_node(sidecar, kernel):
    req = make_request(range(128))
    commit_all(kernel, req)
    nodes = [{"node": "n1", "waiting_requests": 0}, {"node": "n2", "queued_prefill_tokens": 100000}]
    status, body = call(sidecar.port, "POST", "/v1/route", {"request": to_dict(req), "nodes": nodes})
    assert status == 200 and body["node"] == "n1" and {o["node"] for o in body["options"]} == {"n1", "n2"}
    status, body = call(sidecar.port, "POST", "/v1/route", {"request": to_dict(req), "nodes": [{"node": "n1", "x": 1}]})
    assert status == 400 and body["problems"] == [{"path": "nodes[0].x", "problem": "unknown field"}]


def test_a_defect_in_the_kernel_still_answers_a_plan(sidecar, kernel, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(kernel, "plan", broken)
    status, body = call(sidecar.port, "POST", "/v1/plan", to_dict(make_request(range(64))))
    assert status == 200 and body["action"] == "recompute" and body["reasons"] == ["fail-open: sidecar: RuntimeError"]
    assert body["tokens_total"] == 64


def test_nexuskv_status_reads_a_sidecar_with_its_token_and_says_so_without(sidecar):
    """Issue 35: `nexuskv status` on a sidecar's URL answered a bare `HTTP 404 Not Found`."""
    import json as _json

    from click.testing import CliRunner

    from nexuskv.cli import cli

    url = f"http://127.0.0.1:{sidecar.port}"
    res = CliRunner().invoke(cli, ["status", url, "--json"])
    assert res.exit_code == 1 and "HTTP 404 Not Found (this is a NexusKV sidecar" in res.output, res.output
    assert "--token" in res.output
    res = CliRunner().invoke(cli, ["status", url, "--json", "--token", TOKENS["chat"]])
    assert res.exit_code == 1 and "HTTP 403" in res.output and "operator token" in res.output, res.output
    res = CliRunner().invoke(cli, ["status", url, "--json"], env={"NEXUSKV_TOKEN": TOKENS["*"]})
    assert res.exit_code == 0, res.output
    assert _json.loads(res.output.splitlines()[0])["node"] == "n1"


def test_status_health_and_the_openapi_document(sidecar, kernel):
    status, body = call(sidecar.port, "GET", "/v1/status", token=TOKENS["*"])
    assert status == 200 and body["node"] == "n1"
    status, body = call(sidecar.port, "GET", "/healthz", token=None)
    assert status == 200 and body == {"ok": True, "node": "n1", "control_ok": True}
    status, spec = call(sidecar.port, "GET", "/v1/openapi.json", token=None)
    assert status == 200 and spec == openapi()
    from nexuskv import Request, StateDescriptor

    for name, cls in (("Request", Request), ("Plan", Plan), ("StateDescriptor", StateDescriptor)):
        assert spec["components"]["schemas"][name] == json_schema(cls)  # the published contracts, verbatim
    routes = sidecar.app.paths
    assert routes <= set(spec["paths"]), routes - set(spec["paths"])


@pytest.mark.parametrize("path", ["/v1/plan", "/v1/commit", "/v1/materialize", "/v1/report", "/v1/route"])
def test_every_operation_wants_a_token(sidecar, path):
    status, body = call(sidecar.port, "POST", path, {}, token=None)
    assert status == 401 and body["error"].startswith("missing bearer token")


def stream_lines(port, path, token, out, ready):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    resp = conn.getresponse()
    out.append(resp.status)
    ready.set()
    for line in resp:  # chunked JSON lines until the server ends the stream
        out.append(json.loads(line))
    conn.close()


def test_decisions_stream_per_tenant(sidecar, kernel):
    chat, ops, ready_chat, ready_ops = [], [], threading.Event(), threading.Event()
    readers = [threading.Thread(target=stream_lines, args=(sidecar.port, "/v1/decisions?limit=3", TOKENS["chat"],
                                                           chat, ready_chat)),
               threading.Thread(target=stream_lines, args=(sidecar.port, "/v1/decisions?limit=5", TOKENS["*"],
                                                           ops, ready_ops))]  # fmt: skip
    for r in readers:
        r.start()
    assert ready_chat.wait(30) and ready_ops.wait(30)
    for i in range(5):
        tenant = "chat" if i % 2 == 0 else "rag"
        token = TOKENS[tenant]
        status, _ = call(sidecar.port, "POST", "/v1/plan", to_dict(make_request(range(64), tenant=tenant,
                                                                                request_id=f"s{i}")), token=token)
        assert status == 200
    for r in readers:
        r.join(30)
    assert chat[0] == 200 and [d["request_id"] for d in chat[1:]] == ["s0", "s2", "s4"]
    assert ops[0] == 200 and [d["request_id"] for d in ops[1:]] == ["s0", "s1", "s2", "s3", "s4"]
    assert {d["tenant"] for d in chat[1:]} == {"chat"}
    status, body = call(sidecar.port, "GET", "/v1/decisions?tenant=rag", token=TOKENS["chat"])
    assert status == 403
    status, body = call(sidecar.port, "GET", "/v1/decisions?limit=x", token=TOKENS["chat"])
    assert status == 400 and body["error"] == "limit: expected a non-negative integer, got 'x'"


def test_recent_decisions_then_the_stream_ends_at_the_limit(sidecar, kernel):
    for i in range(3):
        kernel.plan(make_request(range(32), request_id=f"old{i}"))
    deadline = time.monotonic() + 10
    while len(kernel.decision_log.recent()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    out, ready = [], threading.Event()
    stream_lines(sidecar.port, "/v1/decisions?recent=2&limit=2", TOKENS["chat"], out, ready)
    assert out[0] == 200 and [d["request_id"] for d in out[1:]] == ["old1", "old2"]


def test_metrics_are_scraped_with_the_operator_token(sidecar, kernel):
    for i in range(4):
        assert call(sidecar.port, "POST", "/v1/plan", to_dict(make_request(range(64), request_id=f"m{i}")))[0] == 200
    assert call(sidecar.port, "GET", "/metrics", token=TOKENS["chat"])[0] == 403
    conn = http.client.HTTPConnection("127.0.0.1", sidecar.port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKENS['*']}"})
    resp = conn.getresponse()
    text = resp.read().decode()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
    from prometheus_client.parser import text_string_to_metric_families

    plans = sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "nexuskv_plans_total")  # fmt: skip
    assert plans == kernel.decisions >= 4


def test_a_report_needs_a_sealed_plan_and_a_tier_it_reads(sidecar, kernel):
    req = make_request(range(128))
    commit_all(kernel, req)
    status, plan = call(sidecar.port, "POST", "/v1/plan", to_dict(req))
    forged = {**plan, "mac": "00" * 16}
    body = {"plan": forged, "report": {"ok": False, "tier": "dram", "timeout": True}}
    status, answer = call(sidecar.port, "POST", "/v1/report", body)
    assert status == 403 and "MAC does not check" in answer["error"]
    # issue 35: one answer for a forged plan on every endpoint (materialize answered 200 with a refusal reason)
    status, answer = call(sidecar.port, "POST", "/v1/materialize", {"plan": forged, "request": to_dict(req)})
    assert status == 403 and "MAC does not check" in answer["error"]
    assert kernel.health.snapshot().get("dram", {}).get("state", "closed") == "closed"  # no breaker moved
    for report, path in (({"ok": False, "tier": "bogus"}, "report.tier"), ({"ok": "no"}, "report.ok"),
                         ({"ok": False, "failed_block": -5}, "report.failed_block"),
                         ({"ok": False, "measured_ttft_ms": "abc"}, "report.measured_ttft_ms")):  # fmt: skip
        status, answer = call(sidecar.port, "POST", "/v1/report", {"plan": plan, "report": report})
        assert status == 400 and answer["problems"][0]["path"] == path, (report, answer)


def test_a_corrupt_report_with_its_request_quarantines_the_block(sidecar, kernel):
    from nexuskv import slot_of

    req = make_request(range(128))
    keys = commit_all(kernel, req)
    status, plan = call(sidecar.port, "POST", "/v1/plan", to_dict(req))
    store = kernel.tiers["dram"]  # the block really is bad: its bytes were replaced behind the kernel's back
    good = store.get(slot_of(keys[3]))
    store.delete(slot_of(keys[3]))
    assert store.put(slot_of(keys[3]), b"planted", good.descriptor)
    report = {"ok": False, "failed_block": 3, "tier": "dram", "corrupt": True, "reason": "bad bytes"}
    status, answer = call(sidecar.port, "POST", "/v1/report", {"plan": plan, "report": report, "request": to_dict(req)})
    assert status == 200 and answer == {"recompute_from": 48}
    assert kernel.load(keys[3]) is None and kernel.load(keys[2]) is not None  # dropped: never planned again


def test_a_reader_refused_by_materialize_cannot_quarantine_the_owners_shared_state(tmp_path):
    """Issue 29, finding 6: the report is authorised as the load would be, and a report alone deletes nothing."""
    import shutil

    from _sidecar_helpers import ROOT, SECRET

    from nexuskv import Kernel, KernelConfig
    from nexuskv_sidecar import Sidecar, SidecarConfig, digest

    policies = tmp_path / "policies"
    shutil.copytree(ROOT / "policies", policies)
    rag = policies / "tenants" / "rag.toml"
    old_when = "when = 'request.model.name == \"tiny-llama\"'"
    rag.write_text(rag.read_text().replace(old_when, "when = 'request.priority >= 1'"))
    cfg = KernelConfig(node="n1", policies=str(policies), deadline_ms=1000.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})  # fmt: skip
    with Kernel(cfg, secret=SECRET) as kernel, Sidecar(SidecarConfig(
            port=0, tokens={digest(t): tenant for tenant, t in TOKENS.items()}), kernel=kernel) as sc:  # fmt: skip
        docs = make_request(range(128), tenant="rag", scope="docs")
        owner_keys = commit_all(kernel, docs)
        granted = make_request(range(128 + 5), priority=1)  # chat, at the priority the owner's rule grants
        status, plan = call(sc.port, "POST", "/v1/plan", to_dict(granted))
        assert status == 200 and plan["namespace"]["tenant"] == "rag" and plan["tokens_reused"] == 128
        refused = make_request(range(128 + 5), priority=0)  # the same tokens and keys: not granted now
        status, got = call(sc.port, "POST", "/v1/materialize", {"plan": plan, "request": to_dict(refused)})
        assert status == 200 and got["tokens"] == 0 and got["reason"].startswith("refused")
        report = {"ok": False, "failed_block": 3, "tier": "dram", "corrupt": True, "reason": "bad bytes"}
        status, answer = call(sc.port, "POST", "/v1/report", {"plan": plan, "report": report,
                                                              "request": to_dict(refused)})  # fmt: skip
        assert status == 200 and answer == {"recompute_from": 0}  # refused: nothing changed
        assert kernel.load(owner_keys[3]) is not None
        assert kernel.plan(make_request(range(128 + 5), tenant="rag", scope="docs")).tokens_reused == 128


def test_commit_refuses_blocks_and_groups_the_request_does_not_have(sidecar):
    req = to_dict(make_request(range(64)))  # 4 full blocks, one group
    data = base64.b64encode(b"x" * 16).decode()
    for item, path in (({"block": 4, "data": data}, "payloads[0].block"), ({"block": 0, "group": 1, "data": data},
                       "payloads[0].group")):  # fmt: skip
        status, answer = call(sidecar.port, "POST", "/v1/commit", {"request": req, "payloads": [item]})
        assert status == 400 and answer["problems"][0]["path"] == path
    twice = [{"block": 1, "data": data}, {"block": 1, "group": 0, "data": data}]
    status, answer = call(sidecar.port, "POST", "/v1/commit", {"request": req, "payloads": twice})
    assert status == 400 and answer["error"] == "payloads[1]: block 1 group 0 given twice"


def test_node_states_are_typed(sidecar):
    req = to_dict(make_request(range(64)))
    status, answer = call(sidecar.port, "POST", "/v1/route", {"request": req, "nodes": [
        {"node": "n1", "overlap_loads": "no"}]})  # fmt: skip
    assert status == 400 and answer["problems"] == [{"path": "nodes[0].overlap_loads", "problem":
                                                     "expected bool, got string"}]  # fmt: skip


def test_the_token_is_checked_before_the_body_is_read(sidecar):
    conn = http.client.HTTPConnection("127.0.0.1", sidecar.port, timeout=30)
    conn.putrequest("POST", "/v1/plan")
    conn.putheader("Content-Length", "1000000")
    conn.endheaders()  # no body sent: the answer must come anyway
    resp = conn.getresponse()
    assert resp.status == 401 and json.loads(resp.read())["error"].startswith("missing bearer token")
    conn.close()


def test_streams_are_capped_and_end_when_the_sidecar_stops(kernel):
    from nexuskv_sidecar import Sidecar, SidecarConfig, digest
    from nexuskv_sidecar._stream import MAX_STREAMS

    cfg = SidecarConfig(port=0, tokens={digest(TOKENS["chat"]): "chat"})
    sc = Sidecar(cfg, kernel=kernel)
    sc.start()
    conns, answers = [], []
    for _ in range(MAX_STREAMS):
        conn = http.client.HTTPConnection("127.0.0.1", sc.port, timeout=30)
        conn.request("GET", "/v1/decisions", headers={"Authorization": f"Bearer {TOKENS['chat']}"})
        answers.append(conn.getresponse())
        assert answers[-1].status == 200
        conns.append(conn)
    status, answer = call(sc.port, "GET", "/v1/decisions")
    assert status == 429 and answer["error"] == f"{MAX_STREAMS} decision streams are open for this token already"
    status, answer = call(sc.port, "GET", "/v1/decisions?limit=%C2%B2")
    assert status == 400 and answer["error"] == "limit: expected a non-negative integer, got '²'"
    sc.close()  # the open streams end with the server, properly: the last chunk is sent, nothing is cut off
    assert [a.read() for a in answers] == [b""] * MAX_STREAMS
    for conn in conns:
        conn.close()


def test_a_plan_is_reported_once_and_nodes_are_named_once(sidecar, kernel):
    req = make_request(range(128))
    commit_all(kernel, req)
    status, plan = call(sidecar.port, "POST", "/v1/plan", to_dict(req))
    body = {"plan": plan, "report": {"ok": False, "failed_block": 2, "tier": "dram", "timeout": True}}
    assert call(sidecar.port, "POST", "/v1/report", body)[0] == 200
    status, answer = call(sidecar.port, "POST", "/v1/report", body)  # resent: a shared breaker moves once
    assert status == 409 and answer["error"] == f"plan {plan['decision_id']} was reported already"
    nodes = [{"node": "n1"}, {"node": "n1", "waiting_requests": 3}]
    status, answer = call(sidecar.port, "POST", "/v1/route", {"request": to_dict(req), "nodes": nodes})
    assert status == 400 and answer["error"] == "nodes[1]: node 'n1' is given twice"


def test_head_answers_like_get(sidecar):
    conn = http.client.HTTPConnection("127.0.0.1", sidecar.port, timeout=30)
    conn.request("HEAD", "/healthz")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b"" and int(resp.getheader("content-length")) > 0
    conn.close()


def test_plan_bodies_tokens_and_deadlines_are_capped_each_with_a_clear_4xx():
    """Issue 29, finding 3: a 50 MB body and a deadline of hours were planned; each is now refused before any work."""
    from nexuskv import Kernel, KernelConfig
    from nexuskv_sidecar import Sidecar, SidecarConfig, digest

    cfg = SidecarConfig(port=0, tokens={digest(t): tenant for tenant, t in TOKENS.items()},
                        max_plan_body_bytes=64 << 10, max_tokens=4096, max_deadline_ms=50.0)  # fmt: skip
    kcfg = KernelConfig(node="n1", max_deadline_ms=50.0, tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})
    with Kernel(kcfg, secret=SECRET) as kernel, Sidecar(cfg, kernel=kernel) as sc:
        status, body = call(sc.port, "POST", "/v1/plan", raw=b"x" * ((64 << 10) + 1))
        assert status == 413 and "over the limit of 65536" in body["error"]
        status, body = call(sc.port, "POST", "/v1/plan", to_dict(make_request(range(4097))))
        assert status == 400 and "4097 tokens, over the limit of 4096" in body["error"]
        slow = to_dict(make_request(range(64)))
        slow["slo"] = {"deadline_ms": 3_600_000}
        status, body = call(sc.port, "POST", "/v1/plan", slow)
        assert status == 400 and "slo.deadline_ms 3.6e+06 is over the limit of 50" in body["error"]
        status, body = call(sc.port, "POST", "/v1/route", {"request": slow, "nodes": [{"node": "n1"}]})
        assert status == 400 and "over the limit of 50" in body["error"]
        slow["slo"] = {"deadline_ms": 20}
        assert call(sc.port, "POST", "/v1/plan", slow)[0] == 200  # within every limit: planned


def test_one_tenants_slow_plans_never_hold_the_loop_for_another(kernel, monkeypatch):
    """Plans run on the pool, a few per token at a time: a tenant whose plans hang cannot delay another's."""
    from nexuskv_sidecar import Sidecar, SidecarConfig, digest

    gate, real_plan = threading.Event(), kernel.plan

    def plan(req, **kw):
        if req.tenant == "rag":
            gate.wait(30)  # this tenant's plans hang (a huge request, a slow plugin)
        return real_plan(req, **kw)

    monkeypatch.setattr(kernel, "plan", plan)
    cfg = SidecarConfig(port=0, tokens={digest(t): tenant for tenant, t in TOKENS.items()}, tenant_concurrency=2)
    with Sidecar(cfg, kernel=kernel) as sc:
        stuck = [threading.Thread(target=call, args=(sc.port, "POST", "/v1/plan",
                                                     to_dict(make_request(range(64), tenant="rag"))),
                                  kwargs={"token": TOKENS["rag"]}, daemon=True) for _ in range(6)]  # fmt: skip
        for t in stuck:
            t.start()
        time.sleep(0.2)
        try:
            for _ in range(5):  # answered while six of the other tenant's plans hang (two on the pool, four waiting)
                status, body = call(sc.port, "POST", "/v1/plan", to_dict(make_request(range(64))))
                assert status == 200 and body["tenant"] == "chat"
            assert not gate.is_set()
        finally:
            gate.set()
        for t in stuck:
            t.join(30)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=40,
)
_FIELDS = ("request_id", "tenant", "model", "tokenizer", "layout", "token_ids", "slo", "plan", "request", "report",
           "nodes", "payloads", "scope", "cache_salt")  # fmt: skip


def _dumps(value):
    return json.dumps(value).encode()


def _mutated_request(change):
    """A valid request with one field set to anything (a plan body, and a route / commit body around it)."""
    field, value = change
    req = {**to_dict(make_request(range(64))), field: value}
    return _dumps({"request": req, "nodes": [{"node": "n1"}], "payloads": []} if field in ("plan", "report") else req)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/plan", "/v1/route", "/v1/commit", "/v1/materialize", "/v1/report"]),
       body=st.one_of(st.binary(max_size=300), _JSON.map(_dumps),
                      st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=6).map(_dumps),
                      st.tuples(st.sampled_from(_FIELDS), _JSON).map(_mutated_request)))
def test_fuzzed_bodies_get_a_clear_4xx_or_an_answer_never_a_500(sidecar, path, body):  # fmt: skip
    """Issue 29, build 8: whatever a caller sends to any operation, the answer is a 2xx or a 4xx with a message."""
    status, answer = call(sidecar.port, "POST", path, raw=body)
    assert status in (200, 400, 403, 409, 413, 422), (status, answer)
    if status != 200:
        assert isinstance(answer, dict) and answer.get("error"), answer
