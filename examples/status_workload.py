"""A small live workload to look at with `nexuskv status`: one kernel serving /metrics and /status until Ctrl-C.

Run: `.venv/bin/python examples/status_workload.py [PORT]` (default 9400), then in another terminal
`.venv/bin/nexuskv status --watch http://127.0.0.1:9400` (docs/operations.md shows the view it gives). Three
tenants (the shipped policies) send multi-turn chats, documents and one-off prompts; a small DRAM tier demotes
to a second, slower tier ("disk": a DRAM store priced as disk) from which revisited conversations are read; the
connector reports a measured TTFT near the predicted one; now and then a payload rots (it is quarantined) or a
load times out (its tier's breaker opens, and closes again on the next good load).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

from nexuskv import Kernel, KernelConfig, Layout, LoadReport, ModelIdentity, Request, StateGroup, TokenizerIdentity

ROOT = Path(__file__).resolve().parents[1]


def main(port: int) -> None:
    os.environ.setdefault("NEXUSKV_DEADLINE_MS", "50")  # a shared laptop core: plans are real, not deadline misses
    cfg = KernelConfig(node="gpu-0", policies=str(ROOT / "policies"), metrics_port=port, decision_log_level="off",
                       breaker_cooldown_s=3.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "2MiB"},
                              "disk": {"store": "dram", "capacity_bytes": "16MiB"}})  # fmt: skip
    layout = Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16)
    rng = random.Random(7)
    docs = [[rng.randrange(50_000) for _ in range(512)] for _ in range(3)]  # rag: a few long shared documents
    chats: dict[int, list[int]] = {}  # chat: 40 conversations, revisited at random (older ones sit in "disk")
    with Kernel(cfg) as k:
        print(f"serving http://127.0.0.1:{k.metrics.port}/metrics and /status", flush=True)
        n = 0
        while True:
            n += 1
            tenant = rng.choice(("chat", "chat", "chat", "rag", "strict"))
            if tenant == "chat":
                conv = rng.randrange(40)
                turn = chats.get(conv, [])
                tokens = chats[conv] = (turn if len(turn) < 1500 else []) + [rng.randrange(50_000)
                                                                            for _ in range(rng.randrange(32, 160))]
            elif tenant == "rag":
                tokens = rng.choice(docs) + [rng.randrange(50_000) for _ in range(rng.randrange(16, 64))]
            else:
                tokens = [rng.randrange(50_000) for _ in range(rng.randrange(64, 400))]
            req = Request(request_id=f"req-{n}", tenant=tenant, model=ModelIdentity(name="llama-8b", revision="1"),
                          tokenizer=TokenizerIdentity(name="llama"), layout=layout, token_ids=tokens)
            keys = k.keys(req)
            plan = k.plan(req, keys=keys)
            if plan.tokens_reused:
                got = k.materialize(plan, req, keys=keys)
                measured = plan.predicted.ttft_ms * rng.uniform(0.9, 1.3)
                if n % 301 == 0:  # the engine's GPU copy timed out
                    k.report_load_result(plan, LoadReport(ok=False, failed_block=0, tier=plan.spans[0].tier,
                                                          timeout=True, reason="copy timed out"), keys=keys)
                else:
                    k.report_load_result(plan, LoadReport(ok=got.complete, measured_ttft_ms=measured), keys=keys)
            new = range(plan.tokens_reused // layout.page_size, len(keys))  # what prefill produced: the rest
            k.commit(req, {(b, 0): rng.randbytes(2048) for b in new}, keys=keys)
            if n % 250 == 0:  # bit rot in the DRAM tier
                store = k.tiers["dram"]
                slot = next(iter(store.slots()), None)
                held = store.get(slot) if slot is not None else None
                if held is not None:
                    store.put(slot, b"\x00" * 64, held.descriptor)
                    k.load(slot[:-1], slot[-1], tier="dram")
            time.sleep(0.05)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9400)
