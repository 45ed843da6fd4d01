"""Shared helpers for the bench scripts: interleaved timing, RESULT lines, quick mode, a tier bench's descriptor.

What every bench promises, and how `make test` keeps it (tests/test_benches.py):

- A bench is a runnable file of bench/ (one with `if __name__ == "__main__":`; the other files starting with `_`
  are helpers). It ends with one line per goal, `RESULT <name> <value> <op> <goal>` (`result`), and exits 0 even
  when a goal is missed.
- It declares, at module level, `RESULTS`: a tuple of string literals naming every RESULT it prints in full mode
  (`()` for a bench or study that prints none). The test reads it from the source, never importing the bench, and
  also checks that every name written literally in the source (`result("name", ...)`, `"RESULT name ..."`) is in
  it.
- Quick mode, `NEXUSKV_BENCH_QUICK=1` in the environment (read here into `QUICK`, inherited by the processes a
  bench starts): the same code paths at the smallest sizes, fewest repeats and passes (seconds, not minutes),
  every name of `RESULTS` printed (the values mean nothing there, and no goal is checked), nothing written into
  the repository. A name keeps its full-mode size (`..._64` nodes, `..._32k` tokens) in quick mode: `result`
  prints a line before the first RESULT saying so, and a bench whose figure for a name comes from another size
  than the name says prints which, beside it (bench/fleet_sim.py). Each bench picks its sizes with
  `quick(full, small)`. Without the variable a bench runs exactly as it always did.
- A bench that cannot run here because something it needs is missing (a binary, an engine's venv) calls
  `requires(False, why)`: in quick mode it prints `SKIP <why>` and exits 0, and the test is skipped with that
  reason; in full mode it does nothing (the bench goes on as it always did).
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

QUICK = os.environ.get("NEXUSKV_BENCH_QUICK", "") not in ("", "0")
"""Quick mode (`NEXUSKV_BENCH_QUICK=1`): smallest sizes, every RESULT name printed, no goal meant."""


def quick(full: T, small: T) -> T:
    """`small` in quick mode, else `full` (the bench's own size, unchanged)."""
    return small if QUICK else full


def requires(ok: object, why: str) -> None:
    """In quick mode, when `ok` is false: print `SKIP <why>` and exit 0 (the bench test skips, saying why)."""
    if QUICK and not ok:
        print(f"SKIP {why}", flush=True)
        sys.exit(0)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int = 30, inner: int = 5) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternation so drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm up
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                samples[name].append((time.perf_counter() - t0) / inner)
    finally:
        gc.enable()
    return {name: statistics.median(v) for name, v in samples.items()}


_QUICK_NOTED = [False]


def result(name: str, value: float, op: str, goal: float) -> None:
    """Print one RESULT line in the exact format the checker reads.

    In quick mode the first one is preceded by a line saying that the names keep the full run's sizes (`_64`,
    `_32k`, `_16m`: the test checks the names) while the run used the smallest, and that no value is meant.
    """
    if QUICK and not _QUICK_NOTED[0]:
        _QUICK_NOTED[0] = True
        print("quick mode: the RESULT names below keep the full run's sizes (nodes, tokens, blocks, bytes); this run "
              "used the smallest ones, and no value below means anything")  # fmt: skip
    print(f"RESULT {name} {value:.4g} {op} {goal:g}")


def machine_speed() -> str:
    """One line saying how fast this (shared, noisy) machine is right now: BLAKE2b over 128 KiB, best of 20."""
    import hashlib
    import os

    data = os.urandom(128 << 10)
    best = min(_time_once(lambda: hashlib.blake2b(data, digest_size=16).digest()) for _ in range(20))
    return f"machine now: BLAKE2b over 128 KiB in {best * 1e3:.3f} ms (0.17 ms when this machine is calm)"


def _time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def named(store: T, secret: bytes | None = None) -> T:
    """`store`, given the name key of `secret` (default: a fresh one), as the kernel gives every store it opens.

    A tier store used on its own names its objects by the deployment's name key (`StateSeal(secret).name_key`) and
    refuses to work before it has one; a store without names (DRAM) is returned as it is.
    """
    use = getattr(store, "use_name_key", None)
    if use is not None:
        from nexuskv import StateSeal

        use(StateSeal(secret if secret is not None else os.urandom(32)).name_key)
    return store


def tier_descriptor(key: bytes, data: bytes, tier: str) -> Any:
    """A valid descriptor of `data` stored under `key` in `tier` (what a tier bench puts next to its payloads)."""
    from nexuskv import (
        Layout,
        ModelIdentity,
        Namespace,
        Placement,
        StateDescriptor,
        StateGroup,
        TokenizerIdentity,
        TokenSpan,
        checksum,
    )

    return StateDescriptor(key=key.hex(), namespace=Namespace(tenant="bench"), model=ModelIdentity(name="bench"),
                           tokenizer=TokenizerIdentity(name="bench"),
                           layout=Layout(groups=[StateGroup(kind="dense", layers=1)]), span=TokenSpan(0, 16),
                           nbytes=len(data), checksum=checksum(data), placement=Placement(tier, "bench"))  # fmt: skip
