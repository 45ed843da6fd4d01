"""The Mooncake tier against Mooncake itself: the tier's get of 16 MiB payloads over `get_into` a registered buffer.

Both sides run in this process on one Mooncake client (the tier's), against a mooncake_master this script starts
on 127.0.0.1 (the CPU build, TCP): the tier reads header + payload with `get_buffer` and returns a view of it, the
baseline `get_into`s the bare payload into a registered buffer of the same size. Interleaved rounds, medians.
Put is shown too (the tier copies header + payload into its staging buffer; the baseline `put_from`s in place).

Run: `.venv/bin/python bench/mooncake.py` (well under a minute).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the `mooncake` package it measures: keep its folder behind site-packages on the path, so
# `import mooncake` finds the package and `_tier_mooncake` / `_common` are still found here.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE)]

from _common import machine_speed, quick, requires, result  # noqa: E402
from nexuskv import configure_logging  # noqa: E402

RESULTS = ("tier.mooncake_get_over_native_get_16m",)
BIG = quick(16 << 20, 2 << 20)  # quick mode: 2 MiB stands for the 16 MiB payload (a segment is 12x, >= 16 MiB)


def _missing() -> str:
    """Why Mooncake cannot run here ("" when it can)."""
    try:
        from nexuskv_tier_mooncake.testing import usable
    except ImportError as exc:
        return f"nexuskv-tier-mooncake is not installed ({exc})"
    return usable()


def main() -> None:
    requires(not (why := _missing()), why)
    import _tier_mooncake

    configure_logging(level="warning", force=True)
    print(machine_speed())
    rows = _tier_mooncake.run(**quick({}, {"sizes": (1 << 20, BIG), "rounds": 4}))
    print("baseline: Mooncake's own get_into / put_from of the same bytes, registered buffer, same client")
    for r in rows:
        print(f"mooncake {r['size'] >> 20:>3} MiB  get {r['get_s'] * 1e3:8.3f} ms vs {r['base_get_s'] * 1e3:8.3f} ms "
              f"(x{r['get_s'] / r['base_get_s']:.2f})   put {r['put_s'] * 1e3:8.3f} ms vs "
              f"{r['base_put_s'] * 1e3:8.3f} ms (x{r['put_s'] / r['base_put_s']:.2f})")  # fmt: skip
    big = next(r for r in rows if r["size"] == BIG)
    result("tier.mooncake_get_over_native_get_16m", big["get_s"] / big["base_get_s"], "<=", 1.2)


if __name__ == "__main__":
    main()
