"""One node's inference engine: continuous batching with chunked prefill, as vLLM and SGLang schedule.

Each iteration batches every running decode (one token each) with prefill chunks taken FCFS from the waiting
queue under a token budget (`chunk_tokens`); its duration comes from the simulator profile. A request's first
token comes out of the iteration that ran its last prefill chunk (TTFT = end of that iteration - arrival); it
then decodes its remaining `output_tokens - 1` tokens, one per iteration, and leaves. Decode contexts are kept
as one running sum, so an iteration costs O(chunks) and not O(running requests).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import simpy

from nexuskv_sim.api import SimRequest
from nexuskv_sim.profile import ModelProfile

__all__ = ["Engine", "Job"]


class Job:
    """A request inside the simulator (mutable bookkeeping around the frozen `SimRequest`)."""

    __slots__ = ("cached_blocks", "ctx", "decision", "k_start", "keys", "node", "planned_prefill", "prefill_left",
                 "req", "started", "ttft_ms")  # fmt: skip

    def __init__(self, req: SimRequest, keys: tuple[Any, ...], node: str) -> None:
        self.req = req
        self.keys = keys
        self.node = node
        self.decision: Any = None
        self.cached_blocks = 0
        self.planned_prefill = 0
        self.prefill_left = 0
        self.ctx = 0  # tokens of the sequence so far (cached + prefilled)
        self.started = False
        self.k_start = 0
        self.ttft_ms = -1.0


class Engine:
    """A continuous-batching engine serving one model on one node."""

    def __init__(self, env: simpy.Environment, node: str, model: ModelProfile, *, chunk_tokens: int, max_batch: int,
                 hbm_capacity_blocks: int, on_first_token: Callable[[Job], None], on_finish: Callable[[Job], None],
                 on_report: Callable[[str, tuple[int, int, int, int]], None]) -> None:  # fmt: skip
        self.env = env
        self.node = node
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.max_batch = max_batch
        self.hbm_capacity_blocks = hbm_capacity_blocks
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self._on_report = on_report
        self.waiting: deque[Job] = deque()  # in the prefill queue, FCFS
        self.queued_tokens = 0  # prefill tokens of waiting and loading requests
        self.n_waiting = 0  # waiting and loading requests
        self.active_blocks = 0  # KV blocks of every request on the node (waiting, loading, decoding)
        self.k = 0  # iterations run
        self._decodes: list[tuple[int, int, Job]] = []  # (last decode iteration, tie-break, job)
        self._ctx_base = 0  # sum over running decodes of (input_tokens - k_start): context sum = base + n * k
        self._seq = 0
        self._wake: simpy.Event | None = None
        self.iterations = 0
        self.busy_ms = 0.0
        env.process(self._run())

    # ------------------------------------------------------------------------------------------ requests in

    def admit(self, job: Job, planned_prefill: int) -> None:
        """A request was routed here and starts loading: it counts as waiting, with its planned prefill."""
        job.planned_prefill = planned_prefill
        self.queued_tokens += planned_prefill
        self.n_waiting += 1
        self.active_blocks += job.req.blocks
        self._report()

    def enqueue(self, job: Job, prefill_tokens: int) -> None:
        """The request's loads are done: queue `prefill_tokens` of prefill after its cached context."""
        job.prefill_left = prefill_tokens
        job.ctx = job.req.input_tokens - prefill_tokens
        self.queued_tokens += prefill_tokens - job.planned_prefill
        self.waiting.append(job)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        self._report()

    # ------------------------------------------------------------------------------------------ the loop

    def _report(self) -> None:
        self._on_report(self.node, (self.queued_tokens, self.n_waiting, len(self._decodes), self.active_blocks))

    def _run(self) -> Generator[simpy.Event, Any, None]:
        env, m = self.env, self.model
        while True:
            if not self.waiting and not self._decodes:
                self._wake = env.event()
                yield self._wake
                self._wake = None
            n_dec = len(self._decodes)
            budget = self.chunk_tokens
            chunks: list[tuple[Job, int]] = []
            step = m.overhead_ms + n_dec * m.per_decode_ms + (self._ctx_base + n_dec * (self.k + 1)) * m.decode_ctx_ms
            for job in self.waiting:
                if budget <= 0 or (not job.started and n_dec + len(chunks) >= self.max_batch):
                    break
                take = min(budget, job.prefill_left)
                chunks.append((job, take))
                step += m.chunk_ms(take, job.ctx)
                budget -= take
            yield env.timeout(step)
            self.k += 1
            self.iterations += 1
            self.busy_ms += step
            for job, take in chunks:
                job.started = True
                job.ctx += take
                job.prefill_left -= take
                self.queued_tokens -= take
                if job.prefill_left == 0:
                    self.waiting.popleft()  # chunks are taken from the front, so finished ones lead
                    self.n_waiting -= 1
                    self._first_token(job)
            decodes = self._decodes
            while decodes and decodes[0][0] <= self.k:
                _, _, job = heapq.heappop(decodes)
                self._ctx_base -= job.req.input_tokens - job.k_start
                self._done(job)
            self._report()

    def _first_token(self, job: Job) -> None:
        self._on_first_token(job)
        last = self.k + job.req.output_tokens - 1  # the prefill iteration produced the first token
        if last <= self.k:
            self._done(job)
            return
        job.k_start = self.k
        self._ctx_base += job.req.input_tokens - self.k
        self._seq += 1
        heapq.heappush(self._decodes, (last, self._seq, job))

    def _done(self, job: Job) -> None:
        self.active_blocks -= job.req.blocks
        self._on_finish(job)
