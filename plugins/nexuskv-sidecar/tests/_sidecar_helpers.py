"""Shared helpers of the sidecar's tests: tokens, requests, a raw HTTP call."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

from nexuskv import Kernel, Layout, ModelIdentity, Request, StateGroup, TokenizerIdentity

ROOT = Path(__file__).resolve().parents[3]
SECRET = bytes(range(32))
TOKENS = {"chat": "chat-token", "rag": "rag-token", "*": "operator-token"}
LAYOUT = Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16)


def make_request(tokens, tenant: str = "chat", request_id: str = "r1", **kw) -> Request:
    return Request(request_id=request_id, tenant=tenant, model=ModelIdentity(name="tiny", revision="1"),
                   tokenizer=TokenizerIdentity(name="tok"), layout=LAYOUT, token_ids=list(tokens), **kw)  # fmt: skip


def commit_all(kernel: Kernel, req: Request, size: int = 64) -> list[bytes]:
    keys = kernel.keys(req)
    for b in range(len(keys)):
        payload = bytes([b % 256]) * size
        assert kernel.put(kernel.describe(req, b, payload, tier="dram", keys=keys), payload)
    return keys


def call(port: int, method: str, path: str, body: Any = None, token: str | None = "chat-token",
         raw: bytes | None = None) -> tuple[int, Any]:
    """One HTTP request on a fresh connection: (status, JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    text = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text.decode()
