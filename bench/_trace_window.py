"""A window of a Mooncake-format trace, written for `vllm bench serve`'s `timed_trace` dataset, and its ideal reuse.

The Mooncake trace (../shared/traces/mooncake_synthetic_trace.jsonl) lists per request `timestamp` (ms),
`input_length`, `output_length` and `hash_ids`: one id per 512-token prefix block, equal ids at equal positions being
equal blocks. `timed_trace` expands each id into `--timed-trace-chunk-hash-size` tokens (the same tokens for the same
id within one run) and stops at `input_length`, so a window written with `input_length = len(hash_ids) * chunk`
replays the trace's sharing at `chunk` tokens a block. Output lengths are capped (this machine decodes on one core).

`ideal reuse` is the fraction of the window's prompt tokens that sit in whole engine blocks (`block` tokens, vLLM's
128) whose entire prefix an earlier request of the window already had: what an unbounded prefix cache could skip.
"""

from __future__ import annotations

import json
from pathlib import Path

from attrs import frozen


@frozen
class Window:
    """What was written: the file and the figures that size a replay of it."""

    path: Path
    requests: int
    span_s: float  # the trace's own arrival span (first to last timestamp)
    prompt_tokens: int
    reusable_tokens: int  # in whole engine blocks whose prefix an earlier request had
    distinct_blocks: int  # whole engine blocks with distinct prefixes: what holding everything takes
    max_prompt: int
    output_tokens: int

    @property
    def ideal_reuse(self) -> float:
        return self.reusable_tokens / max(1, self.prompt_tokens)


def write_window(source: Path, dest: Path, *, start: int, count: int, chunk: int, output_cap: int,
                 block: int = 128) -> Window:  # fmt: skip
    """Requests `start` .. `start + count` of `source` (a negative start counts from the end), rebased to t = 0."""
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    picked = [json.loads(line) for line in (lines[start:start + count] if start >= 0 else lines[start:][:count])]
    if not picked:
        raise ValueError(f"{source}: no requests at {start}:{count} (it has {len(lines)})")
    t0 = picked[0]["timestamp"]
    per_block = block // chunk
    seen: set[tuple[int, ...]] = set()
    prompt = reusable = longest = out_total = 0
    with dest.open("w") as f:
        for rec in picked:
            ids = list(rec["hash_ids"])
            n = len(ids) * chunk
            out = max(1, min(int(rec["output_length"]), output_cap))
            f.write(json.dumps({"timestamp": rec["timestamp"] - t0, "input_length": n, "output_length": out,
                                "hash_ids": ids}) + "\n")  # fmt: skip
            whole = n // block
            hit = 0  # vLLM computes a prompt's last token whatever it holds: a hit ends before it
            while hit < (n - 1) // block and tuple(ids[: (hit + 1) * per_block]) in seen:
                hit += 1
            seen.update(tuple(ids[: (b + 1) * per_block]) for b in range(whole))
            prompt, reusable, longest, out_total = prompt + n, reusable + hit * block, max(longest, n), out_total + out
    return Window(dest, len(picked), (picked[-1]["timestamp"] - t0) / 1e3, prompt, reusable, len(seen), longest,
                  out_total)  # fmt: skip


def write_unique(dest: Path, *, count: int, tokens: int, output: int, chunk: int, rate_per_s: float,
                 seed: int = 0) -> Path:  # fmt: skip
    """`count` requests of `tokens` tokens sharing no block (every hash id new), Poisson arrivals at `rate_per_s`.

    For `timed_trace` with `--timed-trace-chunk-hash-size chunk` and a sec multiplier of 0.001. vLLM's `random`
    dataset would not do here: its prompts are runs of consecutive token ids from a random offset, and with the
    bench model's 500-token vocabulary two of 60 prompts share their whole prompt more often than not.
    """
    import random

    rng = random.Random(seed)
    per = -(-tokens // chunk)
    t = 0.0
    with dest.open("w") as f:
        for i in range(count):
            ids = list(range(1_000_000 + i * per, 1_000_000 + (i + 1) * per))
            f.write(json.dumps({"timestamp": round(t * 1e3, 3), "input_length": tokens, "output_length": output,
                                "hash_ids": ids}) + "\n")  # fmt: skip
            t += rng.expovariate(rate_per_s)
    return dest
