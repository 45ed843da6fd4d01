"""The sidecar bench's load generator in Python, for a machine without rustc: what the Rust client's `bench` does.

    python bench/_sidecar_load.py URL TOKEN REQUEST.json THREADS N

THREADS threads, each on one keep-alive HTTP/1.1 connection, post the request's JSON (read once, sent as read) to
`/v1/plan` N times; a plan the kernel made by failing open (a `fail-open...` reason) is counted as
`server_fail_open`, a call this client answered itself (sidecar unreachable, timed out, refused, 5xx, not JSON)
as `fail_open`, and neither is timed. Prints the Rust client's line: `plans= fail_open= server_fail_open= wall_s=
plans_per_s= p50_ms= p99_ms=`. Its threads share one GIL, so its own figures are a Python caller's: `bench/sidecar.py`
prints which client it used.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit


def _worker(url: str, token: str, body: bytes, n: int, out: list[tuple[list[float], int, int]]) -> None:
    parts = urlsplit(url)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
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
    if len(argv) != 5:
        print("usage: _sidecar_load.py URL TOKEN REQUEST.json THREADS N", file=sys.stderr)
        return 2
    url, token, path, threads, n = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    with open(path, "rb") as f:
        body = f.read()
    out: list[tuple[list[float], int, int]] = []
    started = time.perf_counter()
    workers = [threading.Thread(target=_worker, args=(url, token, body, n, out)) for _ in range(threads)]
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
