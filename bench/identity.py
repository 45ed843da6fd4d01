"""Block-key throughput, index longest-match latency and memory, and payload verification, against baselines.

Run: `.venv/bin/python bench/identity.py` (about two minutes). Each figure is taken for the pure-Python reference
(`BlockKeyer`, `DictIndex`) and, when the `nexuskv-native` plugin is installed, for the native ones. Baselines,
in the same process:
- keys: one keyed BLAKE2b over the request's token bytes (already serialised: the cheapest keyed hash of the
  same input; our side also serialises the token ids and chains 2,048 keyed hashes, one BLAKE2b compression per
  16-token block, where the single hash needs one per 32 tokens);
- match: plain dict lookups of the same keys in a dict of the same size, the fastest plain way
  (`list(map(d.get, keys))`); ours returns the full `Match` and its longest restore point;
- memory: everything the index allocates, traced by tracemalloc (the native table allocates with PyMem_Raw*,
  which tracemalloc sees), per block, at 10^6 blocks;
- integrity: verifying a 2 MiB payload's checksum, and its keyed MAC (`StateSeal.check`: keyed BLAKE3 over the
  payload and its descriptor, what every load runs), against copying it into a preallocated buffer (memcpy); the
  other MAC options are printed beside it (keyed BLAKE3 on one thread, a keyed MAC over the XXH3-128 of the
  payload, keyed BLAKE2b).
"""

from __future__ import annotations

import array
import hashlib
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, machine_speed, quick, requires, result
from nexuskv import (
    BlockKeyer,
    DictIndex,
    Layout,
    Location,
    ModelIdentity,
    Namespace,
    Placement,
    Request,
    StateDescriptor,
    StateGroup,
    StateSeal,
    TokenizerIdentity,
    TokenSpan,
    checksum,
    verify_checksum,
)

try:
    from nexuskv_native import NativeIndex, NativeKeyer
except ImportError:  # the reference figures alone
    NativeIndex = NativeKeyer = None  # type: ignore[assignment, misc]

RESULTS = ("identity.keys_over_single_hash_32k", "index.match_over_dict_1e5", "index.match_over_dict_1e6",
           "index.bytes_per_block_1e6", "identity.native_keys_over_single_hash_32k", "index.native_bytes_per_block_1e6",
           "index.native_match_over_dict_1e6", "integrity.verify_over_memcpy_2m",
           "integrity.keyed_verify_over_memcpy_2m")  # fmt: skip
PAGE = 16
TOKENS = quick(32 * 1024, 2048)
SECRET = os.urandom(32)
LAYOUT = Layout(groups=[StateGroup(kind="dense", layers=32, kv_heads=8, head_dim=128)], page_size=PAGE)
rng = random.Random(42)


def request(tokens: list[int], tenant: str = "acme") -> Request:
    return Request(request_id="bench", tenant=tenant, model=ModelIdentity(name="llama-8b", revision="1"),
                   tokenizer=TokenizerIdentity(name="llama"), layout=LAYOUT, token_ids=tokens)  # fmt: skip


def bench_keys(keyer: BlockKeyer) -> float:
    print(f"[{type(keyer).__name__}]")
    tokens = [rng.randrange(128_000) for _ in range(TOKENS)]
    req = request(tokens)
    raw = array.array("I", tokens).tobytes()
    t = interleaved({
        "keys": lambda: keyer.request_keys(req),
        "single": lambda: hashlib.blake2b(raw, key=SECRET, digest_size=16).digest(),
        "single+serialise": lambda: hashlib.blake2b(array.array("I", tokens).tobytes(), key=SECRET).digest(),
    }, rounds=quick(40, 2), inner=quick(3, 1))  # fmt: skip
    n = len(keyer.request_keys(req))
    print(f"block keys, {TOKENS} tokens, page {PAGE}: {n} keys in {t['keys'] * 1e3:.3f} ms "
          f"({n / t['keys'] / 1e6:.2f} M keys/s, {TOKENS * 4 / t['keys'] / 2**20:.0f} MiB/s of token bytes)")
    print(f"  baseline one keyed BLAKE2b over the same {len(raw)} bytes: {t['single'] * 1e3:.3f} ms; "
          f"with serialising the ids: {t['single+serialise'] * 1e3:.3f} ms")
    print(f"  ratio keys / single hash: {t['keys'] / t['single']:.2f}  "
          f"(/ single hash incl. serialising: {t['keys'] / t['single+serialise']:.2f})")
    return t["keys"] / t["single"]


def build_index(keyer: BlockKeyer, blocks: int, make: type = DictIndex) -> tuple[DictIndex, list[bytes], int]:
    """An index of `blocks` blocks from many 32k-token requests; returns it, one request's keys, bytes used."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = make()
    loc = Location("dram", "node-a", 1)
    per = TOKENS // PAGE
    probe: list[bytes] = []
    done = 0
    r = 0
    while done < blocks:
        n = min(per, blocks - done)
        tokens = array.array("I", rng.randbytes(4 * n * PAGE)).tolist()  # fast random ids
        keys = keyer.request_keys(request(tokens, tenant=f"t{r % 50}"))
        idx.insert_many(keys, loc)
        if not probe and n == per:
            probe = keys
        done += n
        r += 1
        del keys
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return idx, probe, used - sys.getsizeof(probe)  # the probe list is the bench's, not the index's


def bench_match(keyer: BlockKeyer, blocks: int, make: type = DictIndex) -> tuple[float, float]:
    t0 = time.perf_counter()
    idx, keys, used = build_index(keyer, blocks, make)
    built = time.perf_counter() - t0
    plain = dict.fromkeys(idx.snapshot(), 1)  # a plain dict of the same keys
    assert len(plain) == blocks
    t = interleaved({
        "match": lambda: idx.match(keys, LAYOUT).longest(),
        "dict": lambda: list(map(plain.get, keys)),
    }, rounds=quick(60, 2), inner=quick(5, 1))  # fmt: skip
    assert idx.match(keys, LAYOUT).longest() == len(keys)
    per_block = used / blocks
    print(f"{make.__name__} of {blocks:.0e} blocks (built in {built:.1f} s under tracemalloc): "
          f"{per_block:.0f} bytes per block (keys, dict, reverse map, holdings)")
    print(f"  longest match of {len(keys)} keys: {t['match'] * 1e6:.0f} us; plain dict lookups "
          f"{t['dict'] * 1e6:.0f} us; ratio {t['match'] / t['dict']:.2f}")
    return t["match"] / t["dict"], per_block


def bench_verify() -> float:
    """Checksum verification of a 2 MiB payload against a memcpy of it (into a buffer made once)."""
    payload = os.urandom(2 << 20)
    dst = bytearray(len(payload))
    sums = {algo: checksum(payload, algo) for algo in ("xxh3-128", "blake2b-128")}

    def copy() -> None:
        dst[:] = payload  # memoryview slice assignment: one memcpy

    t = interleaved({
        "memcpy": copy,
        "xxh3-128": lambda: verify_checksum(payload, sums["xxh3-128"]),
        "blake2b-128": lambda: verify_checksum(payload, sums["blake2b-128"]),
    }, rounds=quick(40, 2), inner=quick(5, 1))  # fmt: skip
    print(f"verify a 2 MiB payload: memcpy {t['memcpy'] * 1e6:.0f} us; xxh3-128 {t['xxh3-128'] * 1e6:.0f} us "
          f"({t['xxh3-128'] / t['memcpy']:.2f}x); blake2b-128 (before) {t['blake2b-128'] * 1e6:.0f} us "
          f"({t['blake2b-128'] / t['memcpy']:.2f}x)")  # fmt: skip
    return t["xxh3-128"] / t["memcpy"]


def bench_keyed_verify() -> float:
    """Keyed MAC verification of a 2 MiB payload (what a load runs) against a memcpy of it; the options beside."""
    import blake3
    import xxhash

    payload = os.urandom(2 << 20)
    dst = bytearray(len(payload))
    seal = StateSeal(SECRET)
    desc = seal.seal(StateDescriptor(key="ab" * 16, namespace=Namespace("acme"), model=ModelIdentity("m"),
                                     tokenizer=TokenizerIdentity("t"), layout=LAYOUT, span=TokenSpan(0, PAGE),
                                     nbytes=len(payload), checksum=checksum(payload),
                                     placement=Placement("dram", "n1")), payload)  # fmt: skip
    key = hashlib.blake2b(SECRET, digest_size=32).digest()

    def copy() -> None:
        dst[:] = payload

    def xxh3_mac() -> bool:  # a keyed MAC over the descriptor and the payload's XXH3-128 (not safe: see docs)
        return bool(hashlib.blake2b(xxhash.xxh3_128_digest(payload) + desc.key.encode(), key=key).digest())

    t = interleaved({
        "memcpy": copy,
        "StateSeal.check": lambda: seal.check(desc, payload),
        "blake3 1 thread": lambda: blake3.blake3(payload, key=key, max_threads=1).digest(),
        "mac over xxh3-128": xxh3_mac,
        "blake2b keyed": lambda: hashlib.blake2b(payload, key=key, digest_size=16).digest(),
    }, rounds=quick(30, 2), inner=quick(5, 1))  # fmt: skip
    assert seal.check(desc, payload)
    base = t["memcpy"]
    print(f"keyed MAC of a 2 MiB payload on {os.cpu_count()} cores: memcpy {base * 1e6:.0f} us; " + "; ".join(
        f"{name} {v * 1e6:.0f} us ({v / base:.2f}x)" for name, v in t.items() if name != "memcpy"))  # fmt: skip
    return t["StateSeal.check"] / base


def main() -> None:
    requires(NativeKeyer is not None, "nexuskv-native is not installed: the native figures cannot be printed")
    print(machine_speed())
    keyer = BlockKeyer(SECRET, PAGE)
    keys_ratio = bench_keys(keyer)
    r5, _ = bench_match(keyer, quick(10**5, 1000))
    r6, b6 = bench_match(keyer, quick(10**6, 3000))
    print(f"match / dict at 1e5: {r5:.2f}")
    native = None
    if NativeKeyer is not None:
        nkeyer = NativeKeyer(SECRET, PAGE)
        nkeys = bench_keys(nkeyer)
        nr6, nb6 = bench_match(nkeyer, quick(10**6, 3000), NativeIndex)
        native = (nkeys, nr6, nb6)
    verify = bench_verify()
    keyed = bench_keyed_verify()
    result("identity.keys_over_single_hash_32k", keys_ratio, "<=", 10)
    result("index.match_over_dict_1e5", r5, "<=", 3)
    result("index.match_over_dict_1e6", r6, "<=", 3)
    result("index.bytes_per_block_1e6", b6, "<=", 300)
    if native is None:
        print("nexuskv-native is not installed: no native figures")
    else:
        result("identity.native_keys_over_single_hash_32k", native[0], "<=", 2)
        result("index.native_bytes_per_block_1e6", native[2], "<=", 64)
        result("index.native_match_over_dict_1e6", native[1], "<=", 1)
    result("integrity.verify_over_memcpy_2m", verify, "<=", 0.5)
    result("integrity.keyed_verify_over_memcpy_2m", keyed, "<=", 1.0)


if __name__ == "__main__":
    main()
