"""Prefill/decode disaggregation with two real `vllm serve` engines and the P/D proxy, over HTTP on this machine.

The prefill engine (`kv_producer`) runs in a network namespace behind a veth pair (when this machine allows it), so
the link its state crosses can be shaped with tbf; the decode engine (`kv_consumer`) and the proxy run here. Both
engines run the tenant gateway with one keys file. Greedy outputs of the P/D path equal one engine alone on the same
token ids; a shaped link makes the decode engine recompute, by its measured estimate of that link; a forged grant,
a corrupt payload, a hung or killed prefill engine and a decode engine killed mid-answer each end with a correct
answer or a clean error. The tests run in file order: the last ones kill the engines.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest
from nexuskv_vllm.gateway import key_digest
from nexuskv_vllm.pd_testing import Proxy, Served, complete, pd_decisions, pd_kernel_toml, stream_complete
from nexuskv_vllm.testing import connector_config
from nexuskv_vllm.testing import tokens as prompt

from conftest import prom_counters, run_engine
from nexuskv.testing.netns import NetNS
from tests.conftest import wait_for

pytestmark = pytest.mark.slow

KEY = "key-a"


@pytest.fixture(scope="module")
def pd(workdir, model_dir, kernel_toml):
    root = workdir / "pd"
    root.mkdir()
    keys = root / "keys.toml"
    keys.write_text(f'salt_key = "{os.urandom(32).hex()}"\n[keys.{key_digest(KEY)}]\ntenant = "acme"\n'
                    f'[keys.{key_digest("key-b")}]\ntenant = "globex"\n')  # fmt: skip
    why = NetNS.available()
    ns = NetNS("nxkvpd", "10.231.9") if not why else None
    host = ns.ns_ip if ns else "127.0.0.1"
    common = dict(policies=workdir / "policies", secret_file=workdir / "secret")
    p_toml = pd_kernel_toml(root / "prefill.toml", "prefill-1", tier_dir=root / "p-disk", host=host, **common)
    d_toml = pd_kernel_toml(root / "decode.toml", "decode-1", tier_dir=root / "d-disk", **common)
    producer = Served(model_dir, root / "prefill.log", host=host, keys_file=keys, prefix=ns.prefix() if ns else (),
                      kv_transfer_config=connector_config(p_toml, tenant=None) | {"kv_role": "kv_producer"},
                      env={"NEXUSKV_DEADLINE_MS": "10000"})  # fmt: skip
    def start_consumer(port: int | None = None) -> Served:
        return Served(model_dir, root / "decode.log", keys_file=keys, port=port,
                      kv_transfer_config=connector_config(d_toml, tenant=None) | {"kv_role": "kv_consumer"},
                      env={"NEXUSKV_DEADLINE_MS": "10000"})  # fmt: skip

    state = {"producer": producer, "consumer": start_consumer(), "proxy": None, "ns": ns, "why_no_ns": why,
             "model": str(model_dir), "root": root, "start_consumer": start_consumer}  # fmt: skip
    try:
        producer.wait()
        state["consumer"].wait()
        state["proxy"] = Proxy([("prefill-1", producer.url)], [("decode-1", state["consumer"].url)],
                               root / "proxy.log", prefill_timeout_s=30.0, cooldown_s=2.0).wait()  # fmt: skip
        yield state
    finally:
        for name in ("proxy", "consumer", "producer"):  # the consumer may have been restarted: the live one
            if state[name] is not None:
                state[name].close()
        if ns is not None:
            ns.close()


def body(pd, ids: list[int], max_tokens: int = 8, **extra) -> dict:
    return {"model": pd["model"], "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, **extra}  # fmt: skip


def decisions(pd) -> list[dict]:
    """The decode engine's `P/D decision` log lines, in order."""
    return pd_decisions(pd["consumer"].log_text())


def reference(workdir, model_dir, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    return run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": None,
                                "requests": [{"tokens": t, "max_tokens": max_tokens} for t in prompts]})["outputs"]


def by_hand(pd, ids: list[int]) -> dict:
    """The proxy's first step, done by the test: prefill on the producer, return its grant."""
    status, pre = complete(pd["producer"].url + "/v1/completions", KEY, body(pd, ids, max_tokens=1))
    assert status == 200, pre
    grant = (pre.get("kv_transfer_params") or {}).get("nexuskv_handoff")
    assert grant is not None and grant["node"] == "prefill-1", pre
    return grant


def decode(pd, ids: list[int], grant: dict | None, key: str = KEY) -> tuple[int, dict]:
    extra = {"kv_transfer_params": {"nexuskv_handoff": grant}} if grant is not None else {}
    return complete(pd["consumer"].url + "/v1/completions", key, body(pd, ids, **extra))


PROMPTS = [prompt(1000, 60 + i) for i in range(3)]


def test_the_pd_path_equals_one_engine_alone_and_moves_the_state(pd, workdir, model_dir):
    outs = []
    for ids in PROMPTS:
        status, got = complete(pd["proxy"].url + "/v1/completions", KEY, body(pd, ids))
        assert status == 200, got
        assert "kv_transfer_params" not in got  # the grant stays between the proxy and the engines
        outs.append(got["choices"][0]["token_ids"])
    streamed = stream_complete(pd["proxy"].url + "/v1/completions", KEY, body(pd, prompt(1000, 70)))
    assert streamed[0] == 200 and streamed[2][-1] == {"done": True}
    assert outs == reference(workdir, model_dir, PROMPTS)
    got = decisions(pd)
    assert [d["decision"] for d in got] == ["transfer"] * 4, got
    assert all(d["producers"] == ["prefill-1"] and d["tokens_reused"] == 7 * 128 for d in got)
    stats = proxy_stats(pd)
    assert stats["proxy"]["pd"] == stats["proxy"]["grants"] == stats["engines"]["prefill-1"]["prefills"] == 4
    assert complete(pd["proxy"].url + "/v1/completions", None, body(pd, PROMPTS[0]))[0] == 401  # the gateway's
    consumer = pd["consumer"].url
    assert wait_for(lambda: prom_counters(consumer).get("pd_transfers", 0) >= 4, 30), prom_counters(consumer)
    got = prom_counters(consumer)
    assert got.get("pd_grants_accepted") == 4 and "pd_grants_refused" not in got
    assert wait_for(lambda: prom_counters(pd["producer"].url).get("pd_grants_issued", 0) >= 4, 30)


def proxy_stats(pd) -> dict:
    with urllib.request.urlopen(pd["proxy"].url + "/pd/stats", timeout=10) as r:
        return json.loads(r.read())


def test_a_grant_is_worth_nothing_to_another_tenant_or_when_forged(pd, workdir, model_dir):
    ids = prompt(1000, 80)
    grant = by_hand(pd, ids)
    n = len(decisions(pd))
    forged = dict(grant, address="127.0.0.1:1")  # a redirect to an attacker's server
    status, a = decode(pd, ids, forged)
    status_b, b = decode(pd, ids, grant, key="key-b")  # another tenant replays acme's grant
    assert (status, status_b) == (200, 200)
    assert len(decisions(pd)) == n  # neither was accepted: no P/D decision was made
    log = pd["consumer"].log_text()
    assert log.count("handoff refused") >= 2 and "MAC does not check" in log
    assert [a["choices"][0]["token_ids"], b["choices"][0]["token_ids"]] == reference(workdir, model_dir, [ids, ids])


def test_a_corrupt_payload_on_the_producer_means_recompute_with_the_right_answer(pd, workdir, model_dir):
    ids = prompt(1000, 90)
    before = {p: p.stat().st_mtime_ns for p in (pd["root"] / "p-disk").rglob("*") if p.is_file()}
    grant = by_hand(pd, ids)
    new = [p for p in (pd["root"] / "p-disk").rglob("*") if p.is_file() and p.stat().st_mtime_ns != before.get(p)]
    assert new, "the prefill engine wrote no block file"
    for path in new:  # bit rot behind the producer's back, in every block this prompt wrote
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    status, got = decode(pd, ids, grant)
    assert status == 200 and got["choices"][0]["token_ids"] == reference(workdir, model_dir, [ids])[0]


def test_a_hung_prefill_engine_after_its_answer_means_recompute_in_bounded_time(pd, workdir, model_dir):
    ids = prompt(1000, 110)
    grant = by_hand(pd, ids)
    pd["producer"].pause()  # the transfer hangs: its server takes the connection and never answers
    try:
        t0 = time.monotonic()
        status, got = decode(pd, ids, grant)
        took = time.monotonic() - t0
    finally:
        pd["producer"].resume()
    assert status == 200 and got["choices"][0]["token_ids"] == reference(workdir, model_dir, [ids])[0]
    assert decisions(pd)[-1]["decision"] == "transfer"  # it tried: the producer hung under the fetch
    assert "timed out" in pd["consumer"].log_text().rsplit("P/D decision", 1)[1]
    assert took < 30, took  # the load gave up (load_timeout_ms) instead of holding the request


def test_a_shaped_link_makes_the_decode_engine_recompute_by_its_measured_estimate(pd):
    if pd["ns"] is None:
        pytest.skip(f"no shaped link here: {pd['why_no_ns']}")
    pd["ns"].shape("16mbit")
    try:
        n = len(decisions(pd))
        for i in range(3):
            status, got = complete(pd["proxy"].url + "/v1/completions", KEY, body(pd, prompt(1000, 100 + i)))
            assert status == 200, got
        made = decisions(pd)[n:]
    finally:
        pd["ns"].shape(None)
    # the first transfer crosses the shaped link and is measured; the decode engine then recomputes
    assert [d["decision"] for d in made] == ["transfer", "recompute", "recompute"], made
    assert any("recompute" in r or "gain" in r for r in made[1]["reasons"]), made[1]


def test_a_decode_engine_killed_mid_answer_ends_the_stream_with_an_error_not_a_hang(pd, workdir, model_dir):
    t0 = time.monotonic()
    status, _, events = stream_complete(pd["proxy"].url + "/v1/completions", KEY,
                                        body(pd, prompt(300, 130), max_tokens=2000, ignore_eos=True),
                                        on_first=pd["consumer"].kill)  # fmt: skip
    assert status == 200 and time.monotonic() - t0 < 60
    assert any("error" in e for e in events) and events[-1] == {"done": True}, events[-3:]
    # the decode engine is dead before it answers the next request (past the proxy's cooldown, so the proxy tries
    # it and gets a refused connection): the prefill engine does both
    time.sleep(2.5)
    ids = prompt(1000, 131)
    status, got = complete(pd["proxy"].url + "/v1/completions", KEY, body(pd, ids), timeout_s=120)
    assert status == 200 and got["choices"][0]["token_ids"] == reference(workdir, model_dir, [ids])[0]
    stats = proxy_stats(pd)
    assert stats["proxy"]["broken_streams"] == 1 and stats["proxy"]["fallback_decode"] >= 1
    assert stats["engines"]["prefill-1"]["both"] >= 1
    old = pd["consumer"]
    pd["consumer"] = pd["start_consumer"](old.port).wait()  # back on its port, its link estimates fresh
    time.sleep(2.5)  # past the proxy's cooldown for it


def test_a_killed_prefill_engine_means_recompute_and_then_the_decode_engine_does_both(pd, workdir, model_dir):
    ids, later = prompt(1000, 120), prompt(1000, 121)
    grant = by_hand(pd, ids)
    pd["producer"].kill()
    status, got = decode(pd, ids, grant)
    assert decisions(pd)[-1]["decision"] == "transfer"  # a fresh decode engine tried the dead producer
    status2, got2 = complete(pd["proxy"].url + "/v1/completions", KEY, body(pd, later))  # prefill fails over
    assert (status, status2) == (200, 200), got2
    assert [got["choices"][0]["token_ids"], got2["choices"][0]["token_ids"]] == \
        reference(workdir, model_dir, [ids, later])  # fmt: skip
    stats = proxy_stats(pd)
    assert stats["proxy"]["fallback_prefill"] >= 1 and stats["engines"]["decode-1"]["both"] >= 1


def test_every_engine_gone_is_a_clean_error_at_once(pd):
    pd["consumer"].kill()
    assert not pd["producer"].alive() and not pd["consumer"].alive()
    t0 = time.monotonic()
    status, got = complete(pd["proxy"].url + "/v1/completions", KEY, body(pd, prompt(300, 140)), timeout_s=60)
    assert status in (502, 503) and got["error"]["type"] == "pd_proxy_error" and time.monotonic() - t0 < 30
