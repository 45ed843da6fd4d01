"""The sidecar's HTTP+JSON API: the kernel's plan, route, commit, materialize and report for any language.

A plain ASGI application (served by uvicorn with httptools and uvloop; no framework between them: routing is one
dict lookup, and a framework's middleware layers cost about a fifth of a plan's round trip). Bodies are the
kernel's contracts as JSON, checked against the published JSON Schemas (`schemas/*.v1.json`, `nexuskv.from_json`);
`GET /v1/openapi.json` documents every operation.
One tenant cannot stall another: a plan's body is parsed, checked and planned on the sidecar's thread pool, never
on the event loop, at most `Limits.tenant_concurrency` at a time per token (more wait their turn without holding a
thread), and plan and route bodies are capped (`Limits`: body bytes, token count, `slo.deadline_ms`), each a 413 or
400 before any work.
Every call but `/healthz` and the OpenAPI document carries `Authorization: Bearer <token>`; a token acts for one
tenant (a request, plan or route of another tenant is refused with 403) or is the operator's (`*`: any tenant,
status, metrics, every tenant's decisions). Deadlines and fail-open are the kernel's own: a plan is answered within
its deadline (the request's `slo.deadline_ms` or the kernel's) and anything failing inside gives a `recompute` plan
whose reasons say why, never an error, so a scheduler that gets a plan back can always proceed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl

from attrs import define

from nexuskv import ContractError, Kernel, Plan, Request, from_json, get_logger
from nexuskv_sidecar import _binary, _codec
from nexuskv_sidecar._backend import Backend, KernelBackend, fail_open, status_of
from nexuskv_sidecar._binary import Parsed
from nexuskv_sidecar._codec import ApiError
from nexuskv_sidecar._config import OPERATOR, digest
from nexuskv_sidecar._oversize import OversizeHolds
from nexuskv_sidecar._remote import RemoteBackend
from nexuskv_sidecar._stream import Raw, Stream, Streams, count
from nexuskv_sidecar.openapi import openapi

__all__ = ["Limits", "SidecarApp", "create_app", "fail_open", "status_of"]

log = get_logger("nexuskv_sidecar")


class HttpRequest:
    """What a handler sees of an HTTP request: headers (lower-case names), query parameters, the body."""

    __slots__ = ("body", "caller", "headers", "path", "query_params")

    def __init__(self, path: str, headers: dict[str, str], query: dict[str, str], body: bytes,
                 caller: str = "") -> None:  # fmt: skip
        self.path = path
        self.headers = headers
        self.query_params = query
        self.body = body
        self.caller = caller  # the tenant the bearer token acts for, checked before the body was read


Handler = Callable[[HttpRequest], Awaitable[Any]]


@define(frozen=True)
class Limits:
    """What one plan or route call may ask of the sidecar: each is a clear 4xx past its bound."""

    plan_body_bytes: int = 4 << 20  # a 4k-token request is about 26 KB; 4 MiB is about 500k tokens
    tokens: int = 1 << 19
    deadline_ms: float = 1000.0  # `slo.deadline_ms` above this is a 400: planning time is bounded by the operator
    tenant_concurrency: int = 2  # plans of one token in flight on the pool at once; others wait on the loop
    oversize_hold_s: float = 5.0  # a token's repeated bodies far over the limit are held this long (0: never)
    oversize_holds_per_token: int = 8  # connections held at once per token; more are closed at once


PUBLIC = frozenset({"/healthz", "/v1/openapi.json"})  # the only paths served without a token
_INLINE_BYTES = 64 << 10  # binary plan bodies a worker parses on its loop (16k tokens; no Python int is made) ...
_INLINE_JSON = 2048  # ... when their JSON part is this small (a large one may be slow to check: the pool's work)
_PLANNED = frozenset({"/v1/plan", "/v1/route", "/v1/materialize", "/v1/report"})  # `Limits.plan_body_bytes`


class _Api:
    """The handlers, bound to one backend (a kernel here, or the kernel of another process) and a token table."""

    def __init__(self, backend: Backend, tokens: Mapping[bytes, str], max_body_bytes: int,
                 limits: Limits | None = None) -> None:  # fmt: skip
        self.backend = backend
        self.tokens = dict(tokens)
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self._turns: dict[str, asyncio.Semaphore] = {}  # per caller: plans in flight (loop thread only)
        self._seen: dict[str, str] = {}  # bearer token -> tenant, for tokens already checked (no hash per call)
        # the kernel's blocking calls (commit, materialize, report, status, metrics) run here, never on the loop
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="nexuskv-sidecar")
        self.streams = Streams()
        self.holds = OversizeHolds(self.limits.oversize_hold_s, self.limits.oversize_holds_per_token)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the sidecar's pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------------------------------ plumbing

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The tenant of the request's bearer token; 401 without a known token."""
        header = headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing bearer token (Authorization: Bearer <token>)")
        tenant = self._seen.get(token)
        if tenant is None:
            tenant = self.tokens.get(digest(token.strip()))
            if tenant is None:
                raise ApiError(401, "unknown token")  # never remembered: guessing cannot fill the table
            if len(self._seen) >= 4096:
                self._seen.clear()
            self._seen[token] = tenant
        return tenant

    @staticmethod
    def allow(caller: str, tenant: str) -> None:
        """403 unless the caller may act for `tenant`."""
        if caller != OPERATOR and caller != tenant:
            raise ApiError(403, f"this token acts for tenant {caller!r}, not {tenant!r}")

    @staticmethod
    def object_body(http: HttpRequest, keys: set[str]) -> Mapping[str, Any]:
        """The request's JSON object body, with no field beyond `keys`."""
        data = _object(_codec.decode(http.body))
        _codec.check_keys(data, keys)
        return data

    def tenant_request(self, http: HttpRequest, data: Mapping[str, Any]) -> Request:
        """The body's `request`, of a tenant the caller's token acts for."""
        req: Request = _codec.contract(Request, _codec.field(data, "request"), "request")
        self.allow(http.caller, req.tenant)
        return req

    # ------------------------------------------------------------------------------------------ operations

    def body_limit(self, path: str) -> int:
        """The largest body `path` takes."""
        return min(self.limits.plan_body_bytes, self.max_body_bytes) if path in _PLANNED else self.max_body_bytes

    def turn(self, caller: str) -> asyncio.Semaphore:
        """The caller's turns on the pool (created on first use; loop thread only)."""
        sem = self._turns.get(caller)
        if sem is None:
            if len(self._turns) >= 65536:  # callers are tokens, so few; a bound all the same
                self._turns = {c: s for c, s in self._turns.items() if s.locked()}
            sem = self._turns[caller] = asyncio.Semaphore(self.limits.tenant_concurrency)
        return sem

    def checked(self, req: Request) -> Request:
        """`req` within the limits on tokens and `slo.deadline_ms` (a 400 naming the limit otherwise)."""
        self.within_limits(len(req.token_ids), req.slo.deadline_ms)
        return req

    def within_limits(self, tokens: int, asked: float | None) -> None:
        """A 400 naming the limit when a request's token count or `slo.deadline_ms` is over it."""
        if tokens > self.limits.tokens:
            raise ApiError(400, f"request: {tokens} tokens, over the limit of {self.limits.tokens}")
        if asked is not None and asked > self.limits.deadline_ms:
            raise ApiError(400, f"request: slo.deadline_ms {asked:g} is over the limit of {self.limits.deadline_ms:g}")

    async def in_turn(self, http: HttpRequest, fn: Callable[[HttpRequest], Any]) -> Any:
        """`fn(http)` on the pool in the caller's turn: parsing, checking and the kernel's call, never on the loop."""
        async with self.turn(http.caller):
            return await self.run(fn, http)

    async def plan(self, http: HttpRequest) -> Any:
        """POST /v1/plan: a `Request` in, a `Plan` out (query `session` continues a session's key chain).

        The body is JSON, or the binary encoding (`Content-Type: application/x-nexuskv-tokens`, `_binary`).
        Parsing, checking and planning run on the pool, in the caller's turn: never on the loop.
        """
        if not http.body:
            raise ApiError(400, "empty body: expected a JSON object")
        aplan = getattr(self.backend, "aplan", None)
        if aplan is None:  # the kernel is in this process: parsing and planning on the pool
            return await self.in_turn(http, self._plan)
        async with self.turn(http.caller):  # a worker: a binary body with a small JSON part is parsed on the loop
            # (no thread handoff; tens of microseconds at most), others on the pool; the call is awaited
            if _is_binary(http) and len(http.body) <= _INLINE_BYTES and _json_part(http.body) <= _INLINE_JSON:
                req, session = self.plan_input(http)
            else:
                req, session = await self.run(self.parsed_input, http)
            return await aplan(req, session)

    def _plan(self, http: HttpRequest) -> Any:
        return self.backend.plan(*self.plan_input(http))

    def parsed_input(self, http: HttpRequest) -> tuple[Parsed, str | None]:
        """`plan_input` with the ids as uint32s (what a worker sends the kernel's process)."""
        req, session = self.plan_input(http)
        return (req if isinstance(req, Parsed) else Parsed.of(req)), session

    def plan_input(self, http: HttpRequest) -> tuple[Request | Parsed, str | None]:
        """A plan body's request, checked, of a tenant the caller acts for, within the limits; and its session."""
        if _is_binary(http):
            document, ids = _binary.split(http.body, self.limits.tokens)
            req: Request | Parsed = Parsed(_binary.head(document), ids)  # the ids stay uint32s here
            head, count = req.head, len(ids)
        else:
            try:
                req = head = from_json(Request, http.body)  # parsed and checked in one step: the hot path
            except ContractError as exc:
                if exc.problems and exc.problems[0][1].startswith("not JSON"):
                    raise ApiError(400, f"body is {exc.problems[0][1]}") from None
                raise ApiError(400, f"invalid {exc.contract}", exc.problems) from None
            count = len(head.token_ids)
        self.allow(http.caller, head.tenant)
        self.within_limits(count, head.slo.deadline_ms)
        session = http.query_params.get("session") or None
        if session is not None:  # sessions are the tenant's own (length-prefixed: no two tenants' names collide)
            session = f"{len(head.tenant)}:{head.tenant}/{session}"
        return req, session

    async def route(self, http: HttpRequest) -> Any:
        """POST /v1/route: `{"request": Request, "nodes": [NodeState]}` in, a `RouteDecision` out (JSON or binary)."""
        return await self.in_turn(http, self._route)

    def _route(self, http: HttpRequest) -> Any:
        if _is_binary(http):
            document, ids = _binary.split(http.body, self.limits.tokens)
            data = _object(document)
            _codec.check_keys(data, {"request", "nodes"})
            req: Request | Parsed = Parsed(_binary.head(_codec.field(data, "request"), "request"), ids)
            head, count = req.head, len(ids)
        else:
            data = self.object_body(http, {"request", "nodes"})
            req = head = self.tenant_request(http, data)
            count = len(head.token_ids)
        self.allow(http.caller, head.tenant)
        self.within_limits(count, head.slo.deadline_ms)
        nodes = _codec.nodes(_codec.field(data, "nodes"))
        return self.backend.route(req, nodes)

    async def commit(self, http: HttpRequest) -> Any:
        """POST /v1/commit: `{"request": Request, "payloads": [{block, group, data}]}`; accepted and refused."""
        return await self.in_turn(http, self._commit)

    def _commit(self, http: HttpRequest) -> Any:
        data = self.object_body(http, {"request", "payloads"})
        req = self.checked(self.tenant_request(http, data))
        payloads = _codec.payloads(_codec.field(data, "payloads"), req)
        return self.backend.commit(req, payloads)

    async def materialize(self, http: HttpRequest) -> Any:
        """POST /v1/materialize: `{"plan": Plan, "request": Request}`; what was loaded and verified, per block.

        The answer is metadata (each loaded state's descriptor); with query `payloads=1` each state also carries
        its bytes in base64. Load problems are not errors: `tokens` says where to recompute from.
        """
        return await self.in_turn(http, self._materialize)

    def _materialize(self, http: HttpRequest) -> Any:
        data = self.object_body(http, {"plan", "request"})
        plan: Plan = _codec.contract(Plan, _codec.field(data, "plan"), "plan")
        req = self.checked(self.tenant_request(http, data))
        self.allow(http.caller, plan.tenant)
        with_payloads = http.query_params.get("payloads", "") in ("1", "true")
        return self.backend.materialize(plan, req, with_payloads)

    async def report(self, http: HttpRequest) -> Any:
        """POST /v1/report: `{"plan": Plan, "report": LoadReport, "request"?: Request}`; where to recompute from.

        The plan must be one this deployment sealed (a report moves breakers every tenant shares), the report's
        tier one the plan reads from. With the request, the kernel authorises the report as it would the load
        (tenant, tokens, the owner's share grant now) and re-reads a block reported corrupt: it is quarantined only
        when the kernel's own checks reject it.
        """
        return await self.in_turn(http, self._report)

    def _report(self, http: HttpRequest) -> Any:
        data = self.object_body(http, {"plan", "report", "request"})
        plan: Plan = _codec.contract(Plan, _codec.field(data, "plan"), "plan")
        self.allow(http.caller, plan.tenant)
        report = _codec.load_report(_codec.field(data, "report"), plan)
        req = None
        if "request" in data:
            req = self.checked(self.tenant_request(http, data))
            if req.request_id != plan.request_id:
                raise ApiError(400, "request: not the request the plan answers (request_id differs)")
        return self.backend.report(plan, report, req)  # the MAC check and the once-per-plan rule are the backend's

    async def status(self, http: HttpRequest) -> Any:
        """GET /v1/status: the kernel's status (operator only)."""
        self.allow(http.caller, OPERATOR)
        return await self.run(self.backend.status)

    async def metrics(self, http: HttpRequest) -> Any:
        """GET /metrics: the kernel's Prometheus series in the text format (operator only)."""
        self.allow(http.caller, OPERATOR)
        from prometheus_client import CONTENT_TYPE_LATEST

        return Raw(await self.run(self.backend.metrics), CONTENT_TYPE_LATEST.encode())

    async def decisions(self, http: HttpRequest) -> Any:
        """GET /v1/decisions: decision records as JSON lines, as they are made, until the caller hangs up.

        A tenant's token sees its own tenant's; the operator's every tenant's (or `?tenant=T`). `?recent=N` first
        sends the last N records kept; `?limit=N` ends the stream after N records. A caller that reads too slowly
        loses records (counted in the `nexuskv_decision_subscriber_drops_total` series), never slows a plan.
        """
        caller = http.caller
        tenant = http.query_params.get("tenant") or (None if caller == OPERATOR else caller)
        if tenant is not None:
            self.allow(caller, tenant)
        recent, limit = count(http.query_params, "recent"), count(http.query_params, "limit")
        return Stream(self.backend.decision_log, self.streams, caller, tenant, recent, limit)

    async def healthz(self, http: HttpRequest) -> Any:
        """GET /healthz: liveness, no token (the kernel's node and whether its lease is alive)."""
        return await self.run(self.backend.healthz)

    async def spec(self, http: HttpRequest) -> Any:
        """GET /v1/openapi.json: the API's OpenAPI 3.1 document (no token)."""
        return openapi()


def _json_part(body: bytes) -> int:
    return int.from_bytes(body[4:8], "little") if len(body) >= 8 else 0


def _is_binary(http: HttpRequest) -> bool:
    return http.headers.get("content-type", "").partition(";")[0].strip().lower() == _binary.CONTENT_TYPE


def _object(data: Any) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ApiError(400, "body: expected a JSON object")
    return data


class SidecarApp:
    """The ASGI application: one dict lookup routes `(method, path)` to a handler; JSON in, JSON out."""

    def __init__(self, api: _Api, routes: Mapping[tuple[str, str], Handler]) -> None:
        self.api = api
        self.routes = dict(routes)
        self.paths = {path for _, path in self.routes}

    def close_streams(self) -> None:
        """End every open decision stream and held connection (the server is stopping: it waits for them)."""
        self.api.streams.stop()
        self.api.holds.stop()

    def close(self) -> None:
        """End open decision streams and stop the pool of the kernel's blocking calls (after what runs)."""
        self.api.streams.stop()
        self.api.holds.stop()
        self.api.pool.shutdown(wait=True, cancel_futures=True)

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:  # fmt: skip
        """Serve one HTTP request (other scope types are not served)."""
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        handler = self.routes.get((method, path))
        if handler is None:
            status = 405 if path in self.paths else 404
            await _answer(send, status, ApiError(status, f"no {method} {path}").body())
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}  # names are lower-case
        caller = ""
        if path not in PUBLIC:  # the token is checked before a byte of the body is read
            try:
                caller = self.api.authenticate(headers)
            except ApiError as exc:
                await _answer(send, exc.status, exc.body())
                return
        size = headers.get("content-length", "")
        limit = self.api.body_limit(path)
        if size.isdigit() and int(size) > limit:  # refused unread; far over the limit, the connection is closed too,
            # so its body is never drained (a caller may then see a reset while still sending, not the 413); a token
            # that keeps doing it has its next such connections held first, unread (`_oversize`)
            far = int(size) > 2 * limit
            if far and self.api.holds.strike(caller):
                await self.api.holds.hold(caller)
            await _answer(send, 413, ApiError(413, f"body of {size} bytes is over the limit of {limit}").body(),
                          close=far)  # fmt: skip
            return
        chunks, got, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            got += len(chunk)
            if got > limit:
                await _answer(send, 413, ApiError(413, f"body over the limit of {limit} bytes").body(), close=True)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        query = dict(parse_qsl(scope["query_string"].decode("latin-1"))) if scope["query_string"] else {}
        http = HttpRequest(path, headers, query, chunks[0] if len(chunks) == 1 else b"".join(chunks), caller)
        try:
            value = await handler(http)
        except ApiError as exc:
            await _answer(send, exc.status, exc.body())
            return
        except Exception as exc:
            log.error("sidecar request failed", path=path, error=f"{type(exc).__name__}: {exc}")
            await _answer(send, 500, ApiError(500, f"internal error: {type(exc).__name__}").body())
            return
        if isinstance(value, Stream):
            await value.serve(receive, send)
        elif isinstance(value, Raw):
            await _answer(send, 200, value.body, value.content_type)
        else:
            await _answer(send, 200, _codec.dumps(value))


async def _answer(send: Callable[[dict[str, Any]], Awaitable[None]], status: int, body: bytes,
                  content_type: bytes = b"application/json", close: bool = False) -> None:  # fmt: skip
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(kernel: Kernel | Backend, tokens: Mapping[bytes, str], *, max_body_bytes: int = 64 << 20,
               limits: Limits | None = None) -> SidecarApp:  # fmt: skip
    """The ASGI app serving `kernel` (or a backend); `tokens` maps SHA-256 token digests to the tenant they act for."""
    backend = kernel if isinstance(kernel, (KernelBackend, RemoteBackend)) else KernelBackend(kernel)
    api = _Api(backend, tokens, max_body_bytes, limits)
    routes: dict[tuple[str, str], Handler] = {
        ("POST", "/v1/plan"): api.plan,
        ("POST", "/v1/route"): api.route,
        ("POST", "/v1/commit"): api.commit,
        ("POST", "/v1/materialize"): api.materialize,
        ("POST", "/v1/report"): api.report,
        ("GET", "/v1/status"): api.status,
        ("GET", "/v1/decisions"): api.decisions,
        ("GET", "/metrics"): api.metrics,
        ("GET", "/healthz"): api.healthz,
        ("GET", "/v1/openapi.json"): api.spec,
    }
    # HEAD answers like GET (uvicorn sends no body), except for the stream, which would never end
    routes.update({("HEAD", path): fn for (method, path), fn in list(routes.items())
                   if method == "GET" and path != "/v1/decisions"})  # fmt: skip
    return SidecarApp(api, routes)
