"""`PDProxy`: an OpenAI-compatible ASGI proxy in front of prefill and decode `vllm serve` engines (P/D).

For each `POST /v1/completions` or `/v1/chat/completions` it picks a prefill engine and a decode engine with
`Kernel.route` (predicted TTFT from each engine's queue as the proxy keeps it: prompt tokens in prefill, requests
waiting, streams decoding), sends the request to the prefill engine with `max_tokens` 1 and `stream` off, copies
the `nexuskv_handoff` grant of its answer (`kv_transfer_params`) into the decode request, and streams the decode
engine's answer to the client byte for byte. The client's `Authorization` header goes to both engines (each runs
the tenant gateway). The decode engine decides, with its own plan, whether fetching the prefill engine's state
beats recomputing it (`roles.py`).

Failures, each ending in an answer or a clean error, never a hung client:
- the prefill engine cannot be reached, answers 5xx or not within `prefill_timeout_s`: the decode engine gets the
  request without a grant and computes it all (one engine doing both); a 4xx from it is the client's error and is
  returned as is;
- the decode engine cannot be reached or answers 5xx before sending anything: the request goes, without a grant,
  to another engine (the prefill engine included), which does both;
- a batch of prompts, or `n` > 1: no P/D, one engine does the whole request (a grant is for one prompt);
- the decode engine dies mid-stream: a streamed answer ends with an SSE `error` event and `[DONE]`, an unstreamed
  one is a 502; a client that goes away closes the upstream stream.
An engine that failed is left out of routes for `cooldown_s`. Request bodies are bounded (`max_body_bytes`: 413)
and read within `body_timeout_s` (408); `min_tokens` is not sent to the prefill engine (it answers one token).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from attrs import define, field
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    ModelIdentity,
    NodeState,
    Request,
    StateGroup,
    TokenizerIdentity,
    get_logger,
)
from nexuskv_vllm.roles import HANDOFF_FIELD

__all__ = ["Engine", "PDProxy"]

log = get_logger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")


@define
class Engine:
    """One `vllm serve` behind the proxy, with the load the proxy has put on it."""

    node: str
    url: str
    prefill_tokens: int = 0  # prompt tokens sent to it for prefill, not answered yet
    waiting: int = 0  # requests sent to it, not answered yet
    decoding: int = 0  # streams it is sending
    down_until: float = 0.0
    served: dict[str, int] = field(factory=lambda: {"prefills": 0, "decodes": 0, "both": 0, "failures": 0})

    def state(self) -> NodeState:
        return NodeState(self.node, queued_prefill_tokens=self.prefill_tokens, waiting_requests=self.waiting,
                         running_decodes=self.decoding)  # fmt: skip


class _Failed(Exception):
    """An engine failed before answering (unreachable, timed out, 5xx)."""


class PDProxy:
    """The proxy's state and its Starlette app (`app`); `Kernel.route` picks engines."""

    def __init__(self, prefill: Sequence[Engine], decode: Sequence[Engine], *, kernel: Kernel | None = None,
                 prefill_timeout_s: float = 60.0, decode_timeout_s: float = 600.0, cooldown_s: float = 5.0,
                 max_body_bytes: int = 8 << 20, body_timeout_s: float = 30.0,
                 page_size: int = 128) -> None:  # fmt: skip
        if not prefill or not decode:
            raise ValueError("the P/D proxy needs at least one prefill and one decode engine")
        self.prefill, self.decode = list(prefill), list(decode)
        self.kernel = kernel or Kernel(KernelConfig(node="pd-proxy", page_size=page_size))
        self.prefill_timeout_s, self.decode_timeout_s = prefill_timeout_s, decode_timeout_s
        self.cooldown_s, self.max_body_bytes, self.body_timeout_s = cooldown_s, max_body_bytes, body_timeout_s
        # the route's plans price queues and prefill; the proxy holds no state, so a one-layer layout stands in
        self.layout = Layout(groups=(StateGroup(kind="dense", layers=1, kv_heads=1, head_dim=1),),
                             page_size=self.kernel.config.page_size)  # fmt: skip
        self.stats = {"pd": 0, "fallback_prefill": 0, "fallback_decode": 0, "broken_streams": 0, "grants": 0}
        # trust_env off: an HTTP(S)_PROXY in the environment must not divert tenants' keys and prompts
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(decode_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=256), trust_env=False)  # fmt: skip
        routes = [Route(p, self.handle, methods=["POST"]) for p in ROUTES]
        routes += [Route("/health", self.health, methods=["GET"]), Route("/v1/models", self.models, methods=["GET"]),
                   Route("/pd/stats", self.stats_route, methods=["GET"])]  # fmt: skip
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.close()

    async def close(self) -> None:
        await self.client.aclose()
        self.kernel.close()

    # ------------------------------------------------------------------------------------------ routing

    def _pick(self, pool: Sequence[Engine], tokens: Sequence[int], model: str, skip: str = "") -> Engine | None:
        """The engine of `pool` with the least predicted TTFT (engines down or named `skip` left out)."""
        now = time.monotonic()
        up = [e for e in pool if e.down_until <= now and e.node != skip]
        if not up:
            return None
        req = Request(request_id="pd-route", tenant="pd-proxy", model=ModelIdentity(name=model or "model"),
                      tokenizer=TokenizerIdentity(name=model or "model"), layout=self.layout,
                      token_ids=tuple(tokens))  # fmt: skip
        decision = self.kernel.route(req, [e.state() for e in up])
        return next(e for e in up if e.node == decision.node)

    def _failed(self, engine: Engine, why: str) -> None:
        engine.down_until = time.monotonic() + self.cooldown_s
        engine.served["failures"] += 1
        log.warning("engine failed; left out of routes for a while", node=engine.node, url=engine.url, why=why,
                    cooldown_s=self.cooldown_s)  # fmt: skip

    # ------------------------------------------------------------------------------------------ the request

    async def _body(self, http: HttpRequest) -> bytes | Response:
        body = bytearray()
        async for chunk in http.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return _error(413, f"body over {self.max_body_bytes} bytes")
        return bytes(body)

    async def handle(self, http: HttpRequest) -> Response:
        try:
            body = await asyncio.wait_for(self._body(http), self.body_timeout_s)
        except TimeoutError:
            return _error(408, f"the body was not read in {self.body_timeout_s} s")
        if isinstance(body, Response):
            return body
        try:
            data = json.loads(body or b"{}")
        except (ValueError, RecursionError) as exc:
            return _error(400, f"the body is not JSON: {type(exc).__name__}: {exc}"[:300])
        if not isinstance(data, dict):
            return _error(400, "the body must be a JSON object")
        path = http.url.path
        headers = {k: v for k, v in http.headers.items() if k.lower() == "authorization"}
        prompt = data.get("prompt")
        tokens = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else \
            range(max(1, len(json.dumps(data.get("messages", prompt))) // 4))  # fmt: skip (text: a length estimate)
        model = str(data.get("model", ""))
        p = self._pick(self.prefill, tokens, model) if _single(data) else None  # a batch: one engine does all
        d = self._pick(self.decode, tokens, model)
        grant = None
        if p is not None and d is not None:
            try:
                grant, early = await self._prefill(p, path, data, headers, len(tokens))
            except _Failed as exc:
                self._failed(p, str(exc))
                self.stats["fallback_prefill"] += 1
                early = None
            if early is not None:  # the client's own error (4xx): returned as is
                return early
        if d is None:  # every decode engine failed lately: one engine does the whole request
            self.stats["fallback_decode"] += 1
            d = self._pick([*self.decode, *self.prefill], tokens, model)
            if d is None:
                return _error(503, "no engine is up")
        return await self._decode(d, path, data, headers, grant, tokens, model)

    async def _prefill(self, p: Engine, path: str, data: dict[str, Any], headers: dict[str, str],
                       n: int) -> tuple[dict[str, Any] | None, Response | None]:  # fmt: skip
        """Prefill on `p`: (its grant or None, a response to return to the client as is, or None)."""
        pre = {k: v for k, v in data.items() if k not in ("stream", "stream_options", "kv_transfer_params",
                                                          "min_tokens", "min_completion_tokens")}  # fmt: skip
        pre["max_tokens"] = 1
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        p.prefill_tokens += n
        p.waiting += 1
        try:
            r = await self.client.post(p.url + path, json=pre, headers=headers, timeout=self.prefill_timeout_s)
        except (httpx.HTTPError, OSError) as exc:
            raise _Failed(f"{type(exc).__name__}: {exc}") from None
        finally:
            p.prefill_tokens -= n
            p.waiting -= 1
        if r.status_code >= 500:
            raise _Failed(f"HTTP {r.status_code}")
        if r.status_code >= 400:
            return None, Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        p.served["prefills"] += 1
        try:
            params = r.json().get("kv_transfer_params") or {}
            grant = params.get(HANDOFF_FIELD) if isinstance(params, dict) else None
        except (ValueError, AttributeError):
            grant = None
        if grant is not None:
            self.stats["grants"] += 1
        return grant, None

    async def _decode(self, d: Engine, path: str, data: dict[str, Any], headers: dict[str, str],
                      grant: dict[str, Any] | None, tokens: Sequence[int], model: str) -> Response:  # fmt: skip
        """Send the request to `d` (with the grant) and relay its answer; another engine without it if `d` fails."""
        body = {k: v for k, v in data.items() if k != "kv_transfer_params"}
        if grant is not None:
            body["kv_transfer_params"] = {HANDOFF_FIELD: grant}
        for attempt in range(2):
            try:
                upstream = await self._open(d, path, body, headers)
            except _Failed as exc:
                self._failed(d, str(exc))
                self.stats["fallback_decode"] += 1
                body.pop("kv_transfer_params", None)
                d = self._pick([*self.decode, *self.prefill], tokens, model, skip=d.node)  # type: ignore[assignment]
                if d is None or attempt:
                    return _error(502, f"no engine answered: {exc}")
                continue
            carried = "kv_transfer_params" in body
            self.stats["pd"] += carried
            d.served["decodes" if carried else "both"] += 1
            if upstream.status_code >= 400 or not data.get("stream"):
                return await self._whole(d, upstream)
            return StreamingResponse(self._relay(d, upstream), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type", "text/event-stream"))
        return _error(502, "no engine answered")  # pragma: no cover (the loop returns)

    async def _open(self, d: Engine, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        d.waiting += 1
        try:
            req = self.client.build_request("POST", d.url + path, json=body, headers=headers)
            r = await self.client.send(req, stream=True)
        except (httpx.HTTPError, OSError) as exc:
            raise _Failed(f"{type(exc).__name__}: {exc}") from None
        finally:
            d.waiting -= 1
        if r.status_code >= 500:
            await r.aclose()
            raise _Failed(f"HTTP {r.status_code}")
        return r

    async def _whole(self, d: Engine, upstream: httpx.Response) -> Response:
        """An unstreamed answer (or an error): read it whole; a grant in it stays here."""
        try:
            content = await upstream.aread()
        except (httpx.HTTPError, OSError) as exc:
            self._failed(d, f"answer cut: {exc!r}")
            self.stats["broken_streams"] += 1
            return _error(502, f"the decode engine failed while answering: {type(exc).__name__}")
        finally:
            await upstream.aclose()
        media = upstream.headers.get("content-type", "application/json")
        if upstream.status_code < 400 and media.startswith("application/json"):
            try:
                answer = json.loads(content)
                if isinstance(answer, dict) and "kv_transfer_params" in answer:
                    del answer["kv_transfer_params"]
                    content = json.dumps(answer).encode()
            except ValueError:
                pass
        return Response(content, upstream.status_code, media_type=media)

    async def _relay(self, d: Engine, upstream: httpx.Response) -> AsyncIterator[bytes]:
        d.decoding += 1
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except (httpx.HTTPError, OSError) as exc:
            self._failed(d, f"stream cut: {exc!r}")
            self.stats["broken_streams"] += 1
            err = {"error": {"message": "the decode engine failed mid-answer", "type": "upstream_error",
                             "code": 502}}  # fmt: skip
            yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            d.decoding -= 1
            await upstream.aclose()

    # ------------------------------------------------------------------------------------------ other routes

    async def health(self, http: HttpRequest) -> Response:
        now = time.monotonic()
        up = {e.node: e.down_until <= now for e in [*self.prefill, *self.decode]}
        return JSONResponse({"engines": up}, status_code=200 if any(up.values()) else 503)

    async def models(self, http: HttpRequest) -> Response:
        d = self._pick([*self.decode, *self.prefill], (), "")
        if d is None:
            return _error(503, "no engine is up")
        try:
            r = await self.client.get(d.url + "/v1/models", timeout=10.0)
        except (httpx.HTTPError, OSError) as exc:
            return _error(502, f"{d.node}: {type(exc).__name__}")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def stats_route(self, http: HttpRequest) -> Response:
        return JSONResponse({"proxy": self.stats, "engines": {e.node: e.served for e in [*self.prefill, *self.decode]}})


def _single(data: dict[str, Any]) -> bool:
    """One prompt, one answer: a prefill engine's grant is for exactly this request (a batch or `n` > 1: not)."""
    prompt = data.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and not all(isinstance(t, int) for t in prompt)
    return not batch and data.get("n", 1) in (1, None) and data.get("best_of", 1) in (1, None)


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "pd_proxy_error", "code": status}}, status_code=status)
