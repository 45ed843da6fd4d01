"""The tenant gateway attacked directly (ASGI, no server): a client never chooses its tenant, whatever it sends;
unknown keys, huge bodies and malformed ones are refused before vLLM sees them; a bad keys file names itself."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nexuskv_vllm.gateway import KeysFile, TenantGateway, key_digest, tenant_salt

from nexuskv import ConfigError


@pytest.fixture
def keys(tmp_path) -> KeysFile:
    path = tmp_path / "keys.toml"
    path.write_text(f"""
max_body_bytes = 4096
[keys.{key_digest("key-a")}]
tenant = "acme"
scope = "support"
[keys.{key_digest("key-b")}]
tenant = "globex"
""")
    return KeysFile(path)


def _call(gateway_keys: KeysFile, path: str, body: bytes, headers: dict[str, str] | None = None,
          chunk: int = 0, method: str = "POST") -> tuple[int, dict | None]:  # fmt: skip
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


def test_the_tenant_salts_vllms_own_prefix_cache_and_a_client_cannot_pick_anothers_salt(keys):
    """vLLM's prefix cache keys blocks by tokens and salt: the gateway makes the salt the tenant's."""
    _, a = _call(keys, "/v1/chat/completions", _chat(), {"authorization": "Bearer key-a"})
    _, b = _call(keys, "/v1/chat/completions", _chat(cache_salt=a["cache_salt"]), {"authorization": "Bearer key-b"})
    _, b2 = _call(keys, "/v1/chat/completions", _chat(), {"authorization": "Bearer key-b"})
    assert a["cache_salt"] == tenant_salt("acme", "support", None)
    assert len({a["cache_salt"], b["cache_salt"], b2["cache_salt"]}) == 3  # replaying acme's salt gets another


@pytest.mark.parametrize("auth", [None, "Bearer nope", "key-a", "Basic key-a", "Bearer "])
def test_a_generation_request_without_a_known_key_never_reaches_vllm(keys, auth):
    status, body = _call(keys, "/v1/chat/completions", _chat(), {"authorization": auth} if auth else {})
    assert status == 401 and body is None


def test_open_posts_pass_without_a_key_but_lose_any_kv_transfer_params(keys):
    forged = json.dumps({"prompt": "w3", "kv_transfer_params": {"tenant": "a"}, "cache_salt": "x"}).encode()
    status, body = _call(keys, "/tokenize", forged)
    assert status == 200 and "kv_transfer_params" not in body and "cache_salt" not in body


@pytest.mark.parametrize("path", ["/v1/messages", "/invocations", "/inference/v1/generate", "/cohere/v2/chat",
                                  "/pooling", "/some/endpoint/of/a/later/vllm"])  # fmt: skip
def test_every_endpoint_not_allow_listed_needs_a_key_and_gets_the_keys_tenant(keys, path):
    forged = _chat(kv_transfer_params={"tenant": "acme"}, cache_salt=tenant_salt("acme", "support", None))
    assert _call(keys, path, forged, {"content-type": "Application/JSON"}) == (401, None)
    status, body = _call(keys, path, forged, {"authorization": "Bearer key-b", "content-type": "Application/JSON"})
    assert status == 200 and body["kv_transfer_params"] == {"tenant": "globex"}
    assert body["cache_salt"] == tenant_salt("globex", "", tenant_salt("acme", "support", None))


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_a_keyed_post_that_is_not_json_is_refused(keys, media):
    status, body = _call(keys, "/v1/completions", _chat(), {"authorization": "Bearer key-a", "content-type": media})
    assert status == 415 and body is None


def test_open_gets_pass_and_other_gets_need_a_key(keys):
    assert _call(keys, "/metrics", b"", method="GET")[0] == 200
    assert _call(keys, "/v1/responses/resp_123", b"", method="GET") == (401, None)


@pytest.mark.parametrize(("body", "status"), [(b"x" * 5000, 413), (b"[1, 2]", 400), (b"{not json", 400)])
def test_huge_and_malformed_bodies_are_refused(keys, body, status):
    assert _call(keys, "/v1/chat/completions", body, {"authorization": "Bearer key-a"}, chunk=1000) == (status, None)


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
    (f'[keys.{key_digest("k")}]\ntenant = "a"\nrole = "admin"', "optionally 'scope'"),
    ("tenants = 1", "unknown field"),
    ("", "no keys"),
    ("max_body_bytes = -1\n[keys.x]", "max_body_bytes"),
    ("[keys", "keys.toml"),
])  # fmt: skip
def test_a_bad_keys_file_is_refused_with_its_name_and_problem(tmp_path, text, problem):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem) as err:
        KeysFile(path)
    assert str(path) in str(err.value)
