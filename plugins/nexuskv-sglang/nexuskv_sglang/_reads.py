"""Private: reading pages for SGLang, and remembering which pages an existence answer promised.

`PageReader` reads verified pages (`Kernel.load`: key, group, checksum, MAC) and hands each to a sink that copies
it into SGLang's memory. A large run is read by several threads (one page's tier read, MAC check and copy overlap
another's), the whole read bounded by the kernel's `load_timeout_ms`; a small one in the caller's thread, bounded
by the tiers' own timeouts only. Once `read` returns, no late page ever reaches the sink: SGLang frees the slots of
pages it was told failed, and may hand them to another request.

`Approvals` remembers, for a short time, the page hashes an existence answer said were worth fetching. SGLang
reads what it was promised in later calls (its KV pages in batches of at most 128, a hybrid model's Mamba or
sliding-window pages in a call of their own, without the KV run before them): those reads are served as the
existence plan decided, not planned again on a fragment that alone would not be worth fetching.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from nexuskv import get_logger
from nexuskv_sglang._pools import Pool

__all__ = ["Approvals", "PageReader"]

log = get_logger("nexuskv_sglang")

Sink = Callable[[int, torch.Tensor], None]


class Approvals:
    """Page hashes an existence answer approved, each for `ttl_s` seconds; at most `limit` remembered. Thread-safe."""

    def __init__(self, ttl_s: float = 30.0, limit: int = 1 << 16) -> None:
        self.ttl_s, self.limit = ttl_s, limit
        self._until: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def approve(self, hashes: Iterable[str]) -> None:
        """Remember `hashes` as worth fetching until `ttl_s` from now."""
        until = time.monotonic() + self.ttl_s
        with self._lock:
            for h in hashes:
                self._until[h] = until
                self._until.move_to_end(h)
            while len(self._until) > self.limit:
                self._until.popitem(last=False)

    def approved(self, hashes: Sequence[str]) -> bool:
        """True when every one of `hashes` was approved and has not expired."""
        if not hashes:
            return False
        now = time.monotonic()
        with self._lock:
            return all(self._until.get(h, 0.0) > now for h in hashes)


class _Gate:
    """Lets sinks run until `close`; `close` waits for the ones running (copies: short) and refuses the rest."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open, self._busy = True, 0

    def run(self, fn: Callable[[], None]) -> bool:
        with self._cond:
            if not self._open:
                return False
            self._busy += 1
        try:
            fn()
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
        return True

    def close(self) -> None:
        with self._cond:
            self._open = False
            while self._busy:
                self._cond.wait()


class PageReader:
    """Verified page reads into SGLang's memory (module docstring). Thread-safe."""

    def __init__(self, kernel: Any, *, threads: int = 4, parallel_bytes: int = 1 << 20) -> None:
        self.kernel = kernel
        self.parallel_bytes = parallel_bytes
        self.timeout_s = float(kernel.config.load_timeout_ms) / 1e3
        self._io = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="nexuskv-sglang-read")

    def page(self, pool: Pool, block_key: bytes) -> torch.Tensor | None:
        """One page of `pool`, verified, as a flat tensor over the payload; None when it cannot be served."""
        got = self.kernel.load(block_key, pool.group)
        if got is None or len(got.payload) != pool.page_bytes:
            log.warning("nexuskv: a page was not served; SGLang recomputes from it", pool=pool.name,
                        why="missing or failed verification" if got is None else
                        f"{len(got.payload)} bytes, a page is {pool.page_bytes}")  # fmt: skip
            return None
        return torch.frombuffer(got.payload, dtype=pool.flat_dtype)

    def read(self, pool: Pool, block_keys: Sequence[bytes], n: int, sink: Sink) -> int:
        """Read pages [0, n) of `pool` into `sink(i, page)`; how many leading pages arrived.

        A small run is read in the caller's thread. A large one is read by the reader threads and bounded by the
        kernel's `load_timeout_ms`: at the first page that fails or is late, the pages not started are cancelled
        and the sink is closed (a page copying now finishes first; a page read later is dropped).
        """
        if n * pool.page_bytes < self.parallel_bytes:
            for i in range(n):
                src = self.page(pool, block_keys[i])
                if src is None:
                    return i
                sink(i, src)
            return n
        gate = _Gate()

        def one(i: int) -> bool:
            src = self.page(pool, block_keys[i])
            return src is not None and gate.run(lambda: sink(i, src))

        futures = [self._io.submit(one, i) for i in range(n)]
        until = time.monotonic() + self.timeout_s
        done = n
        for i, f in enumerate(futures):
            try:
                ok = f.result(timeout=max(0.0, until - time.monotonic()))
            except concurrent.futures.TimeoutError:
                log.warning("nexuskv: pages were late; SGLang recomputes from the first", pool=pool.name, page=i,
                            timeout_ms=self.timeout_s * 1e3)  # fmt: skip
                ok = False
            except Exception:
                log.exception("nexuskv: a page read failed; SGLang recomputes from it", pool=pool.name, page=i)
                ok = False
            if not ok:
                done = i
                for rest in futures[i:]:  # the late page too: queued reads would only delay the next call's
                    rest.cancel()
                break
        gate.close()
        return done

    def close(self) -> None:
        """Stop the reader threads (reads not started are cancelled; one running finishes in its tier's time)."""
        self._io.shutdown(wait=False, cancel_futures=True)
