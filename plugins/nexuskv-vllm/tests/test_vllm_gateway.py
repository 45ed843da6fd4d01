"""The tenant gateway attacked directly (ASGI, no server): a client never chooses its tenant or its salt, whatever
it sends; unknown keys, operator routes, salt-dropping routes, WebSockets, huge, slow, deep and malformed bodies are
refused before vLLM sees them; a bad keys file names itself."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nexuskv_vllm.gateway import KeysFile, TenantGateway, key_digest, tenant_salt

from nexuskv import ConfigError

SALT_KEY = "5a" * 32


@pytest.fixture
def keys(tmp_path) -> KeysFile:
    path = tmp_path / "keys.toml"
    path.write_text(f"""
salt_key = "{SALT_KEY}"
max_body_bytes = 4096
body_timeout_s = 0.5
[keys.{key_digest("key-a")}]
tenant = "acme"
scope = "support"
[keys.{key_digest("key-b")}]
tenant = "globex"
[keys.{key_digest("key-ops")}]
tenant = "ops"
admin = true
""")
    return KeysFile(path)


def salt(tenant: str, scope: str, client: object = None) -> str:
    return tenant_salt(tenant, scope, client, bytes.fromhex(SALT_KEY))


def _call(gateway_keys: KeysFile, path: str, body: bytes, headers: dict[str, str] | None = None,
          chunk: int = 0, method: str = "POST", stall_s: float = 0.0) -> tuple[int, dict | None]:  # fmt: skip
    """(status, the JSON body vLLM received or None when the gateway answered itself)."""
    seen: dict = {}

    async def app(scope, receive, send):
        got = b""
        while True:
            m = await receive()
            got += m.get("body", b"")
            if not m.get("more_body"):
                break
        hdrs = dict(scope["headers"])
        assert int(hdrs[b"content-length"]) == len(got)
        seen["body"] = json.loads(got) if got else {}
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        if stall_s and len(messages) == 1:  # a slow client: the last chunk comes late
            await asyncio.sleep(stall_s)
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    hdrs = {"content-type": "application/json", "content-length": str(len(body)), **(headers or {})}
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()]}  # fmt: skip
    asyncio.run(TenantGateway(app, keys=gateway_keys)(scope, receive, send))
    return sent[0]["status"], seen.get("body")


def _chat(**extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "w3 w4"}], **extra}).encode()


def test_the_key_decides_the_tenant_and_the_clients_own_params_are_dropped(keys):
    forged = _chat(kv_transfer_params={"tenant": "globex", "scope": "x"})
    status, body = _call(keys, "/v1/chat/completions", forged, {"authorization": "Bearer key-a"})
    assert status == 200 and body["kv_transfer_params"] == {"tenant": "acme", "scope": "support"}
    status, body = _call(keys, "/v1/completions", _chat(), {"authorization": "Bearer key-b"}, chunk=7)
    assert status == 200 and body["kv_transfer_params"] == {"tenant": "globex"}


def test_a_sealed_grant_is_kept_and_nothing_else_a_client_says_about_state(keys, monkeypatch):
    """A P/D proxy's `nexuskv_handoff` passes (the engine checks it); anything else in the params, a grant that is
    not an object, or one larger than any engine issues, is dropped here."""
    grant = {"v": 1, "node": "prefill-1", "mac": "0" * 32}
    cases = [({"nexuskv_handoff": grant}, grant), ({"nexuskv_handoff": grant, "tenant": "globex"}, grant),
             ({"nexuskv_handoff": "x"}, None), ({"nexuskv_handoff": [grant]}, None),
             ({"nexuskv_handoff": {"pad": "x" * 300}}, None)]  # fmt: skip
    monkeypatch.setattr("nexuskv_vllm.gateway.GRANT_MAX_BYTES", 200)  # under this fixture's body bound
    for params, kept in cases:
        body_in = _chat(kv_transfer_params=params)
        status, body = _call(keys, "/v1/completions", body_in, {"authorization": "Bearer key-a"})
        want = {"tenant": "acme", "scope": "support", **({"nexuskv_handoff": kept} if kept else {})}
        assert status == 200 and body["kv_transfer_params"] == want, params


def test_the_tenant_salts_vllms_own_prefix_cache_and_a_client_cannot_pick_anothers_salt(keys):
    """vLLM's prefix cache keys blocks by tokens and salt: the gateway makes the salt the tenant's."""
    _, a = _call(keys, "/v1/chat/completions", _chat(), {"authorization": "Bearer key-a"})
    _, b = _call(keys, "/v1/chat/completions", _chat(cache_salt=a["cache_salt"]), {"authorization": "Bearer key-b"})
    _, b2 = _call(keys, "/v1/chat/completions", _chat(), {"authorization": "Bearer key-b"})
    assert a["cache_salt"] == salt("acme", "support")
    assert len({a["cache_salt"], b["cache_salt"], b2["cache_salt"]}) == 3  # replaying acme's salt gets another
    assert a["cache_salt"] != tenant_salt("acme", "support", None, b"\0" * 32)  # keyed: the name is not enough


@pytest.mark.parametrize("auth", [None, "Bearer nope", "key-a", "Basic key-a", "Bearer "])
def test_a_generation_request_without_a_known_key_never_reaches_vllm(keys, auth):
    status, body = _call(keys, "/v1/chat/completions", _chat(), {"authorization": auth} if auth else {})
    assert status == 401 and body is None


def test_tokenize_needs_a_key_and_only_loses_the_fields(keys):
    forged = json.dumps({"prompt": "w3", "kv_transfer_params": {"tenant": "a"}, "cache_salt": "x"}).encode()
    assert _call(keys, "/tokenize", forged) == (401, None)
    status, body = _call(keys, "/tokenize", forged, {"authorization": "Bearer key-b"})
    assert status == 200 and "kv_transfer_params" not in body and "cache_salt" not in body


@pytest.mark.parametrize("path", ["/v1/messages", "/invocations", "/inference/v1/generate", "/pooling",
                                  "/v1/embeddings", "/score"])  # fmt: skip
def test_every_tenant_route_needs_a_key_and_gets_the_keys_tenant(keys, path):
    forged = _chat(kv_transfer_params={"tenant": "acme"}, cache_salt=salt("acme", "support"))
    assert _call(keys, path, forged, {"content-type": "Application/JSON"}) == (401, None)
    status, body = _call(keys, path, forged, {"authorization": "Bearer key-b", "content-type": "Application/JSON"})
    assert status == 200 and body["kv_transfer_params"] == {"tenant": "globex"}
    assert body["cache_salt"] == salt("globex", "", salt("acme", "support"))


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"), ("POST", "/sleep"), ("POST", "/update_weights"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/scale_elastic_ep"), ("GET", "/kv_event_sources"),
    ("GET", "/server_info"), ("POST", "/some/endpoint/of/a/later/vllm")])  # fmt: skip
def test_operator_routes_and_routes_a_later_vllm_adds_need_an_admin_key(keys, method, path):
    assert _call(keys, path, _chat(), method=method) == (401, None)
    assert _call(keys, path, _chat(), {"authorization": "Bearer key-a"}, method=method) == (403, None)
    status, body = _call(keys, path, _chat(kv_transfer_params={"tenant": "acme"}),
                         {"authorization": "Bearer key-ops"}, method=method)  # fmt: skip
    assert status == 200
    assert method == "GET" or body["kv_transfer_params"] == {"tenant": "ops"}  # an operator is a tenant too


@pytest.mark.parametrize("auth", ["Bearer key-a", "Bearer key-ops"])
@pytest.mark.parametrize("path", ["/cohere/v2/chat", "/v2/embed"])
def test_a_route_that_drops_the_salt_is_refused_to_every_key(keys, auth, path):
    assert _call(keys, path, _chat(), {"authorization": auth}) == (403, None)


def test_only_a_stored_response_and_its_cancel_are_tenant_routes_under_v1_responses(keys):
    tenant = {"authorization": "Bearer key-b"}
    assert _call(keys, "/v1/responses/resp_1", b"", tenant, method="DELETE")[0] == 200
    assert _call(keys, "/v1/responses/resp_1/cancel", b"{}", tenant)[0] == 200
    assert _call(keys, "/v1/responses/render", b"{}", tenant) == (403, None)  # a POST route, not a stored one
    assert _call(keys, "/v1/responses/resp_1/later/route", b"", tenant, method="GET") == (403, None)


def test_websockets_are_closed_unanswered(keys):
    """vLLM's /v1/realtime builds engine requests without the tenant's salt: no WebSocket gets through."""
    sent: list[dict] = []
    reached = []

    async def app(scope, receive, send):
        reached.append(scope)

    async def receive():
        return {"type": "websocket.connect"}

    async def send(m):
        sent.append(m)

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": [(b"authorization", b"Bearer key-a")]}
    asyncio.run(TenantGateway(app, keys=keys)(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}] and not reached


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_a_keyed_post_that_is_not_json_is_refused(keys, media):
    status, body = _call(keys, "/v1/completions", _chat(), {"authorization": "Bearer key-a", "content-type": media})
    assert status == 415 and body is None


def test_open_gets_pass_and_other_gets_need_a_key(keys):
    assert _call(keys, "/metrics", b"", method="GET")[0] == 200
    assert _call(keys, "/v1/responses/resp_123", b"", method="GET") == (401, None)
    assert _call(keys, "/v1/responses/resp_123", b"", {"authorization": "Bearer key-b"}, method="GET")[0] == 200


@pytest.mark.parametrize(("body", "status"), [(b"x" * 5000, 413), (b"[1, 2]", 400), (b"{not json", 400),
                                            (b'{"a": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400)])  # fmt: skip
def test_huge_deep_and_malformed_bodies_are_refused(keys, body, status):
    assert _call(keys, "/v1/chat/completions", body, {"authorization": "Bearer key-a"}, chunk=1000) == (status, None)


def test_a_body_not_read_within_the_timeout_is_refused(keys):
    """A slow client (slowloris on the body) gets 408 after body_timeout_s, not an open-ended wait."""
    status, body = _call(keys, "/v1/chat/completions", _chat(), {"authorization": "Bearer key-a"}, chunk=10,
                         stall_s=5.0)  # fmt: skip
    assert (status, body) == (408, None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.dictionaries(st.text(max_size=20), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_size=5))  # fmt: skip
def test_whatever_a_client_sends_its_tenant_is_its_keys(keys, extra):
    status, body = _call(keys, "/v1/chat/completions", _chat(**extra), {"authorization": "Bearer key-b"})
    assert status == 200 and body["kv_transfer_params"] == {"tenant": "globex"}


@pytest.mark.parametrize(("text", "problem"), [
    ('[keys.key-a]\ntenant = "acme"', "not a SHA-256 hex digest"),
    (f'[keys.{key_digest("k")}]\ntenant = ""', "non-empty string"),
    (f'[keys.{key_digest("k")}]\ntenant = "a"\nrole = "admin"', "optionally 'scope' and 'admin'"),
    (f'[keys.{key_digest("k")}]\ntenant = "a"\nadmin = "yes"', "'admin' must be true or false"),
    ("tenants = 1", "unknown field"),
    ("", "no keys"),
    ("max_body_bytes = -1\n[keys.x]", "max_body_bytes"),
    ("body_timeout_s = 0\n[keys.x]", "body_timeout_s"),
    ("[keys", "keys.toml"),
])  # fmt: skip
def test_a_bad_keys_file_is_refused_with_its_name_and_problem(tmp_path, text, problem):
    path = tmp_path / "keys.toml"
    path.write_text(f'salt_key = "{SALT_KEY}"\n{text}')
    with pytest.raises(ConfigError, match=problem) as err:
        KeysFile(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("line", "problem"), [
    ("", "salt_key is missing"), ('salt_key = "abcd"', "64 to 128 hex digits"),
    ('salt_key = "' + "zz" * 32 + '"', "64 to 128 hex digits"), ("salt_key = 5", "64 to 128 hex digits")])
def test_the_salt_key_is_required_and_checked(tmp_path, line, problem):
    path = tmp_path / "keys.toml"
    path.write_text(f'{line}\n[keys.{key_digest("k")}]\ntenant = "a"\n')
    with pytest.raises(ConfigError, match=problem):
        KeysFile(path)


def test_namespaces_name_each_tenant_and_scope_by_its_salt(keys):
    ns = keys.namespaces()
    assert ns[salt("acme", "support")].tenant == "acme" and ns[salt("acme", "support")].scope == "support"
    assert {n.tenant for n in ns.values()} == {"acme", "globex", "ops"}
    assert all(n.cache_salt == s for s, n in ns.items())
