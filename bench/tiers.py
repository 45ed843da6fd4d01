"""Tier stores and transports against the limit measured in the same run, and the disk codec on real KV.

Per tier, put and get of 1 MiB and 16 MiB payloads, interleaved with the baseline of the same bytes: a memcpy for
DRAM and shared memory (the shm read is measured in a second process), a raw file write / read for disk (fsync on
both sides; codec off for the goal, `shuffle-zstd` shown too), a plain redis-py SET / GET on the same server for
Redis, both sides parsing replies with hiredis (the plugin's `redis[hiredis]`; the run prints each side's parser,
and in full mode leaves the Redis RESULT out, saying why, when either side is without it). Then the disk codec's
compression ratio and speed, plain zstd against byte-plane shuffle + zstd, on KV pages produced by the reference
engine (the demo's dense model, fp32, and a bf16 build of it). The DRAM tier's get returns a view of the stored
bytes, so its "get + touch over memcpy" holds by construction: it is printed, not a RESULT.

Run: `.venv/bin/python bench/tiers.py` (about 1 to 2 minutes; starts and stops its own redis-server).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import redis
import torch

import _tier_disk
import _tier_redis
import _tier_shm
from _common import QUICK, interleaved, quick, requires, result
from nexuskv import (
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    StateDescriptor,
    StateGroup,
    TokenizerIdentity,
    TokenSpan,
    configure_logging,
)
from nexuskv.builtins.dram import DramStore
from nexuskv_tier_disk import codec as disk_codec
from nexuskv_transformers.engine import Engine
from nexuskv_transformers.models import build_model
from nexuskv_transformers.state import StateCodec

RESULTS = ("tier.shm_read_touch_over_memcpy_16m",
           "tier.disk_get_over_raw_read_16m", "tier.redis_get_over_plain_get_16m",
           "codec.shuffle_zstd_over_plain_zstd_ratio")  # fmt: skip
SIZES = quick((1 << 20, 16 << 20), (256 << 10,))  # quick mode: 256 KiB stands for 16 MiB
REPEATS = quick(None, 2)  # quick mode: 2 timed repeats everywhere


def _desc(n: int) -> StateDescriptor:
    return StateDescriptor(key="00" * 16, namespace=Namespace("bench"), model=ModelIdentity("m"),
                           tokenizer=TokenizerIdentity("t"), layout=Layout(groups=[StateGroup("dense", 1, 1, 1)]),
                           span=_span(), nbytes=n, checksum="blake2b-128:00", placement=Placement("dram", "bench"))


def _span():

    return TokenSpan(0, 16)


def dram_rows(repeats: int = quick(15, 2)) -> list[dict[str, float]]:
    """DramStore put (it copies) and get (zero-copy view) against a memcpy of the same bytes, interleaved."""
    rows = []
    for size in SIZES:
        payload = _tier_disk.kv_payload(size)
        store = DramStore(4 * size)
        desc = _desc(size)
        samples: dict[str, list[float]] = {"put": [], "get": [], "memcpy": []}
        for i in range(repeats + 1):
            slot = i.to_bytes(17, "big")
            t0 = time.perf_counter()
            store.put(slot, payload, desc)
            t1 = time.perf_counter()
            got = store.get(slot)
            _ = got.payload[0]
            t2 = time.perf_counter()
            copy = bytearray(payload)
            t3 = time.perf_counter()
            del copy
            store.delete(slot)
            if i:  # the first round warms up
                samples["put"].append(t1 - t0)
                samples["get"].append(t2 - t1)
                samples["memcpy"].append(t3 - t2)
        med = {k: statistics.median(v) for k, v in samples.items()}
        # What a consumer sees: the get, then every byte read into its own (already mapped) buffer, against a
        # memcpy of the same bytes into the same buffer; interleaved, with no allocation in between.
        slot = b"\xff" * 17
        store.put(slot, payload, desc)
        dst = bytearray(size)
        dst[:] = payload

        def get_touch(slot: bytes = slot, dst: bytearray = dst, store: DramStore = store) -> None:
            got = store.get(slot)
            dst[:] = got.payload

        def copy_into(dst: bytearray = dst, payload: bytes = payload) -> None:
            dst[:] = payload

        touch = interleaved({"get_touch": get_touch, "copy_into": copy_into}, rounds=repeats * 2, inner=3)
        rows.append({"tier": "dram", "size": size, "put_s": med["put"], "get_s": med["get"],
                     "base_put_s": med["memcpy"], "base_get_s": med["memcpy"], "get_touch_s": touch["get_touch"],
                     "base_touch_s": touch["copy_into"]})  # fmt: skip
    return rows


def kv_pages(dtype: torch.dtype, tokens: int = quick(1024, 128)) -> list[bytes]:
    """Every page payload of a `tokens`-token prompt, as the connector commits them."""
    ref = build_model("dense", size="demo", dtype=dtype)
    eng = Engine(ref)
    g = torch.Generator().manual_seed(3)
    out = eng.prefill(torch.randint(3, 2000, (tokens + 1,), generator=g).tolist())
    codec = StateCodec(ref)
    return [codec.page_payload(out.cache, b, 0)[0] for b in range(tokens // ref.page_size)]


def codec_rows() -> dict[str, dict[str, float]]:
    """Per dtype: compression ratios of plain zstd and shuffle+zstd, and encode / decode speed on 1 MiB of pages.

    Each page is compressed as its own payload, as the disk tier stores them.
    """
    out = {}
    for name, dtype, elem in (("float32", torch.float32, 4), ("bfloat16", torch.bfloat16, 2)):
        pages = kv_pages(dtype)
        raw = sum(len(p) for p in pages)
        stored = {c: sum(len(disk_codec.encode(p, c, elem_size=elem).data) for p in pages)
                  for c in ("zstd", "shuffle-zstd")}  # fmt: skip
        speed = _tier_disk.codec_stats(b"".join(pages)[: 1 << 20], elem, **quick({}, {"repeats": 1}))
        out[name] = {"page_bytes": len(pages[0]), "pages": len(pages), "zstd_ratio": raw / stored["zstd"],
                     "shuffle_ratio": raw / stored["shuffle-zstd"], **{k: v for k, v in speed.items()
                                                                         if k.endswith("MBps")}}  # fmt: skip
    return out


def _line(row: dict) -> str:
    codec = f" codec={row['codec']}" if "codec" in row else ""
    return (f"{row['tier']:<6}{codec:<20} {row['size'] >> 20:>3} MiB  put {row['put_s'] * 1e3:8.3f} ms vs "
            f"{row['base_put_s'] * 1e3:8.3f} ms (x{row['put_s'] / row['base_put_s']:.2f})   get "
            f"{row['get_s'] * 1e3:8.3f} ms vs {row['base_get_s'] * 1e3:8.3f} ms "
            f"(x{row['get_s'] / row['base_get_s']:.2f})"
            + (f"   get + read every byte {row['get_touch_s'] * 1e3:8.3f} ms vs memcpy into the same buffer "
               f"{row['base_touch_s'] * 1e3:8.3f} ms (x{row['get_touch_s'] / row['base_touch_s']:.2f})"
               if "base_touch_s" in row else ""))


def _redis_parsers(parsers: dict[str, str]) -> bool:
    """Print the reply parser of each Redis side; whether both use hiredis (else say loudly that no RESULT comes)."""
    hiredis = _tier_redis.hiredis_version()
    print(f"redis reply parsers: tier {parsers['tier']}, plain GET {parsers['plain']} (redis-py {redis.__version__}, "
          f"hiredis {hiredis or 'not installed'}, usable by redis-py: {_tier_redis.HIREDIS_AVAILABLE})")
    fair = _tier_redis.hiredis_on_both(parsers)
    if not fair:
        print("REDIS NOT COMPARED: hiredis is not the reply parser of both sides, and production runs with it "
              "(`redis[hiredis]`); a pure-Python parser is no fair baseline, so no RESULT "
              "tier.redis_get_over_plain_get_16m is printed. Install it: "
              "`.venv/bin/pip install -e plugins/nexuskv-tier-redis`.")
    return fair


def main() -> None:
    requires(shutil.which("redis-server"), "redis-server is not installed (`make redis-server` installs Debian's)")
    configure_logging(level="warning", force=True)
    torch.set_grad_enabled(False)
    sized = quick({}, {"sizes": SIZES, "repeats": REPEATS})
    rows = dram_rows() + _tier_shm.run(**sized) + _tier_disk.run(**sized) + _tier_redis.run(**sized)
    print("baselines: dram and shm = memcpy of the same bytes; disk = raw file write (fsync) / read; "
          "redis = plain SET / GET, same client factory and parser (below)")
    for row in rows:
        print(_line(row))
    redis_fair = _redis_parsers(next(r["parsers"] for r in rows if r["tier"] == "redis"))
    codecs = codec_rows()
    for name, c in codecs.items():
        print(f"codec on reference-engine KV ({name}, {c['pages']} pages of {c['page_bytes']} bytes): plain zstd "
              f"{c['zstd_ratio']:.3f}:1, shuffle+zstd {c['shuffle_ratio']:.3f}:1; on 1 MiB: zstd encode "
              f"{c['zstd_encode_MBps']:.0f} / decode {c['zstd_decode_MBps']:.0f} MB/s, shuffle encode "
              f"{c['shuffle_encode_MBps']:.0f} / decode {c['shuffle_decode_MBps']:.0f} MB/s")  # fmt: skip

    def ratio(tier: str, op: str, base: str | None = None, **match: object) -> float:
        row = next(r for r in rows if r["tier"] == tier and r["size"] == SIZES[-1]
                   and all(r.get(k) == v for k, v in match.items()))  # fmt: skip
        return row[f"{op}_s"] / row[f"base_{base or op}_s"]

    shuffle_gain = codecs["float32"]["shuffle_ratio"] / codecs["float32"]["zstd_ratio"]
    print("default disk codec: " + ("shuffle-zstd (it compresses reference-engine KV better than plain zstd)"
                                    if shuffle_gain >= 1.0 else "zstd (shuffle did not beat it on reference KV)"))
    dram = ratio("dram", "get_touch", base="touch")
    print(f"dram get + copy into a buffer over a memcpy into it, 16 MiB: {dram:.3f} (a fact, not a result: the DRAM "
          "tier's get is a zero-copy view, so both sides are the same copy)")
    result("tier.shm_read_touch_over_memcpy_16m", ratio("shm", "get_touch", base="touch"), "<=", 2)
    result("tier.disk_get_over_raw_read_16m", ratio("disk", "get", codec="raw"), "<=", 1.5)
    if redis_fair or QUICK:  # quick mode prints every name; its values mean nothing anyway
        result("tier.redis_get_over_plain_get_16m", ratio("redis", "get"), "<=", 1.5)
    result("codec.shuffle_zstd_over_plain_zstd_ratio", shuffle_gain, ">=", 1.0)


if __name__ == "__main__":
    main()
