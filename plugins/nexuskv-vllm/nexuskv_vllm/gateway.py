"""`TenantGateway`: the ASGI middleware that makes `vllm serve` say, for every request, which tenant it is.

The connector takes a request's tenant from `kv_transfer_params`, a field of vLLM's request bodies; a client must
never choose it. This middleware runs inside `vllm serve` (`--middleware nexuskv_vllm.gateway.TenantGateway`) and
works by allow-list: vLLM has many endpoints that take `kv_transfer_params` (`/v1/chat/completions`,
`/v1/completions`, `/v1/responses`, `/v1/messages`, `/invocations`, `/inference/v1/generate`, ...), and one added
in a later vLLM must not be an open door. So:

- `OPEN` requests pass unchanged, without a key: GET `/health`, `/ping`, `/version`, `/metrics`, `/v1/models`;
  POST `/tokenize`, `/detokenize` (their bodies still lose any `kv_transfer_params`);
- every other request needs an API key (`Authorization: Bearer <key>`) listed in the keys file, else 401; a POST
  must carry a JSON object (`application/json`, any case; else 415 or 400) of at most `max_body_bytes` (else 413);
  its `kv_transfer_params` is replaced by the key's tenant (and scope), and its `cache_salt` by a digest of the
  tenant, the scope and the client's own salt: vLLM's own prefix cache keys blocks by token ids and salt only, so
  without this two tenants sending the same prompt would share each other's blocks on the GPU, whatever NexusKV
  does (a client's salt still splits its tenant's cache further; no request reaches vLLM with a salt the gateway
  did not make, so knowing another tenant's salt is of no use).

vLLM's stored Responses (`GET /v1/responses/{id}`) are not partitioned by tenant: any key may read any id it
knows; run with `VLLM_ENABLE_RESPONSES_API_STORE` unset (its default) where that matters.

The keys file (`NEXUSKV_GATEWAY_KEYS`, TOML) holds SHA-256 digests of the keys, never the keys:

    max_body_bytes = 8388608            # optional
    [keys.9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]
    tenant = "acme"
    scope = "support"                   # optional

A malformed keys file stops the server at start with the file and the problem (`ConfigError`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from nexuskv import ConfigError, Namespace, get_logger

__all__ = ["GENERATION_PATHS", "OPEN_GET", "OPEN_POST", "KeysFile", "TenantGateway", "key_digest", "tenant_salt"]

log = get_logger(__name__)

OPEN_GET = frozenset({"/health", "/ping", "/version", "/metrics", "/v1/models", "/load"})
OPEN_POST = frozenset({"/tokenize", "/detokenize"})
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})  # the common ones
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def tenant_salt(tenant: str, scope: str, client_salt: object) -> str:
    """vLLM's `cache_salt` for a tenant's request: its tenant, scope and the client's own salt, hashed."""
    h = hashlib.blake2b(digest_size=16, person=b"nexuskv.gateway")
    for part in (tenant, scope, client_salt if isinstance(client_salt, str) else ""):
        h.update(part.encode() + b"\0")
    return f"nexuskv-{h.hexdigest()}"


def key_digest(key: str) -> str:
    """The SHA-256 hex digest of an API key, as the keys file lists it."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeysFile:
    """The gateway's keys file: API key digest -> (tenant, scope), and the body limit."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            data = tomllib.loads(self.path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{self.path}: {exc}") from None
        unknown = set(data) - {"keys", "max_body_bytes"}
        if unknown:
            raise ConfigError(f"{self.path}: unknown field(s) {sorted(unknown)} (have: keys, max_body_bytes)")
        self.max_body_bytes = data.get("max_body_bytes", 8 << 20)
        if not isinstance(self.max_body_bytes, int) or not 0 < self.max_body_bytes <= 1 << 30:
            raise ConfigError(f"{self.path}: max_body_bytes must be an integer in (0, 1 GiB]")
        self.keys: dict[str, tuple[str, str]] = {}
        for digest, entry in (data.get("keys") or {}).items():
            where = f"{self.path}: keys.{digest}"
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError(f"{where}: not a SHA-256 hex digest (list key_digest(key), never the key)")
            if not isinstance(entry, dict) or set(entry) - {"tenant", "scope"}:
                raise ConfigError(f"{where}: a table with 'tenant' and optionally 'scope'")
            tenant, scope = entry.get("tenant"), entry.get("scope", "")
            if not isinstance(tenant, str) or not tenant or not isinstance(scope, str):
                raise ConfigError(f"{where}: 'tenant' must be a non-empty string, 'scope' a string")
            self.keys[digest] = (tenant, scope)
        if not self.keys:
            raise ConfigError(f"{self.path}: no keys: every generation request would be refused")

    def namespaces(self) -> dict[str, Namespace]:
        """vLLM `cache_salt` -> namespace of every tenant and scope in the file (requests without a client salt).

        What a router following the engines' KV events (`nexuskv_vllm_events.EngineResidency`) attributes their
        blocks with; a client's own salt makes another salt, whose blocks stay unattributed (never shared).
        """
        out = {}
        for tenant, scope in set(self.keys.values()):
            salt = tenant_salt(tenant, scope, None)
            out[salt] = Namespace(tenant=tenant, scope=scope, cache_salt=salt)
        return out

    def tenant(self, authorization: str | None) -> tuple[str, str] | None:
        """(tenant, scope) of a `Bearer <key>` header; None for a missing or unknown key."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self.keys.get(key_digest(authorization.removeprefix("Bearer ").strip()))


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
        if scope.get("type") not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if scope.get("type") == "http" and method in ("GET", "HEAD") and path in OPEN_GET:
            await self.app(scope, receive, send)
            return
        who = None
        if not (method == "POST" and path in OPEN_POST):
            who = self.keys.tenant(headers.get("authorization"))
            if who is None:
                await _error(send, 401, "a known API key is required (Authorization: Bearer <key>)")
                return
        if scope.get("type") != "http" or method != "POST":
            await self.app(scope, receive, send)  # a keyed GET, DELETE, websocket: no body to rewrite
            return
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            await _error(send, 415, "the body must be JSON (Content-Type: application/json)")
            return
        body = await _read_body(receive, self.keys.max_body_bytes)
        if body is None:
            await _error(send, 413, f"body over {self.keys.max_body_bytes} bytes")
            return
        try:
            data = json.loads(body) if body else {}
        except ValueError as exc:
            await _error(send, 400, f"the body is not JSON: {exc}")
            return
        if not isinstance(data, dict):
            await _error(send, 400, "the body must be a JSON object")
            return
        dropped = data.pop("kv_transfer_params", None) is not None
        client_salt = data.pop("cache_salt", None)
        if who is not None:
            data["kv_transfer_params"] = {"tenant": who[0], **({"scope": who[1]} if who[1] else {})}
            data["cache_salt"] = tenant_salt(who[0], who[1], client_salt)
        if dropped:
            log.info("client's kv_transfer_params dropped", path=path, tenant=who[0] if who else None)
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
