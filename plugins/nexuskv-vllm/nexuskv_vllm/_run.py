"""`python -m nexuskv_vllm._run SPEC OUT`: run requests on a fresh vLLM engine in this process, write results.

SPEC (JSON): {"model": dir, "kv_transfer_config": {...} | null, "enable_lora": bool, "requests": [{"tokens":
[...], "tenant": ..., "scope": ..., "cache_salt": ..., "lora": [name, id, path] | null, "max_tokens": 8}]}.
OUT (JSON): {"outputs": [[ids...], ...], "stats": the worker connector's counters or null}. Tests use it for a
reference run without a connector and for a restart (a second engine process after the first has exited).
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from pathlib import Path

    from nexuskv_vllm.testing import Engine

    spec = json.loads(Path(spec_path).read_text())
    engine = Engine(spec["model"], kv_transfer_config=spec.get("kv_transfer_config"),
                    enable_lora=bool(spec.get("enable_lora")))  # fmt: skip
    outputs = []
    for r in spec["requests"]:
        lora = tuple(r["lora"]) if r.get("lora") else None
        outputs.append(engine.generate(r["tokens"], tenant=r.get("tenant"), scope=r.get("scope"),
                                       cache_salt=r.get("cache_salt"), lora=lora,  # type: ignore[arg-type]
                                       max_tokens=r.get("max_tokens", 8)))  # fmt: skip
    conn = engine.connector
    stats = dict(conn.worker.stats) if conn is not None and hasattr(conn, "worker") else None
    Path(out_path).write_text(json.dumps({"outputs": outputs, "stats": stats}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
