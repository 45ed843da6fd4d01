"""Routing at fleet size: `Kernel.route` over 64 and 1,024 nodes against the plan of the node holding the request.

Run: `.venv/bin/python bench/route_scale.py` (about a minute; `NEXUSKV_BENCH_QUICK=1`: seconds).

The fleet (seeded, so every run prices the same holdings):
- 32k-token requests (2,048 blocks of 16 tokens) over `CONVERSATIONS` conversations that share a 2k-token system
  prompt. Each conversation is held by `REPLICAS` random nodes, each holding a random 25-100 % prefix of it, the
  first 3/4 of that in DRAM and the rest on disk; the system prompt is held by 10 % of the nodes in DRAM.
- Every node reports a random queue (0-20k queued prefill tokens, 0-4 waiting requests, 0-32 running decodes at
  0.5 ms each); the scheduler kernel reaches peers over `tcp`, so every node can fetch any holding.
- Requests are warm (their block keys are passed in, as a scheduler that keys tokens as they arrive does).

Measured, interleaved per round so drift hits every case alike: one `plan` of the request on one node, `route` over
64 nodes and over 1,024 nodes, each `ROUNDS` times; p50 and p99 of each. The plan is the one the node a request is
routed to makes: it runs on the node of the 64-node fleet holding the longest prefix of the request (the request's
`node`, over the same index), so it restores from its own DRAM and disk; `route.p99_over_plan_p99_64_nodes` is
what routing over 64 nodes costs against that plan. Plans and routes that failed open are counted and printed,
never timed. A second pass repeats everything with one core busy (a spinning process) and prints it beside the idle
figures.
"""

from __future__ import annotations

import array
import io
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attrs

from _common import machine_speed, quick, result
from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    Location,
    ModelIdentity,
    NodeState,
    Request,
    StateGroup,
    TokenizerIdentity,
    configure_logging,
)

RESULTS = ("route.p99_ms_64_nodes", "route.p99_ms_1024_nodes", "route.p99_over_plan_p99_64_nodes")
ROOT = Path(__file__).resolve().parents[1]
PAGE = 16
TOKENS = quick(32768, 4096)
SYSTEM = 2048  # tokens of the shared system prompt
CONVERSATIONS, REPLICAS, ROUNDS = quick((32, 3, 400), (4, 2, 10))
FLEETS = (64, 1024)
LAYOUT = Layout(groups=[StateGroup(kind="dense", layers=32, kv_heads=8, head_dim=128)], page_size=PAGE)
SECRET = bytes(range(32))


def make_kernel(profile: str) -> Kernel:
    cfg = KernelConfig(node="router", profile=profile,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"},
                              "disk": {"store": "dram", "capacity_bytes": "1MiB"}},
                       transports=("local", "tcp"), prefetch_max_tasks=0)  # fmt: skip
    return Kernel(cfg, secret=SECRET)


def requests(rng: random.Random) -> list[Request]:
    system = array.array("I", rng.randbytes(4 * SYSTEM)).tolist()
    out = []
    for i in range(CONVERSATIONS):
        tokens = system + array.array("I", rng.randbytes(4 * (TOKENS - SYSTEM))).tolist()
        out.append(Request(request_id=f"c{i}", tenant="chat", model=ModelIdentity(name="llama-8b", revision="1"),
                           tokenizer=TokenizerIdentity(name="bpe"), layout=LAYOUT, token_ids=tokens))  # fmt: skip
    return out


def spread(k: Kernel, reqs: list[Request], keys: list[list[bytes]], nodes: list[str], rng: random.Random) -> list[str]:
    """Place the holdings (module docstring); per conversation, the node holding the longest prefix of it."""
    for n in rng.sample(nodes, max(1, len(nodes) // 10)):
        k.index.insert_many(keys[0][: SYSTEM // PAGE], Location("dram", n, 1))
    holders = []
    for ks in keys:
        most = (-1, "")
        for n in rng.sample(nodes, REPLICAS):
            held = rng.randint(len(ks) // 4, len(ks))
            fast = held * 3 // 4
            k.index.insert_many(ks[:fast], Location("dram", n, 1))
            k.index.insert_many(ks[fast:held], Location("disk", n, 1))
            most = max(most, (held, n))
        holders.append(most[1])
    return holders


def states(nodes: list[str], rng: random.Random) -> list[NodeState]:
    return [NodeState(n, queued_prefill_tokens=rng.randint(0, 20_000), waiting_requests=rng.randint(0, 4),
                      running_decodes=rng.randint(0, 32), decode_ms=0.5) for n in nodes]  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def tcp_profile() -> str:
    """The replay profile plus a 25 Gbit/s `tcp` transport (peers' state is priced until links are measured)."""
    profile = json.loads((ROOT / "profiles/replay-llama-8b-gpu.json").read_text())
    profile["transports"]["tcp"] = {"bandwidth_bytes_per_s": 3.125e9, "latency_ms": 0.05}
    fh = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)  # noqa: SIM115 - removed by main
    with fh:
        json.dump(profile, fh)
    return fh.name


def measure(label: str, profile: str) -> dict[str, float]:
    rng = random.Random(11)
    fleets = {}
    for size in FLEETS:
        k = make_kernel(profile)
        nodes = [f"node-{i:04d}" for i in range(size)]
        reqs = requests(random.Random(5))
        keys = [k.keys(r) for r in reqs]
        holders = spread(k, reqs, keys, nodes, rng)
        fleets[size] = (k, reqs, keys, states(nodes, rng), holders)
    # the plan: the node of the 64-node fleet holding the longest prefix of the request (where routing sends it)
    # plans it over the same index; `Request.node` names the node a plan is made for
    k64, reqs64, _, _, holders64 = fleets[64]
    on_holder = [attrs.evolve(r, node=h) for r, h in zip(reqs64, holders64, strict=True)]
    times: dict[str, list[float]] = {"plan": [], **{f"route{s}": [] for s in FLEETS}}
    failed: dict[str, int] = dict.fromkeys(times, 0)
    for i in range(ROUNDS):
        j = i % CONVERSATIONS
        r, ks = on_holder[j], fleets[64][2][j]
        t = time.perf_counter()
        plan = k64.plan(r, keys=ks)
        ms = (time.perf_counter() - t) * 1e3
        if plan.reasons and plan.reasons[0].startswith("fail-open"):
            failed["plan"] += 1
        else:
            times["plan"].append(ms)
        for size in FLEETS:
            k, rs, kss, ns, _ = fleets[size]
            t = time.perf_counter()
            d = k.route(rs[j], ns, keys=kss[j])
            ms = (time.perf_counter() - t) * 1e3
            if d.fail_open:
                failed[f"route{size}"] += 1
            else:
                times[f"route{size}"].append(ms)
    first = k64.plan(on_holder[0], keys=fleets[64][2][0])  # what the timed plans were, after them (untimed)
    print(f"{label:>5} the plan on {holders64[0]}, conversation 0's longest holder: {first.action.value}, "
          f"{first.tokens_reused} of {first.tokens_total} tokens from "
          f"{', '.join(sorted({f'{sp.tier}@{sp.node}' for sp in first.spans}))}", flush=True)  # fmt: skip
    for k, *_ in fleets.values():
        k.close()
    out = {}
    for name, xs in times.items():
        out[f"{name}.p50"], out[f"{name}.p99"] = pct(xs, 0.5), pct(xs, 0.99)
        print(f"{label:>5} {name:>9}: p50 {out[name + '.p50']:.3f} ms  p99 {out[name + '.p99']:.3f} ms  "
              f"({len(xs)} timed, {failed[name]} failed open)", flush=True)
    return out


def _spin(stop) -> None:  # stop: a multiprocessing Event
    while not stop.is_set():
        pass


def main() -> None:
    configure_logging(json=True, stream=io.StringIO(), force=True)  # plans log their decision: rendered, dropped
    print(machine_speed(), flush=True)
    print(f"{TOKENS}-token warm requests, {CONVERSATIONS} conversations x {REPLICAS} replicas, {ROUNDS} rounds",
          flush=True)
    profile = tcp_profile()
    idle = measure("idle", profile)
    stop = multiprocessing.Event()
    spinner = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
    spinner.start()
    try:
        measure("busy", profile)
    finally:
        stop.set()
        spinner.join(5)
        os.unlink(profile)
    result("route.p99_ms_64_nodes", idle["route64.p99"], "<=", 1.0)
    result("route.p99_ms_1024_nodes", idle["route1024.p99"], "<=", 5.0)
    result("route.p99_over_plan_p99_64_nodes", idle["route64.p99"] / idle["plan.p99"], "<=", 2.0)


if __name__ == "__main__":
    main()
