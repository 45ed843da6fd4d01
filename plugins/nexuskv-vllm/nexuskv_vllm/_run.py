"""`python -m nexuskv_vllm._run SPEC OUT`: run requests on a fresh vLLM engine in this process, write results.

SPEC (JSON): {"model": dir, "kv_transfer_config": {...} | null, "enable_lora": bool, "executor": "uni" | "mp",
"tensor_parallel_size": n, "requests": [{"tokens": [...], "tenant": ..., "scope": ..., "cache_salt": ..., "lora":
[name, id, path] | null, "max_tokens": 8, "delete": [glob, ...], "hang_s": s, "alongside": [[ids...], ...]}]}; a
request's `delete` globs name files removed before it runs (a fault: state gone behind the kernels' backs), after
every rank's kernel has flushed its writer and its write-behind tiers (`Kernel.flush`), so that what the earlier
requests saved is on disk to be removed: without it a write still queued lands after the deletion and is loaded;
`hang_s` makes every read of the in-process worker's disk tier after the first take that long while it runs (a
fault: a tier that stops answering); `alongside` runs other prompts together with it (`Engine.race`), and the
result's "race" entry lists each one's output and seconds to finish.
OUT (JSON): {"outputs": [[ids...], ...], "stats": the worker connector's counters (uni) or null, "counters": the
connector's Prometheus counters after each request (from vLLM's registry, whatever the executor), "deletes": per
request with `delete`, {"request": i, "before_flush": files the globs matched before the flush, "removed": files
removed after it, "flushed": each rank's `Kernel.flush` result}}. Tests use it
for a reference run without a connector, for a restart (a second engine process after the first has exited), and
for engines with worker processes (`mp`, tensor parallelism).
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    import os
    from pathlib import Path

    from nexuskv_vllm.testing import Engine

    spec = json.loads(Path(spec_path).read_text())
    kv = spec.get("kv_transfer_config")
    engine = Engine(spec["model"], kv_transfer_config=kv, enable_lora=bool(spec.get("enable_lora")),
                    executor=spec.get("executor", "uni"), tensor_parallel_size=spec.get("tensor_parallel_size", 1),
                    log_stats=kv is not None)  # fmt: skip
    outputs, counters, deletes = [], [], []
    for i, r in enumerate(spec["requests"]):
        if r.get("delete"):
            before = len(_matched(r["delete"]))
            flushed = engine.llm.collective_rpc(_flush_kernel) if kv is not None else []  # every rank's kernel
            gone = _matched(r["delete"])
            for path in gone:
                os.unlink(path)
            deletes.append({"request": i, "before_flush": before, "removed": len(gone), "flushed": flushed})
        lora = tuple(r["lora"]) if r.get("lora") else None
        if r.get("hang_s") or r.get("alongside"):
            outputs.append(_race(engine, r))
            counters.append(engine.counters() if kv is not None else {})
            continue
        outputs.append(engine.generate(r["tokens"], tenant=r.get("tenant"), scope=r.get("scope"),
                                       cache_salt=r.get("cache_salt"), lora=lora,  # type: ignore[arg-type]
                                       max_tokens=r.get("max_tokens", 8)))  # fmt: skip
        counters.append(engine.counters() if kv is not None else {})
    conn = engine.connector
    stats = dict(conn.worker.stats) if conn is not None and hasattr(conn, "worker") else None
    out = {"outputs": outputs, "stats": stats, "counters": counters, "deletes": deletes}
    Path(out_path).write_text(json.dumps(out))


def _matched(patterns: list[str]) -> list[str]:
    import glob

    return [path for pattern in patterns for path in glob.glob(pattern, recursive=True)]


def _flush_kernel(worker: object) -> bool:
    """On each worker (vLLM's `collective_rpc`): wait until its connector's kernel has written what it queued."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return bool(get_kv_transfer_group().kernel.flush(60))  # type: ignore[attr-defined]


def _race(engine: object, r: dict) -> dict:
    """Run a request with others alongside, its worker's disk tier hanging after the first read if asked."""
    import time

    store = engine.connector.kernel.tiers["disk"] if r.get("hang_s") else None  # type: ignore[attr-defined]
    real, reads = (store.get if store is not None else None), []

    def hanging(slot: bytes) -> object:
        reads.append(slot)
        if len(reads) >= 2:
            time.sleep(r["hang_s"])
        return real(slot)

    if store is not None:
        store.get = hanging
    try:
        got = engine.race([r["tokens"], *r.get("alongside", [])], tenant=r.get("tenant"),  # type: ignore[attr-defined]
                          max_tokens=r.get("max_tokens", 8))  # fmt: skip
    finally:
        if store is not None:
            del store.get
    return {"race": [{"output": out, "done_s": s} for out, s in got], "reads": len(reads)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
