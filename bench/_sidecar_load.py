"""The sidecar bench's load generator in Python, for a machine without rustc: what the Rust client's `bench` does.

    python bench/_sidecar_load.py URL TOKEN REQUEST.json THREADS N [json|binary]

THREADS threads, each on one keep-alive HTTP/1.1 connection, post the request's JSON (read once, sent as read)
to `/v1/plan` N times (`binary`: encoded once as `application/x-nexuskv-tokens` by the sidecar's own encoder).
A plan the kernel made by failing open (a `fail-open...` reason) is counted as `server_fail_open`, a call this
client answered itself (sidecar unreachable, timed out, refused, 5xx, not JSON) as `fail_open`, and neither is
timed. Prints the Rust client's line: `plans= fail_open= server_fail_open= wall_s= plans_per_s= p50_ms= p99_ms=`.
Its threads share one GIL, so its own figures are a Python caller's: `bench/sidecar.py` prints which client it used.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit


def _worker(url: str, token: str, body: bytes, n: int, out: list[tuple[list[float], int, int]],
            content_type: str) -> None:  # fmt: skip
    parts = urlsplit(url)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": content_type}
    conn: http.client.HTTPConnection | None = None
    lat: list[float] = []
    fail_open = server_fail_open = 0
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            if conn is None:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
            conn.request("POST", "/v1/plan", body=body, headers=headers)
            resp = conn.getresponse()
            text = resp.read()
            reasons = json.loads(text).get("reasons", []) if resp.status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            fail_open += 1  # the client plans recompute on its own; the connection is made again
            if conn is not None:
                conn.close()
            conn = None
            continue
        if reasons is None:  # refused (4xx) or failed (5xx): no plan from the sidecar, as the Rust client counts it
            fail_open += 1
            continue
        if any(str(r).startswith("fail-open") for r in reasons):
            server_fail_open += 1
        else:
            lat.append((time.perf_counter() - t0) * 1e3)
    if conn is not None:
        conn.close()
    out.append((lat, fail_open, server_fail_open))


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 6) or argv[5:] not in ([], ["json"], ["binary"]):
        print("usage: _sidecar_load.py URL TOKEN REQUEST.json THREADS N [json|binary]", file=sys.stderr)
        return 2
    url, token, path, threads, n = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    with open(path, "rb") as f:
        body = f.read()
    content_type = "application/json"
    if argv[5:] == ["binary"]:
        from nexuskv_sidecar._binary import CONTENT_TYPE, encode

        head = json.loads(body)
        body, content_type = encode(head, head.pop("token_ids")), CONTENT_TYPE
    out: list[tuple[list[float], int, int]] = []
    started = time.perf_counter()
    workers = [threading.Thread(target=_worker, args=(url, token, body, n, out, content_type)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    lat = sorted(x for got in out for x in got[0])

    def pct(q: float) -> float:
        return lat[min(int(len(lat) * q), len(lat) - 1)] if lat else float("nan")

    print(f"plans={len(lat)} fail_open={sum(g[1] for g in out)} server_fail_open={sum(g[2] for g in out)} "
          f"wall_s={wall:.3f} plans_per_s={len(lat) / wall:.1f} p50_ms={pct(0.5):.4f} p99_ms={pct(0.99):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
