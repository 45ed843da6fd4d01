"""Hot policy reload under load: plans from 4 threads while the policy directory is rewritten 100 times.

Run: `.venv/bin/python bench/policy_reload.py` (about a minute).

A kernel serves the shipped policies plus a generation-tagged `warn` rule in `default.toml` (every tenant
extends it, so every reuse evaluation of every tenant adds `policy warning: gen<N>-seen` to the plan's reasons).
Four threads plan real requests whose state sits in the DRAM tier (every plan evaluates reuse rules), each
at `RATE` plans per second (2,000 plans/s in all, about a tenth of what four threads can plan flat out here). The kernel
watches its policy directory (`policy_watch = true`, the production path: watchfiles, debounced). A fifth thread
rewrites `default.toml` 100 times (atomically: temp file + rename, as a deploy tool does), one rewrite every
`PERIOD_S`, half of them invalid (a CEL type error, a TOML syntax error, an unknown field, an unknown function,
a rule naming an unknown kind, in turn).

The run alternates steady segments (the directory left alone) and rewrite segments of the same length, eight
of each, so drift of this shared machine falls on both alike. The planning deadline is 10 s, so a plan falls
back only for a reason of its own. Why paced: four threads planning flat out on two cores starve each other,
and every other thread, of the GIL (plans waiting seconds for it, reloads compiling for seconds, the lease's
heartbeat missing its renewals), in steady segments as in rewrite ones; `FLAT_OUT=1` runs that variant.

Figures, from the same process and the same threads:
- `policy.reload_failed_plans`: plans during rewrite segments that raised or fell back (`fail-open`), of any
  cause (the steady segments' count is printed beside it).
- `policy.reload_mixed_revision_plans`: plans whose reasons carry the tags of two generations, or a tag other
  than the generation of the revision the plan names (`plan.policy_revision`, mapped from the content
  revisions the rewriter wrote): a plan that evaluated rules of two revisions.
- `policy.reload_plan_p99_over_steady`: p99 plan latency in the rewrite segments over p99 in the steady ones.
  Plans that fell back are counted above and never timed as plans. The same ratio measured from each plan's
  due time (so a thread that woke late because a compile step held the GIL is charged for it) is printed too.
"""

from __future__ import annotations

import array
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_speed, quick, result
from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    ModelIdentity,
    PolicyBundle,
    Request,
    StateGroup,
    TokenizerIdentity,
    configure_logging,
)

RESULTS = ("policy.reload_failed_plans", "policy.reload_mixed_revision_plans", "policy.reload_plan_p99_over_steady")
ROOT = Path(__file__).resolve().parents[1]
PAGE = 16
THREADS = 4
REWRITES = quick(100, 4)
PERIOD_S = 0.25  # one rewrite every 250 ms (the watcher debounces 100 ms)
CYCLES = quick(8, 2)  # steady / rewrite segment pairs
REQUESTS = quick(64, 8)  # requests the planners pick from
DEADLINE_MS = 10_000.0
RATE = 0.0 if os.environ.get("FLAT_OUT") else 500.0  # plans per second per thread
LAYOUT = Layout(groups=[StateGroup(kind="dense", layers=4, kv_heads=2, head_dim=64)], page_size=PAGE)
TENANTS = ("chat", "rag", "strict", "other")  # three tenant files and one on the default policy

BASE = (ROOT / "policies" / "default.toml").read_text()
TAGGED = BASE + """
[[reuse]]
name = "gen{n}-seen"
effect = "warn"
when = "match.tokens >= {n}"
message = "generation {n}"
"""
INVALID = [  # each a realistic mistake, and each refused whole
    BASE + '\n[[reuse]]\nname = "gen{n}-bad-type"\nwhen = "match.tokens > \\"many\\""\n',
    BASE + '\n[[reuse]]\nname = "gen{n}-bad-toml"\nwhen = "match.tokens > 1\n',
    BASE + '\n[[reuse]]\nname = "gen{n}-bad-field"\nwhen = "true"\neffekt = "warn"\n',
    BASE + '\n[[reuse]]\nname = "gen{n}-bad-function"\nwhen = "no_such_function(match.tokens)"\n',
    BASE + '\n[[reuze]]\nname = "gen{n}-bad-kind"\nwhen = "true"\n',
]


def request(rng: random.Random, tenant: str, n: int, rid: str) -> Request:
    tokens = array.array("I", rng.randbytes(4 * n)).tolist()
    return Request(request_id=rid, tenant=tenant, model=ModelIdentity(name="tiny-llama", revision="1"),
                   tokenizer=TokenizerIdentity(name="tiny-bpe"), layout=LAYOUT, token_ids=tokens)  # fmt: skip


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Planners:
    """THREADS threads planning the prepared requests in a loop; results go to the current phase's lists."""

    def __init__(self, k: Kernel, reqs: list[tuple[Request, list[bytes]]], gen_of: dict[str, int]) -> None:
        self.k, self.reqs, self.gen_of = k, reqs, gen_of
        self.phase = "warmup"
        self.lat: dict[str, list[float]] = {}
        self.from_slot: dict[str, list[float]] = {}  # from the time the plan was due: a late wake-up counts too
        self.failed: dict[str, list[str]] = {}
        self.mixed: dict[str, list[str]] = {}
        self.count: dict[str, int] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(THREADS)]

    def run(self, i: int) -> None:
        rng = random.Random(i)
        lat: list[tuple[str, float, float]] = []
        slot = time.perf_counter()
        while not self.stop.is_set():
            req, keys = self.reqs[rng.randrange(len(self.reqs))]
            if RATE:  # open loop: the next plan is due at its slot, whatever the last one took
                slot += 1.0 / RATE
                wait = slot - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            phase = self.phase
            t0 = time.perf_counter()
            try:
                plan = self.k.plan(req, keys=keys)
            except Exception as exc:  # counted, never hidden
                self.note(self.failed, phase, f"raised {type(exc).__name__}: {exc}")
                continue
            done = time.perf_counter()
            ms = (done - t0) * 1e3
            if any(r.startswith("fail-open") for r in plan.reasons):
                self.note(self.failed, phase, "; ".join(plan.reasons))
                continue
            lat.append((phase, ms, (done - min(slot, t0)) * 1e3 if RATE else ms))
            tags = {int(r.split("generation ")[1]) for r in plan.reasons if "generation " in r}
            want = self.gen_of.get(plan.policy_revision)
            if len(tags) > 1 or want is None or (tags and tags != {want}):
                self.note(self.mixed, phase, f"revision {plan.policy_revision} (gen {want}) tags {sorted(tags)}")
            if len(lat) >= 512:
                self.flush(lat)
        self.flush(lat)

    def note(self, where: dict[str, list[str]], phase: str, what: str) -> None:
        with self.lock:
            where.setdefault(phase, []).append(what)

    def flush(self, lat: list[tuple[str, float, float]]) -> None:
        with self.lock:
            for phase, ms, from_slot in lat:
                self.lat.setdefault(phase, []).append(ms)
                self.from_slot.setdefault(phase, []).append(from_slot)
        lat.clear()


def main() -> None:
    configure_logging(level="critical", force=True)  # the refused revisions' errors would flood the terminal
    print(machine_speed())
    work = Path(tempfile.mkdtemp(prefix="nexuskv-reload-"))
    pdir = work / "policies"
    shutil.copytree(ROOT / "policies", pdir, ignore=shutil.ignore_patterns("tests"))
    write_atomically(pdir / "default.toml", TAGGED.format(n=0))
    first = PolicyBundle.from_directory(pdir)
    gen_of = {first.revision: 0}
    files = dict(first.files)
    cfg = KernelConfig(node="bench", policies=str(pdir), deadline_ms=DEADLINE_MS,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1GiB"}})  # fmt: skip
    rng = random.Random(1)
    with Kernel(cfg) as k:
        results = []
        k.live.listen(results.append)  # every reload result (the kernel's history keeps only the last 32)
        k.live.watch(debounce_ms=100)  # what `policy_watch = true` starts, with a shorter debounce
        reqs = []
        for i in range(REQUESTS):
            req = request(rng, TENANTS[i % len(TENANTS)], 512 + 64 * (i % 16), f"r{i}")
            keys = k.keys(req)
            blocks = len(keys)
            k.commit(req, [bytes(2048 * PAGE)] * blocks, keys=keys)
            reqs.append((req, keys))
        k.flush()
        planners = Planners(k, reqs, gen_of)
        for t in planners.threads:
            t.start()
        time.sleep(quick(1.0, 0.2))
        per = [REWRITES // CYCLES + (c < REWRITES % CYCLES) for c in range(CYCLES)]
        n = 0
        for count in per:
            planners.phase = "steady"
            time.sleep(count * PERIOD_S)
            planners.phase = "rewrite"
            for _ in range(count):
                n += 1
                valid = n % 2 == 0
                text = TAGGED.format(n=n) if valid else INVALID[(n // 2) % len(INVALID)].format(n=n)
                if valid:  # the revision it will have, known before the watcher can load it
                    gen_of[PolicyBundle(files={**files, "default.toml": text}).revision] = n
                write_atomically(pdir / "default.toml", text)
                time.sleep(PERIOD_S)
        planners.phase = "end"
        planners.stop.set()
        for t in planners.threads:
            t.join()
        history = list(results)
        serving = k.policy_revision
    shutil.rmtree(work, ignore_errors=True)
    applied = [h for h in history if h.applied and h.source == "watch"]
    refused = [h for h in history if h.problems]
    steady = planners.lat.get("steady", [])
    during = planners.lat.get("rewrite", [])
    p99s, p99r = percentile(steady, 0.99), percentile(during, 0.99)
    print(f"rewrites: {REWRITES} ({REWRITES // 2} valid, {REWRITES // 2} invalid), one every {PERIOD_S * 1e3:.0f} ms, "
          f"in {CYCLES} segments alternating with steady ones; deadline {DEADLINE_MS:g} ms")
    print(f"watcher reloads: {len(applied)} revisions applied, {len(refused)} refused whole "
          f"({len(history)} reloads); serving generation {gen_of.get(serving)}")
    for h in refused[-1:]:
        print(f"  last refusal: {h.problems[0]}")
    if history:
        loads = sorted(h.load_ms for h in history if h.load_ms)
        print(f"  compile time per reload: median {percentile(loads, 0.5):.1f} ms, max {max(loads):.1f} ms")
    for phase in ("steady", "rewrite"):
        xs = planners.lat.get(phase, [])
        print(f"{phase:>8}: {len(xs):6d} plans, p50 {percentile(xs, 0.5):.3f} ms, p99 {percentile(xs, 0.99):.3f} ms, "
              f"max {max(xs, default=0):.1f} ms, over 100 ms {sum(x > 100 for x in xs)}, "
              f"failed {len(planners.failed.get(phase, []))}, mixed {len(planners.mixed.get(phase, []))}")
    slot_s, slot_r = (percentile(planners.from_slot.get(p, []), 0.99) for p in ("steady", "rewrite"))
    print(f"measured from each plan's due time (a thread woken late, waiting for the GIL, counts): p99 steady "
          f"{slot_s:.3f} ms, rewrite {slot_r:.3f} ms, ratio {slot_r / slot_s:.3f}")
    for phase, items in planners.failed.items():
        if phase in ("steady", "rewrite"):
            print(f"  failed in {phase}: {items[:3]}")
    for phase, items in planners.mixed.items():
        print(f"  mixed in {phase}: {items[:3]}")
    result("policy.reload_failed_plans", len(planners.failed.get("rewrite", [])), "<=", 0)
    result("policy.reload_mixed_revision_plans", sum(len(v) for v in planners.mixed.values()), "<=", 0)
    result("policy.reload_plan_p99_over_steady", p99r / p99s, "<=", 1.2)


if __name__ == "__main__":
    main()
