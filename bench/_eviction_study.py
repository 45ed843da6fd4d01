"""The eviction policy study behind docs/benchmarks-history.md#eviction: token hit ratios of policy variants on a trace.

Run: `.venv/bin/python bench/_eviction_study.py ../shared/traces/mooncake_synthetic_trace.jsonl` (about two
minutes). A model of one store of `--blocks` full 512-token blocks, always-reuse: every request reads its
longest held prefix (each block a hit), then every missing block is put, in order; a block whose continuation
is held is never evicted (the kernel's `Lineage`), and a put that cannot make room without evicting a more
valuable block is refused together with the rest of its request (the kernel refuses orphans). With priority
0 for every block it gives exactly the kernel's LRU figure (`bench/cluster_sim.py`, 0.2528 on the shared
trace), and with the kernel's default policy the kernel's figure within 0.002 (this model has no measured
link drift). Variants: the GreedyDual floor plus value times (1 + reads), the probation share of a block
never seen, and the ghost history (evicted blocks' reads, `history` times the cache). Also Belady's optimum
(evict the block used furthest in the future, never admit one not used again) and LRU with an oracle that
admits only blocks used again: the ceilings. No RESULT line: this is a study, not a goal.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
import json
import tempfile
from pathlib import Path

from _common import quick

RESULTS = ()  # a study: no goal


def blocks_of(trace: Path) -> list[tuple[list[int], int]]:
    out = []
    for line in trace.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append((r["hash_ids"][: r["input_length"] // 512], r["input_length"]))
    return out


def policy(recs: list[tuple[list[int], int]], cap: int, *, gd: bool, probation: float = 1.0, history: int = 0,
           reads: bool = True) -> float:  # fmt: skip
    """Hit ratio of GreedyDual (`gd`, value 1 a block) or LRU (all priorities 0), with the prefix constraint."""
    held: dict[int, list[int]] = {}  # block -> [seq, reads]
    heap: list[tuple[float, int, int]] = []
    seq = itertools.count()
    kids: collections.Counter[int] = collections.Counter()
    parent: dict[int, int] = {}
    ghost: collections.OrderedDict[int, int] = collections.OrderedDict()
    floor = 0.0
    hit = total = 0

    def prio(n: int) -> float:
        if not gd:
            return 0.0
        return floor + (probation if n == 0 else 1.0 + (n if reads else 0))

    for ids, length in recs:
        n = 0
        for h in ids:
            if h not in held:
                break
            n += 1
        hit += min(n * 512, length)
        total += length
        for h in ids[:n]:
            e = held[h]
            e[1] += 1
            e[0] = next(seq)
            heapq.heappush(heap, (prio(e[1]), e[0], h))
        for d, h in enumerate(ids):
            if h in held:
                continue
            seen = ghost.pop(h) + 1 if gd and h in ghost else 0
            want, back, ok = prio(seen), [], True
            while len(held) >= cap:
                p, s, v = heapq.heappop(heap)
                if v not in held or held[v][0] != s:
                    continue  # stale entry
                if p > want:
                    heapq.heappush(heap, (p, s, v))
                    ok = False
                    break
                if kids[v] or (d and v == ids[d - 1]):
                    back.append((p, s, v))
                    continue
                floor = max(floor, p)
                if history:
                    ghost[v] = held[v][1]
                    while len(ghost) > history * cap:
                        ghost.popitem(last=False)
                del held[v]
                if v in parent:
                    kids[parent.pop(v)] -= 1
                for b in back:
                    heapq.heappush(heap, b)
                back = []
            for b in back:
                heapq.heappush(heap, b)
            if not ok:
                break  # refused: the rest of the request would be orphans
            s = next(seq)
            held[h] = [s, seen]
            heapq.heappush(heap, (want, s, h))
            if d:
                parent[h] = ids[d - 1]
                kids[ids[d - 1]] += 1
    return hit / total


def ceilings(recs: list[tuple[list[int], int]], cap: int) -> tuple[float, float]:
    """(Belady's optimum with bypass, LRU admitting only blocks used again)."""
    uses: dict[int, list[int]] = collections.defaultdict(list)
    for i, (ids, _) in enumerate(recs):
        for h in ids:
            uses[h].append(i)
    ptr: collections.Counter[int] = collections.Counter()

    def next_use(h: int, i: int) -> float:
        u = uses[h]
        while ptr[h] < len(u) and u[ptr[h]] <= i:
            ptr[h] += 1
        return u[ptr[h]] if ptr[h] < len(u) else float("inf")

    held: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    hit = hit_lru = total = 0
    for i, (ids, length) in enumerate(recs):
        n = next((j for j, h in enumerate(ids) if h not in held), len(ids))
        m = next((j for j, h in enumerate(ids) if h not in lru), len(ids))
        hit += min(n * 512, length)
        hit_lru += min(m * 512, length)
        total += length
        for h in ids:
            nu = next_use(h, i)
            if h in lru:
                lru.move_to_end(h)
            elif nu != float("inf"):
                while len(lru) >= cap:
                    lru.popitem(last=False)
                lru[h] = None
            if h in held:
                held[h] = nu
                heapq.heappush(heap, (-nu, h))
                continue
            if nu == float("inf"):
                continue
            while len(held) >= cap:
                neg, v = heapq.heappop(heap)
                if held.get(v) == -neg:
                    del held[v]
            held[h] = nu
            heapq.heappush(heap, (-nu, h))
    return hit / total, hit_lru / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    # quick mode: the trace may be left out (a small synthetic one is made), and the store is small
    ap.add_argument("trace", type=Path, nargs=quick(None, "?"))
    ap.add_argument("--blocks", type=int, default=quick(4000, 200))
    args = ap.parse_args()
    if args.trace is None:
        from nexuskv_sim.trace import generate, write_trace

        with tempfile.TemporaryDirectory() as tmp:
            write_trace(generate(60, seed=1), Path(tmp) / "trace.jsonl")
            recs = blocks_of(Path(tmp) / "trace.jsonl")
    else:
        recs = blocks_of(args.trace)
    lru = policy(recs, args.blocks, gd=False)
    rows = [("LRU", lru),
            ("GreedyDual, value only", policy(recs, args.blocks, gd=True, reads=False)),
            ("GDSF: + reads", policy(recs, args.blocks, gd=True))]  # fmt: skip
    for prob, hist in ((1.0, 4), (0.2, 2), (0.2, 4), (0.3, 3), (0.3, 4), (0.3, 6), (0.4, 3), (0.5, 4)):
        label = f"GDSF + history {hist}x" + (f", probation {prob:g}" if prob < 1 else "")
        rows.append((label, policy(recs, args.blocks, gd=True, probation=prob, history=hist)))
    opt, oracle = ceilings(recs, args.blocks)
    rows += [("Belady's optimum (with bypass)", opt), ("LRU admitting only blocks used again (oracle)", oracle)]
    print(f"{len(recs)} requests, a store of {args.blocks} blocks")
    for name, hr in rows:
        print(f"{name:<58} hit ratio {hr:.4f}  / LRU {hr / lru:.3f}")


if __name__ == "__main__":
    main()
