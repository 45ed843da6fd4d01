"""The long stress run: a million kernel operations from eight threads, every answer checked against the model.

Run: `.venv/bin/python bench/stress.py [operations]` (default 1,000,000; a few minutes on two cores). It drives
`nexuskv.testing.stress.run` (see that module: tenants with and without share rules, sessions, extra inputs, commits,
evictions, demotions, promotions, prefetches, loads, plans with tight deadlines, plans reused for other
tenants' requests) and prints what it did and found. Its one RESULT, `safety.wrong_state_restores`, counts wrong key
lists, wrong restores, index disagreements and errors (goal 0); the number of operations is the run's size, asked
for on the command line, so it is printed as a fact (`operations: N`), not a RESULT. `make test` runs the same
harness, bounded.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import quick, result
from nexuskv import configure_logging
from nexuskv.testing.stress import run

RESULTS = ("safety.wrong_state_restores",)


def main() -> None:
    configure_logging(level="error", force=True)
    target = int(sys.argv[1]) if len(sys.argv) > 1 else quick(1_000_000, 500)
    start = time.monotonic()
    last = [start]

    def progress(done: int) -> None:
        if time.monotonic() - last[0] >= 15:
            last[0] = time.monotonic()
            print(f"  {done:>9,} operations after {last[0] - start:5.0f} s", flush=True)

    r = run(operations=target, threads=8, seed=1, progress=progress)
    print(f"operations {r.operations:,} in {r.seconds:.0f} s ({r.operations / r.seconds:,.0f}/s), 8 threads")
    print(f"plans {r.plans:,} ({r.fallbacks:,} fell back), restores {r.restores:,} "
          f"({r.blocks_restored:,} blocks, {r.shared_restores:,} of another tenant's shared scope), "
          f"foreign plans refused {r.refused_plans:,}")  # fmt: skip
    print(f"commits accepted {r.commits_accepted:,} blocks; {r.stats}")
    print(f"wrong key lists {r.wrong_keys}, wrong restores {r.wrong_restores}, "
          f"index problems {len(r.index_problems)}, errors {len(r.errors)}")  # fmt: skip
    for line in (r.index_problems + r.errors)[:10]:
        print("  ", line)
    print(f"operations: {r.operations:,} (the run's size: {target:,} asked for)")
    result("safety.wrong_state_restores", r.wrong_restores + r.wrong_keys + len(r.index_problems) + len(r.errors),
           "<=", 0)  # fmt: skip


if __name__ == "__main__":
    main()
