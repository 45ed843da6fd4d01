"""The sidecar's plan over HTTP on loopback: p99 round trip of a 4k-token request, and plans per second.

Run: `.venv/bin/python bench/sidecar.py` (about a minute). The sidecar (`nexuskv-sidecar`: uvicorn + httptools +
uvloop, one process) serves a real kernel in this process: the shipped policies (tenant `chat`), a DRAM tier holding
every block of the probe request (real payloads) and an index of 10^5 other blocks; decision logging stays on (JSON
lines rendered into a memory stream), so the figures include it. The callers are the Rust client (`clients/rust`,
built here with rustc; std only, one keep-alive connection per thread) in another process, so the load generator
does not share this process's GIL; without rustc, a Python caller (`bench/_sidecar_load.py`) in another process.

1. Latency: one connection, 3 passes of 2,000 sequential plans of the 4,096-token request (a 26 KB JSON body: the
   token ids travel with each request, and the sidecar computes the block keys). p99 is the median over passes
   of each pass's p99, HTTP round trip included. Beside it, the same plan in this process without HTTP (the
   baseline: what the HTTP layer adds).
2. Throughput: 4 connections planning flat out for 3 passes of 1,500 plans each; plans/s = answered plans / wall
   time, median over passes. Then, for scale only (no goal), one pass each with 1,024- and 256-token requests
   (their blocks held too), and where a 4k plan's time goes inside the server (parse and check vs plan). Per
   configuration, one more throughput pass beside a process that burns one core (no goal: what load from
   another process on this 2-core machine costs; the goals are read on the quiet passes).
5. Isolation: while another tenant (its own token, another process) sends 50 MB plan bodies flat out on two
   connections, one connection of this tenant plans the 4k request 2,000 times: its p99 under abuse, beside the
   same pass without abuse, and what the abuser got (every answer counted by status). After three refusals in ten
   seconds the sidecar holds that token's next oversize connections, unread, before it answers them (at most
   `oversize_holds_per_token`); printed beside it, with no goal, the same pass under a wider flood (three times
   that many connections: the rest are refused and closed at once) and beside a process that only burns a core.
Plans the kernel answered by failing open (`fail-open: ...` reasons: a deadline passed under load) and calls the
client answered itself (sidecar unreachable / timed out) are counted and printed, never timed and never counted
as plans per second.
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson  # the sidecar's JSON parser (it brings orjson)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_speed, quick, result
from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    Location,
    ModelIdentity,
    Request,
    StateGroup,
    TokenizerIdentity,
    configure_logging,
    from_json,
    to_dict,
)
from nexuskv_sidecar import Sidecar, SidecarConfig, _binary, digest

RESULTS = ("sidecar.plan_p99_ms_4k", "sidecar.plans_per_s", "sidecar.victim_plan_p99_ms_under_abuse")
ROOT = Path(__file__).resolve().parents[1]
INDEX_BLOCKS = quick(100_000, 2_000)
PASSES = quick(3, 1)
LATENCY, THROUGHPUT, VICTIM = quick((2000, 1500, 2000), (50, 50, 50))  # plans per pass
WARMUP, PARTS = quick((300, 300), (10, 3))
CONNECTIONS = 8  # throughput callers: 8 keep-alive connections, spread by the kernel over the workers' accepts
CONFIGS = [(1, "json"), (1, "binary"), (2, "binary"), (2, "json")]  # (HTTP processes, body encoding)
GOAL_CONFIG = (2, "binary")
RUST = ROOT / "plugins" / "nexuskv-sidecar" / "clients" / "rust" / "src" / "main.rs"
PAGE = 16
TOKEN = "bench-token"
ABUSER = "abuser-token"
ABUSE = r"""
import http.client, sys, threading, time
host, port, token, width = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
body = b'{"request_id": "x", "token_ids": [' + b"1," * (25 << 20) + b'1]}'  # about 50 MB
done, counts, lock = threading.Event(), {}, threading.Lock()
def flood():
    while not done.is_set():
        try:
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("POST", "/v1/plan", body=body, headers={"Authorization": "Bearer " + token,
                                                                  "Content-Type": "application/json"})
            status = str(conn.getresponse().status)
            conn.close()
        except OSError as e:
            status = type(e).__name__
        with lock:
            counts[status] = counts.get(status, 0) + 1
threads = [threading.Thread(target=flood, daemon=True) for _ in range(width)]
for t in threads: t.start()
sys.stdin.read()  # until the bench closes it
done.set()
print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())))
"""
rng = random.Random(7)
LAYOUT = Layout(groups=[StateGroup(kind="dense", layers=4, kv_heads=2, head_dim=64)], page_size=PAGE)


def request(n: int) -> Request:
    tokens = [1, *(rng.randrange(3, 128_000) for _ in range(n - 1))]  # a BOS token, then a real vocabulary's ids
    return Request(request_id=f"r{n}", tenant="chat", model=ModelIdentity(name="tiny-llama", revision="1"),
                   tokenizer=TokenizerIdentity(name="tiny-bpe"), layout=LAYOUT, token_ids=tokens)  # fmt: skip


def build_client(tmp: str) -> list[str]:
    """The load generator's command prefix: the Rust client when rustc is here, else the Python one."""
    rustc = shutil.which("rustc") or str(Path.home() / ".cargo" / "bin" / "rustc")
    if Path(rustc).exists():
        out = Path(tmp) / "nexuskv-client"
        subprocess.run([rustc, "--edition", "2021", "-O", str(RUST), "-o", str(out)], check=True, capture_output=True)
        return [str(out), "bench"]
    return [sys.executable, str(Path(__file__).resolve().parent / "_sidecar_load.py")]


def load(client: list[str], url: str, body: str, threads: int, n: int, encoding: str = "json") -> dict[str, float]:
    res = subprocess.run([*client, url, TOKEN, body, str(threads), str(n), encoding], capture_output=True, text=True,
                         check=True, timeout=600)  # fmt: skip
    return {k: float(v) for k, v in (kv.split("=") for kv in res.stdout.split())}


def in_process(k: Kernel, req: Request, n: int) -> tuple[float, int]:
    """p99 (ms) of the same plan made in this process, no HTTP; and how many plans failed open (not timed)."""
    lat, fell = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        plan = k.plan(req)
        took = (time.perf_counter() - t0) * 1e3
        if plan.tokens_reused == len(req.token_ids):
            lat.append(took)
        else:
            fell += 1
    lat.sort()
    return (lat[int(0.99 * len(lat))] if lat else float("nan")), fell


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user + system, all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def burning_a_core() -> Iterator[None]:
    """A process that burns one core (and sends nothing) while the block runs: what load from elsewhere does."""
    spin = subprocess.Popen([sys.executable, "-c", "import sys, threading\n"
                             "threading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n"
                             "sys.stdin.read()"], stdin=subprocess.PIPE)  # fmt: skip
    try:
        yield
    finally:
        spin.communicate(b"", timeout=60)


def measure(client: list[str], sc: Sidecar, body: str, encoding: str, k: Kernel, req: Request,
            base: list[float]) -> dict[str, float]:  # fmt: skip
    """Latency on one connection and plans/s on `CONNECTIONS`, `PASSES` passes each, against the sidecar `sc`.

    For each throughput pass, the CPU time each sidecar process used per plan answered: a figure a busy machine
    moves less than plans/s (it counts what the sidecar did, not what it waited for).
    """
    url = sc.url
    pids = [os.getpid()] + (sc.workers.pids if sc.workers is not None else [])
    load(client, url, body, 1, WARMUP, encoding)  # warm up
    print("1. latency, one connection (ms)")
    p99s = []
    for i in range(PASSES):
        got = load(client, url, body, 1, LATENCY, encoding)
        b99, bfell = in_process(k, req, LATENCY)
        base.append(b99)
        p99s.append(got["p99_ms"])
        print(f"  pass {i}: http p50 {got['p50_ms']:.3f} p99 {got['p99_ms']:.3f}; in-process p99 {b99:.3f} "
              f"({bfell} failed open); plans {got['plans']:.0f}, kernel fail-open {got['server_fail_open']:.0f}, "
              f"client fail-open {got['fail_open']:.0f}")  # fmt: skip
    print(f"2. throughput, {CONNECTIONS} connections")
    rates, dropped = [], 0.0
    for i in range(PASSES):
        before = [cpu_s(p) for p in pids]
        got = load(client, url, body, CONNECTIONS, THROUGHPUT, encoding)
        used = [(cpu_s(p) - b) * 1e3 / max(got["plans"], 1) for p, b in zip(pids, before, strict=True)]
        rates.append(got["plans_per_s"])
        dropped += got["server_fail_open"] + got["fail_open"]
        where = " + ".join(f"{u:.3f}" for u in used)
        print(f"  pass {i}: {got['plans_per_s']:.0f} plans/s (p50 {got['p50_ms']:.3f} p99 {got['p99_ms']:.3f} ms); "
              f"kernel fail-open {got['server_fail_open']:.0f}, client fail-open {got['fail_open']:.0f}; CPU ms per "
              f"plan, {'kernel process + workers' if len(used) > 1 else 'the one process'}: {where} = "
              f"{sum(used):.3f}")  # fmt: skip
    with burning_a_core():  # not a goal: what another process's load on this 2-core machine costs
        busy = load(client, url, body, CONNECTIONS, THROUGHPUT, encoding)
    print(f"  beside a process burning one core: {busy['plans_per_s']:.0f} plans/s (p99 {busy['p99_ms']:.3f} ms); "
          f"kernel fail-open {busy['server_fail_open']:.0f}, client fail-open {busy['fail_open']:.0f}")  # fmt: skip
    return {"p99": statistics.median(p99s), "rate": statistics.median(rates), "dropped": dropped,
            "busy": busy["plans_per_s"]}  # fmt: skip


def parse_binary(body: bytes, ints: bool = True) -> Any:
    """A binary body parsed by the sidecar's own code (`nexuskv_sidecar._binary`).

    The whole request; or, `ints` false, what a worker hands the kernel's process: the checked request without
    ids, and the ids as uint32s.
    """
    document, ids = _binary.split(body, 1 << 19)
    return _binary.with_tokens(document, ids) if ints else _binary.Parsed(_binary.head(document), ids)


def abuse(client: list[str], url: str, body: str, host: str, port: str, width: int) -> tuple[dict[str, float], str]:
    """One victim pass of 2,000 plans while the abuser floods on `width` connections; and what the abuser got."""
    abuser = subprocess.Popen([sys.executable, "-c", ABUSE, host, port, ABUSER, str(width)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(1.0)  # the flood is on before the first victim plan
    try:
        victim = load(client, url, body, 1, VICTIM)
    finally:
        got, _ = abuser.communicate("", timeout=60)
    return victim, got.strip()


def _time(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    configure_logging(json=True, stream=io.StringIO(), force=True)  # rendered, then dropped
    tmp = tempfile.mkdtemp(prefix="nexuskv-sidecar-bench-")
    cfg = KernelConfig(node="node-a", policies=str(ROOT / "policies"),
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1GiB"}})  # fmt: skip
    with Kernel(cfg, secret=os.urandom(32)) as k:
        print(machine_speed())
        print(f"keyer {type(k.keyer).__name__}, matcher {type(k.index).__name__}")
        req = request(4096)
        keys = k.keys(req)
        for b in range(len(keys)):
            payload = rng.randbytes(1024)
            assert k.put(k.describe(req, b, payload, tier="dram", keys=keys), payload)
        dram = Location("dram", "node-a", k.epoch)
        while len(k.index) < INDEX_BLOCKS:
            tokens = array.array("I", rng.randbytes(4 * 16384)).tolist()
            k.index.insert_many(k.keyer.extend(os.urandom(16), tokens), dram)
        print(f"index: {len(k.index)} blocks")
        body = Path(tmp) / "request.json"
        body.write_text(json.dumps(to_dict(req)))
        head = to_dict(req)
        (Path(tmp) / "request.bin").write_bytes(_binary.encode(head, head.pop("token_ids")))
        print(f"request: {len(req.token_ids)} tokens, {body.stat().st_size} bytes of JSON")
        client = build_client(tmp)
        print(f"client: {'rust' if 'bench' in client else 'python'}")
        tokens = {digest(TOKEN): "chat", digest(ABUSER): "rag"}
        figures: dict[tuple[int, str], dict[str, float]] = {}
        base: list[float] = []
        for workers, encoding in CONFIGS:
            print(f"\n== {workers} worker{'s' if workers > 1 else ''} "
                  f"({'HTTP in the kernel process' if workers == 1 else 'HTTP processes asking the kernel process'}), "
                  f"{encoding} bodies")  # fmt: skip
            with Sidecar(SidecarConfig(port=0, tokens=tokens, workers=workers), kernel=k) as sc:
                figures[workers, encoding] = measure(client, sc, str(body), encoding, k, req, base)
        p99, rate = (figures[GOAL_CONFIG][x] for x in ("p99", "rate"))
        print("\nsummary (median over passes): config -> one-connection p99 ms, plans/s on "
              f"{CONNECTIONS} connections")  # fmt: skip
        for (workers, encoding), f in figures.items():
            mark = "  <- the goals' configuration" if (workers, encoding) == GOAL_CONFIG else ""
            print(f"  {workers} worker{'s' if workers > 1 else ' '} {encoding:6s}  p99 {f['p99']:.3f}  "
                  f"plans/s {f['rate']:.0f} ({f['busy']:.0f} beside a burning core)  fail-opens "
                  f"{f['dropped']:.0f}{mark}")  # fmt: skip
        sc = Sidecar(SidecarConfig(port=0, tokens=tokens), kernel=k)
        sc.start()
        try:
            print("\n3. for scale: throughput by request size, one worker, JSON, 4 connections (one pass each)")
            for n in (1024, 256):
                small = request(n)
                keys = k.keys(small)
                for b in range(len(keys)):
                    payload = rng.randbytes(1024)
                    assert k.put(k.describe(small, b, payload, tier="dram", keys=keys), payload)
                f = Path(tmp) / f"request-{n}.json"
                f.write_text(json.dumps(to_dict(small)))
                got = load(client, sc.url, str(f), 4, THROUGHPUT)
                print(f"  {n} tokens: {got['plans_per_s']:.0f} plans/s (p99 {got['p99_ms']:.3f} ms); kernel fail-open "
                      f"{got['server_fail_open']:.0f}, client fail-open {got['fail_open']:.0f}")  # fmt: skip
            raw = body.read_bytes()
            binary = (Path(tmp) / "request.bin").read_bytes()
            parsed = parse_binary(binary, ints=False)
            keys = k.keys(req)
            parts = {  # what one 4k plan costs the server, part by part (public calls the handler makes)
                "JSON parse alone (orjson)": lambda: orjson.loads(raw),
                "parse, check and build the request (from_json)": lambda: from_json(Request, raw),
                "the same from the binary encoding": lambda: parse_binary(binary),
                "the same, ids kept as uint32s (a worker)": lambda: parse_binary(binary, ints=False),
                "the request's 4,096 Python ints (kernel process)": parsed.request,
                "block keys of the request": lambda: k.keys(req),
                "plan with its keys given": lambda: k.plan(req, keys=keys),
                "plan, keys computed inside": lambda: k.plan(req),
            }
            print(f"\n4. inside the server, per 4k plan (best of {PASSES} x {PARTS}, this process), ms:")
            for name, fn in parts.items():
                print(f"  {name:48s} {min(_time(fn, PARTS) for _ in range(PASSES)) * 1e3:.3f}")
            print("  the rest of a round trip is HTTP (uvicorn, httptools, uvloop) and the caller")
            print("\n5. isolation (one worker, JSON): this tenant's 4k plans while another sends 50 MB plan bodies")
            quiet = load(client, sc.url, str(body), 1, VICTIM)
            host, port = sc.url.removeprefix("http://").rsplit(":", 1)
            abused, got_abuser = abuse(client, sc.url, str(body), host, port, 2)
            print(f"  the abuser's answers: {got_abuser or 'none'}")
            victim = abused["p99_ms"]
            wide, got_wide = abuse(client, sc.url, str(body), host, port, 3 * sc.config.oversize_holds_per_token)
            with burning_a_core():  # the control: the same pass beside a process that only burns one core
                busy = load(client, sc.url, str(body), 1, VICTIM)
            print(f"  without abuse: p50 {quiet['p50_ms']:.3f} p99 {quiet['p99_ms']:.3f} ms; under abuse: p50 "
                  f"{abused['p50_ms']:.3f} p99 {victim:.3f} ms ({victim / quiet['p99_ms']:.2f}x); kernel fail-open "
                  f"{abused['server_fail_open']:.0f}, client fail-open {abused['fail_open']:.0f}")  # fmt: skip
            print(f"  a wider flood, {3 * sc.config.oversize_holds_per_token} connections (past the "
                  f"{sc.config.oversize_holds_per_token} held per token, the rest refused and closed at once): p50 "
                  f"{wide['p50_ms']:.3f} p99 {wide['p99_ms']:.3f} ms; kernel fail-open {wide['server_fail_open']:.0f}, "
                  f"client fail-open {wide['fail_open']:.0f}; the abuser's answers: {got_wide or 'none'}")
            print(f"  control, beside a process burning one core and sending nothing: p50 {busy['p50_ms']:.3f} p99 "
                  f"{busy['p99_ms']:.3f} ms ({os.cpu_count()} cores: the abuser's own CPU is this machine's)")
        finally:
            sc.close()
        print(f"\nthe goals' p99 over the in-process plan's p99: {p99 / statistics.median(base):.2f}")
        shutil.rmtree(tmp, ignore_errors=True)
    result("sidecar.plan_p99_ms_4k", p99, "<=", 2)
    result("sidecar.plans_per_s", rate, ">=", 2000)
    result("sidecar.victim_plan_p99_ms_under_abuse", victim, "<=", 5)


if __name__ == "__main__":
    main()
