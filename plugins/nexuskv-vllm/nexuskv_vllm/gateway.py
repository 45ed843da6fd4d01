"""`TenantGateway`: the ASGI middleware that makes `vllm serve` say, for every request, which tenant it is.

The connector takes a request's tenant from `kv_transfer_params`, a field of vLLM's request bodies; a client must
never choose it. This middleware runs inside `vllm serve` (`--middleware nexuskv_vllm.gateway.TenantGateway`) and
works by allow-list, since a route added in a later vLLM must not be an open door:

- `OPEN_GET` pass without a key: GET `/health`, `/ping`, `/version`, `/metrics`, `/v1/models`, `/load`;
- every other request needs an API key (`Authorization: Bearer <key>`) listed in the keys file, else 401;
- a tenant's key reaches the routes that serve tenants (`TENANT_POST`, `TENANT_GET`, `/v1/responses/{id}` and
  its `/cancel`);
  every other route (vLLM's operator routes: `/reset_prefix_cache`, `/collective_rpc`, `/sleep`, weight
  updates, `/kv_event_sources`, ... and any route a later vLLM adds) needs a key with `admin = true`, else 403;
- routes that would drop the tenant's salt are refused to every key (403): `/cohere/...` and `/v2/embed` (vLLM's
  Cohere requests have no `cache_salt`) and WebSockets (`/v1/realtime` builds requests without one; closed with 1008);
- a keyed POST must carry a JSON object (`application/json`, any case; else 415 or 400) of at most
  `max_body_bytes` (else 413), read within `body_timeout_s` (else 408); its `kv_transfer_params` is replaced by
  the key's tenant (and scope), keeping only a P/D proxy's `nexuskv_handoff` grant (sealed: the engine checks it
  against the request's own keys, so it is worth nothing for another tenant or prompt), and its `cache_salt` by
  a MAC (the keys file's `salt_key`) of the tenant, the scope and the client's own salt: vLLM's own prefix
  cache keys blocks by token ids and salt only, so without
  this two tenants sending the same prompt would share each other's blocks on the GPU, whatever NexusKV does;
  `/tokenize` and `/detokenize` only lose the two fields.

vLLM's stored Responses (`GET /v1/responses/{id}`) are not partitioned by tenant: any key may read any id it
knows; run with `VLLM_ENABLE_RESPONSES_API_STORE` unset (its default) where that matters. The keys file:
`gateway_keys.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from nexuskv import ConfigError, get_logger
from nexuskv_vllm.gateway_keys import Caller, KeysFile, key_digest, tenant_salt
from nexuskv_vllm.roles import GRANT_MAX_BYTES, HANDOFF_FIELD

__all__ = ["OPEN_GET", "REFUSED_PREFIXES", "TENANT_GET", "TENANT_POST", "Caller", "KeysFile", "TenantGateway",
           "key_digest", "tenant_salt"]  # fmt: skip

log = get_logger(__name__)

OPEN_GET = frozenset({"/health", "/ping", "/version", "/metrics", "/v1/models", "/load"})
TENANT_POST = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/inference/v1/generate", "/invocations", "/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank", "/v1/chat/completions/render", "/v1/completions/render",
    "/tokenize", "/detokenize"})  # fmt: skip
"""POST routes a tenant's key reaches (vLLM 0.32's generation, pooling and tokenizer routes)."""
TENANT_GET = frozenset({"/tokenizer_info"})
STORED_RESPONSE = re.compile(r"/v1/responses/[^/]+(/cancel)?")
STRIP_ONLY = frozenset({"/tokenize", "/detokenize"})  # no engine request: the fields are dropped, none added
REFUSED_PREFIXES = ("/cohere/", "/v2/embed")
"""Routes whose request drops `cache_salt` on its way to the engine: refused to every key."""
JSON_IN_THREAD = 1 << 20  # bodies this large are parsed off the event loop

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _tenant_route(method: str, path: str) -> bool:
    if STORED_RESPONSE.fullmatch(path):  # a stored response: read, delete; or cancel it
        return method in ("GET", "HEAD", "DELETE") if not path.endswith("/cancel") else method == "POST"
    return path in TENANT_POST if method == "POST" else method in ("GET", "HEAD") and path in TENANT_GET


class TenantGateway:
    """ASGI middleware for `vllm serve`: API key -> tenant in `kv_transfer_params`; clients' own are dropped."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                 keys: KeysFile | None = None) -> None:  # fmt: skip
        self.app = app
        if keys is None:
            path = os.environ.get("NEXUSKV_GATEWAY_KEYS")
            if not path:
                raise ConfigError("NEXUSKV_GATEWAY_KEYS is not set: the gateway needs its keys file")
            keys = KeysFile(path)
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "websocket":  # vLLM's realtime route builds requests without a salt or a tenant
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        if kind != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if method in ("GET", "HEAD") and path in OPEN_GET:
            await self.app(scope, receive, send)
            return
        who = self.keys.caller(headers.get("authorization"))
        if who is None:
            await _error(send, 401, "a known API key is required (Authorization: Bearer <key>)")
            return
        if path.startswith(REFUSED_PREFIXES):
            await _error(send, 403, f"{path}: this route drops the tenant's cache salt on its way to the engine")
            return
        if not who.admin and not _tenant_route(method, path):
            await _error(send, 403, f"{method} {path}: an operator route (needs a key with admin = true)")
            return
        if method != "POST":
            await self.app(scope, receive, send)  # a keyed GET, DELETE: no body to rewrite
            return
        await self._rewrite(scope, receive, send, headers, who)

    async def _rewrite(self, scope: Scope, receive: Receive, send: Send, headers: dict[str, str],
                       who: Caller) -> None:  # fmt: skip
        path = scope.get("path", "")
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            await _error(send, 415, "the body must be JSON (Content-Type: application/json)")
            return
        try:
            body = await asyncio.wait_for(_read_body(receive, self.keys.max_body_bytes), self.keys.body_timeout_s)
        except TimeoutError:
            await _error(send, 408, f"the body was not read in {self.keys.body_timeout_s} s")
            return
        if body is None:
            await _error(send, 413, f"body over {self.keys.max_body_bytes} bytes")
            return
        try:
            data = (await asyncio.to_thread(json.loads, body) if len(body) > JSON_IN_THREAD else json.loads(body)) \
                if body else {}  # fmt: skip
        except (ValueError, RecursionError) as exc:
            await _error(send, 400, f"the body is not JSON: {type(exc).__name__}: {exc}"[:300])
            return
        if not isinstance(data, dict):
            await _error(send, 400, "the body must be a JSON object")
            return
        theirs = data.pop("kv_transfer_params", None)
        grant = theirs.get(HANDOFF_FIELD) if isinstance(theirs, dict) else None  # sealed: checked by the engine
        if grant is not None and (not isinstance(grant, dict) or len(json.dumps(grant)) > GRANT_MAX_BYTES):
            grant = None  # not a grant any engine issues: dropped here, never parsed there
        dropped = theirs is not None and (grant is None or set(theirs) != {HANDOFF_FIELD})
        client_salt = data.pop("cache_salt", None)
        if path not in STRIP_ONLY:
            data["kv_transfer_params"] = {"tenant": who.tenant, **({"scope": who.scope} if who.scope else {}),
                                          **({HANDOFF_FIELD: grant} if grant is not None else {})}  # fmt: skip
            data["cache_salt"] = self.keys.salt(who.tenant, who.scope, client_salt)
        if dropped:
            log.info("client's kv_transfer_params dropped", path=path, tenant=who.tenant)
        new = json.dumps(data).encode()
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        scope["headers"].append((b"content-length", str(len(new)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return await receive()  # after the body: disconnects and the like
            sent = True
            return {"type": "http.request", "body": new, "more_body": False}

        await self.app(scope, replay, send)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "nexuskv_gateway", "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
