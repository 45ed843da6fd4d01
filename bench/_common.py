"""Shared helpers for the bench scripts: interleaved timing and RESULT lines."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable


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


def result(name: str, value: float, op: str, goal: float) -> None:
    """Print one RESULT line in the exact format the checker reads."""
    print(f"RESULT {name} {value:.4g} {op} {goal:g}")
