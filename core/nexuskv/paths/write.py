"""The write path: produced state goes through the bounded writer, the tenant's admit and place rules, into a tier.

`commit` copies payloads into the writer queue and returns at once (backpressure refuses what does not fit).
On the writer thread each payload gets its descriptor (checksum included), the tenant's `admit` rules decide
whether to keep it and its `place` rules where (priority and TTL too), and it goes to the placed tier or the
next lower one with room. Promotions on hit (state a load read from a slower tier) take the same thread and the
same place rules.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from attrs import define

from nexuskv.contracts import Request, StateDescriptor, TensorSpec, TokenSpan, Usage
from nexuskv.contracts.checksums import checksum
from nexuskv.contracts.config import KernelConfig
from nexuskv.logs import get_logger
from nexuskv.planning.breakers import Health
from nexuskv.plugins.interfaces import StoredState, slot_of
from nexuskv.policy.loader import Policies
from nexuskv.policy.serving.live import LivePolicies
from nexuskv.state.keys import Keys
from nexuskv.storage.hierarchy import Hierarchy
from nexuskv.storage.write_queue import WriteItem, Writer

__all__ = ["CommitResult", "WritePath"]

log = get_logger("nexuskv.writepath")  # the component name operators filter on: stable


@define(frozen=True)
class CommitResult:
    """What `commit` accepted into the writer queue; the rest was refused by backpressure (never blocks)."""

    accepted: int
    refused: int

    @property
    def backpressure(self) -> bool:
        """True when the writer's bounds refused part of the commit."""
        return self.refused > 0


@define(frozen=True)
class _Promotion:
    """A writer item: state read from `source` on a hit, to be copied to the tier its place rules choose."""

    request: Request
    descriptor: StateDescriptor
    payload: bytes | memoryview
    source: str
    policies: Policies | None  # the revision serving when the hit was loaded: it places every block of it


# (request, keys, block, group, payload, tensors, the revision serving at commit: it admits and places them all)
_Produced = tuple[Request, Sequence[bytes], int, int, bytes, tuple[TensorSpec, ...], "Policies | None"]


class WritePath:
    """Commit, describe, admit, place and store; owns the bounded writer and its thread."""

    def __init__(self, config: KernelConfig, keys: Keys, hierarchy: Hierarchy, health: Health,
                 live: LivePolicies | None) -> None:  # fmt: skip
        self.config = config
        self.keys = keys
        self.hierarchy = hierarchy
        self.health = health
        self.live = live
        self.unadmitted = 0  # blocks not stored because no policy revision served yet (a rollout node's start)
        self.writer = Writer(self._write, config.writer_max_bytes, config.writer_max_items)
        self.orphans = 0  # paged blocks not stored because no tier holds their prefix

    def describe(self, request: Request, block: int, payload: bytes | memoryview, *, tier: str, group: int = 0,
                 keys: Sequence[bytes] | None = None, **extra: Any) -> StateDescriptor:  # fmt: skip
        """The descriptor of the state covering the request's first `block + 1` blocks (block is 0-based).

        Dense / latent payloads hold one page, `span` = that page; checkpoints hold the state at the end of the
        block, `span` = [0, end).
        """
        keys = self.keys.keys(request) if keys is None else keys
        if not 0 <= block < len(keys):
            raise IndexError(f"block {block} is not a full block of a {len(request.token_ids)}-token request")
        if not 0 <= group < len(request.layout.groups):
            raise IndexError(f"group {group} is not in the layout ({len(request.layout.groups)} groups)")
        page = self.keys.page_size
        kind = request.layout.groups[group].kind
        start = 0 if kind.checkpointed else block * page
        return StateDescriptor(
            key=keys[block].hex(),
            parent_key=keys[block - 1].hex() if block else None,
            namespace=request.namespace,
            model=request.model,
            tokenizer=request.tokenizer,
            layout=request.layout,
            group=group,
            span=TokenSpan(start, (block + 1) * page),
            nbytes=len(payload),
            checksum=checksum(payload, self.config.checksum),
            placement=self.hierarchy.placement(tier),
            usage=Usage(),
            **extra,
        )

    def commit(self, request: Request,
               payloads: Mapping[tuple[int, int], bytes | memoryview] | Sequence[bytes | memoryview], *,
               keys: Sequence[bytes] | None = None,
               tensors: Mapping[tuple[int, int], Sequence[TensorSpec]] | None = None) -> CommitResult:  # fmt: skip
        """Hand produced state to the bounded writer: `payloads[block]` (group 0) or `payloads[(block, group)]`.

        `tensors[(block, group)]` names the raw tensors of a payload (dtype and shape), recorded in its descriptor
        so a connector can check them before restoring. Returns at once. The writer applies the tenant's `admit`
        and `place` rules, stores accepted state in its tier and indexes it; what the writer's bounds cannot take
        is refused (backpressure), never queued without bound.
        """
        keys = self.keys.keys(request) if keys is None else keys
        items = payloads.items() if isinstance(payloads, Mapping) else (((b, 0), p) for b, p in enumerate(payloads))
        specs = tensors or {}
        policies = self.policies  # one revision admits and places every block of this commit
        work = []
        for (block, group), payload in items:
            data = bytes(payload)  # the engine may reuse its buffer; the queue owns a copy
            spec = tuple(specs.get((block, group), ()))
            work.append(WriteItem(len(data), (request, keys, block, group, data, spec, policies)))
        accepted = self.writer.submit(work, tenant=request.tenant)
        return CommitResult(accepted=accepted, refused=len(work) - accepted)

    @property
    def policies(self) -> Policies | None:
        """The serving policies: read it once per operation, and use that object throughout."""
        return self.live.current if self.live is not None else None

    def promote(self, request: Request, states: Mapping[tuple[int, int], StoredState], source: str) -> None:
        """Queue a copy of state just read from `source` for the tier its place rules choose (best effort)."""
        policies = self.policies
        promote = [_Promotion(request, st.descriptor, st.payload, source, policies) for st in states.values()]
        self.writer.submit([WriteItem(len(p.payload), p) for p in promote], tenant=request.tenant)  # may be refused

    def prefetch_move(self, slot: bytes, source: str, target: str, request: Request | None = None) -> bool:
        """A prefetch move that obeys the tenant's `place` rules, exactly as promotion on hit does.

        The state goes to the tier its place rules choose (the proposed `target` when none fires), and only
        when that tier is faster than `source`: archived state a place rule keeps remote stays remote.
        """
        policies = self.policies
        if request is None or policies is None:
            return self.hierarchy.move(slot, source, target)
        policy = policies.for_tenant(request.tenant)
        return self.hierarchy.move(slot, source, target,
                                   choose=lambda desc: self._faster(policy, desc, request, source, target))

    def _faster(self, policy: Any, desc: StateDescriptor, request: Request, source: str,
                default: str) -> str | None:  # fmt: skip
        """The tier the place rules choose for `desc`, if it is faster than `source`; else None."""
        tier = self._placement(policy, desc, request, default)[0]
        return tier if self.hierarchy.faster(tier, source) else None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has stored everything queued, and tiers that write behind (disk) have written it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = self.writer.flush(timeout)
        return self.hierarchy.flush(deadline) and ok

    def close(self) -> None:
        """Stop the writer thread."""
        self.writer.close()

    # ------------------------------------------------------------------------------------------ writer thread

    def _write(self, item: _Produced | _Promotion) -> None:
        if isinstance(item, _Promotion):
            self._promote(item)
            return
        request, keys, block, group, data, spec, policies = item
        h = self.hierarchy
        if h.orphan(keys[block - 1] if block else None, request.layout, group):  # before hashing the payload
            self.orphans += 1  # its prefix is held nowhere: it would restore nothing and push out what would
            log.debug("block not stored: its prefix is held nowhere", tenant=request.tenant, block=block,
                      group=group, request_id=request.request_id)  # fmt: skip
            return
        first = h.fastest
        desc = self.describe(request, block, data, tier=first, group=group, keys=keys, tensors=spec)
        if policies is None and self.live is not None:
            self.unadmitted += 1  # no revision serves yet: admit nothing rather than bypass the tenant's rules
            return
        policy = policies.for_tenant(request.tenant) if policies is not None else None
        priority: float | None = None
        ttl_s: float | None = None
        tier = first
        if policy is not None:
            admit = policy.evaluate("admit", {"state": desc, "request": request, "node": h.node})
            if not admit.allowed:
                log.info("state not admitted", tenant=request.tenant, request_id=request.request_id, block=block,
                         rules=list(admit.deciding), messages=list(admit.messages))  # fmt: skip
                return
            tier, priority, ttl_s = self._placement(policy, desc, request, tier)
        if tier not in h.tiers:
            log.warning("place rule names an unknown tier; using the fastest", tier=tier, fallback=first)
            tier = first
        # The placed tier first; if it refuses (full of more valuable state), the next lower tier with room.
        order = list(h.tier_order) or list(h.tiers)
        candidates = order[order.index(tier):] if tier in order else [tier]
        for where in candidates:
            if where != desc.placement.tier:
                desc = attrs.evolve(desc, placement=h.placement(where))
            breaker = self.health.breaker(where)
            prio, value = h.priority_for(desc, priority)  # a rule's priority is kept as given
            try:
                ok = h.store(desc, data, prio, ttl_s, value=value)  # describe() just computed the checksum
            except Exception as exc:
                breaker.failure(f"put failed: {exc!r}")
                raise
            breaker.success()
            if ok:
                return

    def _placement(self, policy: Any, desc: StateDescriptor, request: Request,
                   tier: str) -> tuple[str, float | None, float | None]:  # fmt: skip
        """(tier, priority, ttl_s) the tenant's `place` rules choose for `desc`; `tier` and no bounds if none fires."""
        place = policy.evaluate("place", {"state": desc, "request": request, "node": self.hierarchy.node})
        if place.placement is None:
            return tier, None, None
        return place.placement.tier or tier, place.placement.priority, place.placement.ttl_s

    def _promote(self, item: _Promotion) -> None:
        """Copy state that was just read from a slower tier to the tier the tenant's `place` rules choose for it.

        Without policies the target is the fastest tier. Nothing happens when the target is not faster than
        where the state was read, or the target already holds it.
        """
        h = self.hierarchy
        desc, source = item.descriptor, item.source
        order = list(h.tier_order)
        target, priority, ttl_s = (order[0] if order else source), None, None
        policies = item.policies
        if policies is None and self.live is not None:
            return  # no revision served yet: nothing is placed without the tenant's rules
        policy = policies.for_tenant(item.request.tenant) if policies is not None else None
        if policy is not None:
            target, priority, ttl_s = self._placement(policy, desc, item.request, target)
        if not h.faster(target, source):
            return
        slot = slot_of(bytes.fromhex(desc.key), desc.group)
        if slot in h.tiers[target]:
            return
        usage = attrs.evolve(desc.usage, hits=desc.usage.hits + 1, last_access_s=time.time())
        promoted = attrs.evolve(desc, placement=h.placement(target), usage=usage)
        prio, value = h.priority_for(promoted, priority)
        try:
            h.store(promoted, item.payload, prio, ttl_s, value=value)  # verified by the load that read it
        except Exception as exc:  # a failing faster tier loses the copy, never the state
            self.health.breaker(target).failure(f"promotion put failed: {exc!r}")
