"""What the cluster-wide index costs per block, per event and per resync, measured here and extrapolated to a fleet.

Run: `.venv/bin/python bench/cluster_index.py` (about three minutes; needs `redis-server`). A study: it prints its
figures and the extrapolation to 1,000 nodes x 10^6 blocks (docs/cluster.md, "A thousand nodes"), no goal.

1. Memory per block of a node's index: a fresh process builds the active matcher's index (the native one when
   `nexuskv-native` is installed) and the pure-Python `DictIndex` with N random 16-byte block keys, each held at
   one location, and reports its resident set's growth per block (/proc/self/statm); N = 10^6 and 4 x 10^6.
2. Following: kernel `a` (a real kernel, `[matcher] name = "redis"` on a real redis-server) stores N blocks in
   events of 64 blocks (a 1k-token request's worth); kernel `b` follows. Events and blocks per second from the
   first write to `b` holding all N.
3. Recovering: a fresh kernel `c` joins and resyncs `a`'s holding (the follower's chunked read of a peer's
   holding, as after a lost stream); blocks per second until `c` holds all N.
4. Steps 2 and 3 again with the holdings and streams split into 16 shards (`shards = 16`): `b` follows 16
   streams of `a`, and `c` reads the 16 shards' holdings with 8 threads (`resync_threads`), as a router that lost
   its view rebuilds it.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import quick, requires
from nexuskv import Kernel, KernelConfig, Location, configure_logging

RESULTS = ()
ROOT = Path(__file__).resolve().parents[1]
SIZES = quick((10**6, 4 * 10**6), (10**4,))
FOLLOW_BLOCKS = quick(200_000, 2_000)
BATCH = 64

_MEMORY = r"""
import os, sys
from nexuskv import DictIndex, Kernel, KernelConfig, Location
n, which = int(sys.argv[1]), sys.argv[2]
index = DictIndex() if which == "dict" else Kernel(KernelConfig(), secret=bytes(32)).index
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * page
keys = [os.urandom(16) for _ in range(n)]  # made before the first reading: only the index's growth is measured
before = rss()
loc = Location("dram", "node-0001", 1)
for i in range(0, n, 65536):
    index.insert_many(keys[i:i + 65536], loc)
print((rss() - before) / n)
"""


def memory_per_block(n: int, which: str) -> float:
    out = subprocess.run([sys.executable, "-c", _MEMORY, str(n), which], capture_output=True, text=True, check=True,
                         env={**os.environ, "NEXUSKV_LOG_LEVEL": "error"})  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def held(k: Kernel, node: str) -> int:
    return k.index.holdings().get(Location("dram", node, 1), 0)


def wait_for(k: Kernel, node: str, n: int, limit_s: float = 600.0) -> float:
    t0 = time.perf_counter()
    while held(k, node) < n:
        if time.perf_counter() - t0 > limit_s:
            raise TimeoutError(f"{k.node} holds {held(k, node)} of {n} blocks of {node} after {limit_s:g} s")
        time.sleep(0.01)
    return time.perf_counter()


def follow_and_resync(shards: int) -> tuple[float, float, float]:
    """(events/s, blocks/s followed, blocks/s resynced) on a real redis-server, holdings split into `shards`."""
    from nexuskv_tier_redis.testing import RedisServer

    with RedisServer() as server:

        def kernel(node: str) -> Kernel:
            cfg = {"name": "redis", "url": server.url, "prefix": "bench/", "poll_s": 0.02, "shards": shards,
                   "resync_threads": 8}  # fmt: skip
            return Kernel(KernelConfig.from_mapping({"node": node, "lease_ttl_s": 5.0, "matcher": cfg}),
                          secret=bytes(32))  # fmt: skip

        a, b = kernel("a"), kernel("b")
        try:
            keys = [os.urandom(16) for _ in range(FOLLOW_BLOCKS)]
            loc = Location("dram", "a", 1)
            t0 = time.perf_counter()
            for i in range(0, FOLLOW_BLOCKS, BATCH):
                a.index.insert_many(keys[i : i + BATCH], loc)
            followed = wait_for(b, "a", FOLLOW_BLOCKS) - t0
            c = kernel("c")
            try:
                t1 = time.perf_counter()
                resynced = wait_for(c, "a", FOLLOW_BLOCKS) - t1
            finally:
                c.close()
        finally:
            b.close()
            a.close()
    events = FOLLOW_BLOCKS / BATCH
    return events / followed, FOLLOW_BLOCKS / followed, FOLLOW_BLOCKS / resynced


def main() -> None:
    import shutil

    requires(shutil.which("redis-server"), "redis-server is not installed")
    configure_logging(json=True, stream=io.StringIO(), force=True)
    per_block = {}
    for which in ("native", "dict"):
        for n in SIZES:
            per_block[which, n] = memory_per_block(n, which)
            print(f"index memory ({which}, {n:,} blocks): {per_block[which, n]:.1f} bytes per block", flush=True)
    events_s, follow_s, resync_s = follow_and_resync(1)
    print(f"following one peer ({FOLLOW_BLOCKS:,} blocks in events of {BATCH}): {events_s:,.0f} events/s, "
          f"{follow_s:,.0f} blocks/s", flush=True)  # fmt: skip
    print(f"resyncing one peer's {FOLLOW_BLOCKS:,} blocks: {resync_s:,.0f} blocks/s", flush=True)
    events16, follow16, resync16 = follow_and_resync(16)
    print(f"16 shards: following one peer: {events16:,.0f} events/s (each commit is up to 16 shard events), "
          f"{follow16:,.0f} blocks/s; resyncing its 16 shards with 8 threads: {resync16:,.0f} blocks/s "
          f"({resync16 / resync_s:.2f}x one stream)", flush=True)  # fmt: skip
    m = per_block["native", SIZES[-1]]
    nodes, blocks = 1000, 10**6
    total = nodes * blocks
    # Per node, from the shared trace at 8 nodes: 3,993 requests in 1,022 s (0.49 requests/s per node) of 15,325
    # tokens on average, 958 blocks of 16 tokens stored per request and, at steady state, as many evicted.
    per_node_blocks = 0.49 * 958 * 2
    per_node_events = 0.49 * 2  # one event per commit, one per eviction batch
    shards = 64
    print(f"\nextrapolated to 1,000 nodes x 10^6 blocks (10^9 block-locations), native index; a node changes "
          f"{per_node_blocks:,.0f} blocks/s in {per_node_events:.2f} events/s (the shared trace's rate):")
    print(f"  every node holds the fleet (today): {total * m / 1e9:,.1f} GB per process (10^9 x {m:.1f} B); "
          f"follows {nodes - 1} peers: {(nodes - 1) * per_node_blocks:,.0f} blocks/s in "
          f"{(nodes - 1) * per_node_events:,.0f} events/s per node, "
          f"{(nodes - 1) * per_node_blocks / follow_s:.1f}x one follower's measured rate")  # fmt: skip
    print(f"  as built (nodes follow none, `follow = \"none\"`; a router follows every shard of every node): "
          f"{blocks * m / 1e6:,.0f} MB and no follow traffic per node; the router {total * m / 1e9:,.1f} GB, "
          f"following {nodes * per_node_blocks:,.0f} blocks/s ({nodes * per_node_blocks / follow16:.1f}x one "
          f"process's measured 16-shard rate)")  # fmt: skip
    print(f"  designed, not built ({shards} shards by segment anchor, each router holds some): "
          f"{total * m / shards / 1e9:,.2f} GB per shard, {blocks * m / 1e6:,.0f} MB per node; a shard follows "
          f"{nodes * per_node_blocks / shards:,.0f} blocks/s ({nodes * per_node_blocks / shards / follow16:.2f}x "
          f"the measured 16-shard rate)")  # fmt: skip
    print(f"  recovering a lost shard ({total // shards:,} blocks) at the measured resync rates: "
          f"{total / shards / resync_s:,.0f} s read as one stream, {total / shards / resync16:,.0f} s read "
          f"16 at once by one process (measured), {total / shards / resync_s / 16:,.1f} s if 16 readers on "
          f"separate cores each kept one stream's rate (not measured)")  # fmt: skip

if __name__ == "__main__":
    main()
