"""The Python client of the sidecar API: what a Python scheduler in another process (or on another host) calls.

`SidecarClient(url, token).plan(request)` returns a `Plan` like `Kernel.plan` does, and fails open the same way:
when the sidecar cannot be reached or answers late (`timeout_s`) or with a server error, the client answers
`recompute` itself, with the reason (`fail-open: sidecar ...`) and counts it (`fail_opens`), so a scheduler always
gets a plan it can act on. Mistakes of the caller (a bad request, a token of another tenant) are raised as
`SidecarError` with the server's field problems: those must be fixed, not hidden. One keep-alive connection per
thread; every method is safe to call from many threads.
"""

from __future__ import annotations

import base64
import http.client
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import orjson

from nexuskv import LoadReport, NodeState, Plan, PlanAction, Request, from_dict, to_dict
from nexuskv_sidecar._binary import CONTENT_TYPE, encode

__all__ = ["SidecarClient", "SidecarError"]


class SidecarError(Exception):
    """The sidecar refused a call (4xx): `status`, its message, and `problems` as (path, problem) pairs."""

    def __init__(self, status: int, message: str, problems: Sequence[tuple[str, str]] = ()) -> None:
        detail = "; ".join(f"{p}: {m}" for p, m in problems)
        super().__init__(f"{status}: {message}" + (f" ({detail})" if detail else ""))
        self.status = status
        self.message = message
        self.problems = list(problems)


# What a kept-alive connection the server closed while it was idle raises: the call never reached the server.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class _Unavailable(Exception):
    """The sidecar could not answer (connection, timeout, 5xx)."""


class SidecarClient:
    """A client of one sidecar (`url` like `http://127.0.0.1:8470`) acting with one bearer token.

    `timeout_s` bounds each socket operation (connect, send, each read), as `http.client` does: a server that
    answers, but trickles its answer, can stretch a call past it. With `binary=True`, plans and routes send the
    request's token ids as uint32s beside the JSON (`application/x-nexuskv-tokens`, docs/sidecar.md): a 4k-token
    request is 16 KB instead of 30, and the sidecar parses it in a fraction of the time.
    """

    def __init__(self, url: str, token: str, *, timeout_s: float = 1.0, binary: bool = False) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r}: expected http://host:port")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.timeout_s = timeout_s
        self.binary = binary
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._binary_headers = {**self._headers, "Content-Type": CONTENT_TYPE}
        self._local = threading.local()
        self._lock = threading.Lock()
        # every thread's connection, weakly: a thread that ends takes its connection (and socket) with it
        self._conns: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self.fail_opens = 0

    # ------------------------------------------------------------------------------------------ operations

    def plan(self, request: Request | Mapping[str, Any], *, session: str | None = None) -> Plan:
        """The sidecar's plan for `request`; a `recompute` plan made here when the sidecar is unavailable."""
        body = to_dict(request) if isinstance(request, Request) else dict(request)
        path = "/v1/plan" + (f"?session={quote(session)}" if session else "")
        try:
            return from_dict(Plan, self._call("POST", path, *self._encoded(body)))
        except _Unavailable as exc:
            with self._lock:
                self.fail_opens += 1
            return Plan(decision_id=uuid.uuid4().hex, request_id=str(body.get("request_id", "?")),
                        tenant=str(body.get("tenant", "?")), action=PlanAction.RECOMPUTE,
                        tokens_total=len(body.get("token_ids", ())),
                        reasons=(f"fail-open: sidecar {exc}",))  # fmt: skip

    def route(self, request: Request | Mapping[str, Any],
              nodes: Sequence[NodeState | Mapping[str, Any]]) -> dict[str, Any]:  # fmt: skip
        """The sidecar's route decision (a `RouteDecision` as JSON); raises `ConnectionError` when unavailable."""
        body = {"request": _req(request), "nodes": [to_dict(n) if isinstance(n, NodeState) else dict(n) for n in nodes]}
        data, headers = self._encoded(body, "request")
        try:
            return self._call("POST", "/v1/route", data, headers)
        except _Unavailable as exc:
            raise ConnectionError(f"sidecar {exc}") from None

    def commit(self, request: Request | Mapping[str, Any],
               payloads: Mapping[int | tuple[int, int], bytes | memoryview]) -> dict[str, int]:  # fmt: skip
        """Hand state to the sidecar's writer: `payloads[block]` or `payloads[(block, group)]`; accepted, refused."""
        items = []
        for where, data in payloads.items():
            block, group = where if isinstance(where, tuple) else (where, 0)
            items.append({"block": block, "group": group, "data": base64.b64encode(bytes(data)).decode()})
        return self._must("POST", "/v1/commit", {"request": _req(request), "payloads": items}, retry=False)

    def materialize(self, plan: Plan, request: Request | Mapping[str, Any], *,
                    payloads: bool = False) -> dict[str, Any]:  # fmt: skip
        """Load and verify a plan's state in the sidecar; per block its descriptor (and base64 bytes with payloads)."""
        path = "/v1/materialize" + ("?payloads=1" if payloads else "")
        return self._must("POST", path, {"plan": to_dict(plan), "request": _req(request)})

    def report(self, plan: Plan, report: LoadReport | Mapping[str, Any],
               request: Request | Mapping[str, Any] | None = None) -> int:  # fmt: skip
        """Report how restoring a plan went (once per plan); returns the token to recompute from.

        With the plan's `request`, a block reported corrupt is quarantined (the sidecar then knows its key).
        """
        rep = to_dict(report) if isinstance(report, LoadReport) else dict(report)
        body = {"plan": to_dict(plan), "report": rep}
        if request is not None:
            body["request"] = _req(request)
        return int(self._must("POST", "/v1/report", body, retry=False)["recompute_from"])

    def status(self) -> dict[str, Any]:
        """The kernel's status (an operator token)."""
        return self._must("GET", "/v1/status", None)

    # ------------------------------------------------------------------------------------------ plumbing

    def _encoded(self, body: dict[str, Any], member: str | None = None) -> tuple[bytes, dict[str, str]]:
        """`body` as sent, and its headers: JSON, or with `binary` the request's ids apart.

        The request is `body` itself, or its `member`; `body` is not changed.
        """
        if not self.binary:
            return orjson.dumps(body), self._headers
        req = dict(body if member is None else body[member])
        at = "" if member is None else f"{member}."
        if "token_ids" not in req:
            raise SidecarError(400, "invalid request (not sent)", [(f"{at}token_ids", "required field is missing")])
        ids = req.pop("token_ids")
        if isinstance(ids, (str, bytes, bytearray, memoryview)) or any(type(i) is bool for i in ids):
            problem = [(f"{at}token_ids", "expected a list of integers")]  # (bytes would be read as raw uint32s)
            raise SidecarError(400, "invalid request (not sent)", problem)
        try:
            return encode(req if member is None else {**body, member: req}, ids), self._binary_headers
        except (OverflowError, TypeError, ValueError) as exc:  # not uint32 ids: what the server would refuse
            problem = [(f"{at}token_ids", f"not uint32 ids: {exc}")]
            raise SidecarError(400, "invalid request (not sent)", problem) from None

    def _must(self, method: str, path: str, body: Any, retry: bool = True) -> Any:
        try:
            return self._call(method, path, orjson.dumps(body) if body is not None else None, self._headers, retry)
        except _Unavailable as exc:
            raise ConnectionError(f"sidecar {exc}") from None

    def _conn(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it served a call before (a kept-alive one the server may close)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        self._local.conn = conn
        with self._lock:
            self._conns.add(conn)
        return conn, False

    def _call(self, method: str, path: str, data: bytes | None, headers: dict[str, str], retry: bool = True) -> Any:
        while True:
            conn, reused = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except TimeoutError:
                self._drop(conn)
                raise _Unavailable(f"timed out after {self.timeout_s} s") from None
            except _STALE as exc:
                self._drop(conn)
                # a kept-alive connection the server closed is tried again, once, for calls that are safe to repeat
                # (the call may have reached the server: a commit or a report is never sent twice)
                if not reused or not retry:
                    raise _Unavailable(f"unreachable: {type(exc).__name__}: {exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                raise _Unavailable(f"unreachable: {type(exc).__name__}: {exc}") from None
        if resp.status >= 500 and resp.status != 507:  # 507: an answer too large for a worker, not an outage
            raise _Unavailable(f"error {resp.status}: {raw[:200].decode(errors='replace')}")
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise _Unavailable(f"answered {resp.status} with a body that is not JSON") from None
        if resp.status >= 400:
            problems = [(p.get("path", ""), p.get("problem", "")) for p in value.get("problems", [])]
            raise SidecarError(resp.status, str(value.get("error", "")), problems)
        return value

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> None:
        """Close every thread's connection."""
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for c in conns:
            c.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _req(request: Request | Mapping[str, Any]) -> dict[str, Any]:
    return to_dict(request) if isinstance(request, Request) else dict(request)
