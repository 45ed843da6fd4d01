"""Following a vLLM engine's KV events: what a block costs the router, against keying the same tokens.

A router that follows an engine's event stream (`nexuskv-vllm-events`) decodes each batch, keys every stored block
(one chain step from its parent's key) and writes its index location; evicted blocks come back out. The
unavoidable part, for any consumer of the stream that keys blocks its own way, is decoding the batches and keying
their tokens: that is the baseline (`wire.decode` of every batch, `Kernel.keys` of the same prompts). Measured side
by side, interleaved, on vLLM-shaped batches (block size 128; a prompt's first blocks as a root event, the rest as
a continuation, every other prompt's tail evicted), idle and beside a process burning one core:

- `kv_events.apply_over_keying`: following (decode + apply) per block over decoding and keying per block (goal
  <= 2: the residency's bookkeeping, index writes and evictions at most double the unavoidable work);
- the same beside a busy core (`..._under_load`);
- blocks per second printed, against what an engine produces (a GPU engine prefilling 100k tokens/s fills about
  800 blocks of 128 per second).

    .venv/bin/python bench/kv_events.py
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import interleaved, machine_speed, quick, result
from nexuskv import Kernel, KernelConfig, Layout, ModelIdentity, Namespace, Request, StateGroup, TokenizerIdentity

RESULTS = ("kv_events.apply_over_keying", "kv_events.apply_over_keying_under_load")

PAGE = 128
PROMPTS = quick(64, 4)
BLOCKS = 16  # per prompt: 2,048 tokens
MODEL = ModelIdentity(name="bench", revision="1", weights_hash="b" * 32)
TOKENIZER = TokenizerIdentity(name="tok")
LAYOUT = Layout(groups=(StateGroup(kind="dense", layers=32, kv_heads=8, head_dim=128),), page_size=PAGE)


def workload() -> tuple[list[bytes], list[Request]]:
    """Encoded batches as vLLM publishes them, and the requests of the same prompts."""
    import hashlib

    from nexuskv_vllm_events.testing import encode_batch, removed, stored

    batches, requests = [], []
    for p in range(PROMPTS):
        toks = [(p * 7919 + i * 31) % 50_000 for i in range(BLOCKS * PAGE)]
        hashes = [hashlib.sha256(f"{p}/{b}".encode()).digest() for b in range(BLOCKS)]
        cut = BLOCKS // 2  # the prefill's blocks, then the rest as a continuation
        batches.append(encode_batch([stored(hashes[:cut], None, toks[:cut * PAGE], PAGE, salt="salt-a")]))
        batches.append(encode_batch([stored(hashes[cut:], hashes[cut - 1], toks[cut * PAGE:], PAGE)]))
        if p % 2:
            batches.append(encode_batch([removed(hashes[cut:])]))
        requests.append(Request(request_id=f"r{p}", tenant="a", cache_salt="salt-a", model=MODEL,
                                tokenizer=TOKENIZER, layout=LAYOUT, token_ids=toks))  # fmt: skip
    return batches, requests


def burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def measure(kernel: Kernel, batches: list[bytes], requests: list[Request]) -> tuple[float, float]:
    """(seconds per block following the stream, seconds per block decoding and keying the same batches)."""
    from nexuskv_vllm_events import EngineResidency
    from nexuskv_vllm_events.wire import decode

    def follow() -> None:
        res = EngineResidency(kernel, node="engine-1", model=MODEL, tokenizer=TOKENIZER, layout=LAYOUT,
                              namespaces={"salt-a": Namespace(tenant="a", cache_salt="salt-a")})  # fmt: skip
        for payload in batches:
            res.apply(decode(payload))
        assert res.stats()["stored"] == PROMPTS * BLOCKS
        res.clear()

    def keying() -> None:
        for payload in batches:
            decode(payload)
        for req in requests:
            kernel.keys(req)

    t = interleaved({"follow": follow, "keys": keying}, rounds=quick(25, 2), inner=1)
    blocks = PROMPTS * BLOCKS
    return t["follow"] / blocks, t["keys"] / blocks


def main() -> None:
    print(machine_speed())
    batches, requests = workload()
    cfg = KernelConfig(node="router", page_size=PAGE, tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}})
    with Kernel(cfg, secret=os.urandom(32)) as kernel:
        follow, keys = measure(kernel, batches, requests)
        print(f"idle: following the stream {follow * 1e6:.1f} us/block ({1 / follow:,.0f} blocks/s), decoding and "
              f"keying the same batches {keys * 1e6:.1f} us/block")
        stop = multiprocessing.Event()
        burner = multiprocessing.Process(target=burn, args=(stop,), daemon=True)
        burner.start()
        try:
            time.sleep(0.2)
            follow_l, keys_l = measure(kernel, batches, requests)
        finally:
            stop.set()
            burner.join(5)
        print(f"beside a busy core: following {follow_l * 1e6:.1f} us/block ({1 / follow_l:,.0f} blocks/s), "
              f"decoding and keying {keys_l * 1e6:.1f} us/block")
    result("kv_events.apply_over_keying", follow / keys, "<=", 2)
    result("kv_events.apply_over_keying_under_load", follow_l / keys_l, "<=", 2)


if __name__ == "__main__":
    main()
