"""Block keys for the kernel: a request's keys, a session's growing chain, and keys under another namespace.

`Keys` owns the session cache (one `KeyChain` per session, least recently used evicted first) and its lock:
schedulers call `keys_for` from many threads, and a chain must never be extended by two of them at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from nexuskv.contracts import ExtraInput, Namespace, Request
from nexuskv.errors import ConfigError, DeadlinePassed, check_deadline
from nexuskv.state.identity import BlockKeyer, KeyChain
from nexuskv.state.index import Match, Matcher, match_within
from nexuskv.state.restore_points import group_masks

__all__ = ["CHUNK_BLOCKS", "Keys"]

CHUNK_BLOCKS = 16
"""Blocks keyed between two deadline checks by session chains and shared-state lookups (about 15 us in Python)."""


def _keyed(extras: Iterable[ExtraInput], tokens: int) -> list[tuple[int, str]]:
    """The extra inputs that fall in the first `tokens` tokens (the blocks a chain has keyed), in key order."""
    return sorted((x.position, x.digest) for x in extras if x.position < tokens)


class Keys:
    """The kernel's block keys: plain, per session (cached chains), and under a shared namespace."""

    def __init__(self, keyer: BlockKeyer, session_cache: int = 1024) -> None:
        self.keyer = keyer
        self.session_cache = session_cache
        self._sessions: collections.OrderedDict[str, tuple[KeyChain, Sequence[int], Sequence[ExtraInput]]] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    @property
    def page_size(self) -> int:
        """The page size every request's layout must use."""
        return self.keyer.page_size

    def keys(self, request: Request, deadline: float | None = None) -> list[bytes]:
        """Block keys of every full block of the request (its layout's page size must be the kernel's).

        With a `deadline` (a `time.perf_counter()` value) the keyer's `keys_until` stops hashing once it has
        passed (checked between chunks, the first one included) and `DeadlinePassed` is raised.
        """
        if request.layout.page_size != self.keyer.page_size:
            raise ConfigError(f"request {request.request_id}: layout page_size {request.layout.page_size} "
                              f"is not the kernel's page_size {self.keyer.page_size}")  # fmt: skip
        if deadline is None:
            return self.keyer.request_keys(request)
        got = self.keyer.keys_until(self.keyer.request_root(request), request.token_ids, request.extra_inputs,
                                    deadline)  # fmt: skip
        if len(got) < len(request.token_ids) // self.keyer.page_size:
            raise DeadlinePassed("keys")
        return got

    def session(self, request: Request) -> KeyChain:
        """A key chain for a session that will grow by appending tokens (multi-turn chat, agent loops)."""
        chain = self.keyer.chain(self.keyer.request_root(request))
        chain.extend(request.token_ids, request.extra_inputs)
        return chain

    def keys_for(self, request: Request, session: str | None = None, deadline: float | None = None) -> list[bytes]:
        """Block keys of a request; with `session`, continue that session's cached chain (multi-turn chat).

        The cached chain is reused only when the request's tokens start with every token it has seen, under
        the same identity, with the same extra inputs in the blocks it has keyed; otherwise the keys are
        computed afresh and replace it. Either way the keys are exactly `keys(request)`. With a `deadline`,
        `DeadlinePassed` is raised once it passes (waiting for the session, or between chunks); the chain keeps
        what was hashed, so the next turn goes on from there.
        """
        if session is None:
            return self.keys(request, deadline)
        toks = request.token_ids
        extras = request.extra_inputs
        root = self.keyer.request_root(request)
        wait = -1.0 if deadline is None else max(0.0, deadline - time.perf_counter())
        if not self._lock.acquire(timeout=wait):
            raise DeadlinePassed("keys (session busy)")
        try:
            got = self._sessions.get(session)
            if got is not None:
                chain, seen, seen_extras = got
                if not (chain.root == root and len(seen) <= len(toks) and toks[: len(seen)] == seen
                        and _keyed(seen_extras, chain.tokens) == _keyed(extras, chain.tokens)):  # fmt: skip
                    got = None
            if got is None:
                chain, seen = self.keyer.chain(root), ()
                self._sessions[session] = (chain, seen, extras)
                while len(self._sessions) > self.session_cache:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(session)
            step = self.keyer.deadline_chunk * self.keyer.page_size
            for start in range(len(seen), len(toks), step):
                if deadline is not None and time.perf_counter() > deadline:
                    self._sessions[session] = (chain, toks[:start], extras)  # what the chain has taken in
                    raise DeadlinePassed("keys")
                chain.extend(toks[start : start + step], extras)
            self._sessions[session] = (chain, toks, extras)
            return list(chain.keys)  # a copy: the chain keeps growing
        finally:
            self._lock.release()

    def under(self, namespace: Namespace, request: Request) -> list[bytes]:
        """The request's keys as if it were made in `namespace` (state another tenant shares)."""
        root = self.keyer.root(namespace, request.model, request.tokenizer, request.layout)
        return self.keyer.keys(root, request.token_ids, request.extra_inputs)

    def held_prefix(self, namespace: Namespace, request: Request, held: Callable[[bytes], object],
                    chunk: int = 8, deadline: float | None = None) -> list[bytes]:  # fmt: skip
        """Keys under `namespace` in doubling chunks, stopping after the first chunk with a block nobody holds.

        Looking for shared state costs one small chunk of hashing when there is none (`held(key)` is None for a
        block nobody holds). Checkpointed layouts can restore past a gap, so they get every key. With a
        `deadline`, `DeadlinePassed` is raised between chunks once it has passed.
        """
        root = self.keyer.root(namespace, request.model, request.tokenizer, request.layout)
        page = request.layout.page_size
        toks: Sequence[int] = request.token_ids
        extras = request.extra_inputs
        every = bool(extras) or bool(group_masks(request.layout.groups)[1])
        if every:
            chunk = CHUNK_BLOCKS  # every key, still in bounded chunks
        keys: list[bytes] = []
        while len(keys) * page + page <= len(toks):
            check_deadline(deadline, "shared state keys")
            start = len(keys) * page
            new = self.keyer.extend(keys[-1] if keys else root, toks[start : start + chunk * page], extras,
                                    offset=start)  # fmt: skip
            keys.extend(new)
            if not new or (not every and any(held(k) is None for k in new)):
                break
            chunk = min(chunk * 2, CHUNK_BLOCKS) if deadline is not None else chunk * 2
        return keys

    def _held_and_matched(self, index: Matcher, ns: Namespace, request: Request,
                          deadline: float) -> tuple[Match, list[bytes]]:  # fmt: skip
        keys = self.held_prefix(ns, request, index.get, deadline=deadline)
        return index.match(keys, request.layout), keys

    def shared_match(self, index: Matcher, request: Request, deadline: float,
                     watchdog: concurrent.futures.Executor | None, seen: dict[tuple[str, str], Match] | None,
                     owner: str, scope: str) -> tuple[Match, list[bytes]]:  # fmt: skip
        """What `index` holds of `request` in `owner`'s scope `scope`: the match, and the request's keys there.

        The decision step's shared-scope lookup (the read path binds everything but `owner` and `scope`): keys in
        doubling chunks (`held_prefix`), then the match (`match_within`: inline, or under `watchdog` for a
        matcher that is not), both bounded by the plan's `deadline`. `seen` records every match, for a plan whose
        inputs are captured.
        """
        ns = Namespace(tenant=owner, scope=scope, cache_salt=request.cache_salt)
        if watchdog is None:  # an inline matcher: its `get` and `match` are bounded here
            keys = self.held_prefix(ns, request, index.get, deadline=deadline)
            match = match_within(index, keys, request.layout, deadline, None)
        else:  # a plugin matcher: its `get` may hang like its `match`, so both run under the watchdog
            future = watchdog.submit(self._held_and_matched, index, ns, request, deadline)
            try:
                match, keys = future.result(timeout=max(deadline - time.perf_counter(), 0.0))
            except concurrent.futures.TimeoutError:
                raise DeadlinePassed("the matcher") from None
        if seen is not None:
            seen[(owner, scope)] = match
        return match, keys
