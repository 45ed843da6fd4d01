"""Sealed handoffs: how a prefill node tells a decode node where a request's state is, and nothing more.

Prefill/decode disaggregation runs a request's prompt on one node (the producer) and its decode on another (the
consumer). The producer's answer travels through a proxy, so what it says about its state must be worth nothing to
anyone who changes it or replays it elsewhere. `Handoffs.issue` writes a grant: the producer's node, epoch, the
transport address it serves its tiers on, which of its tiers hold the prompt's first blocks (runs), and an expiry;
a MAC under the deployment secret covers all of it *and the request's last granted block key*, which is never
sent. `Handoffs.accept` on the consumer recomputes that MAC with its own keys of the same request: a grant that
was changed, forged, expired, or is replayed for another tenant, model, adapter, salt or prompt (its keys differ)
does not check, and is refused with the reason. An accepted grant puts the producer's blocks in this node's index
as the producer's (`Location(tier, producer, epoch)`) and its address in a bounded directory the tiers' peer
fetch reads (`address`), both for the grant's lifetime only. The planner then prices fetching them over the
measured link to the producer against recomputing; the fetch itself is authenticated, namespace-bound and
checksum-verified as every peer fetch is, so a grant never makes wrong state load: at worst it makes a plan that
fails over to recompute.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from attrs import frozen

from nexuskv.contracts import Request
from nexuskv.logs import get_logger
from nexuskv.planning.planner import RESIDENT_TIER
from nexuskv.state.holding import Location
from nexuskv.state.index import Matcher
from nexuskv.state.restore_points import group_masks

__all__ = ["GRANT_VERSION", "HandoffResult", "Handoffs"]

log = get_logger("nexuskv.handoff")

GRANT_VERSION = 1
MAX_GRANT_BYTES = 4096  # a grant's fields together (the proxy and the gateway bound the body anyway)
MAX_NAME = 256
MAC_FORM = re.compile(r"[0-9a-f]{32}")


@frozen
class HandoffResult:
    """What `accept_handoff` made of a grant: the blocks now indexed as the producer's, or why none are."""

    blocks: int
    node: str = ""
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.blocks > 0


class Handoffs:
    """Issues grants for this node's state and accepts other nodes' grants; every method is thread-safe."""

    def __init__(self, secret: bytes, node: str, index: Matcher, epoch: Callable[[], int],
                 addresses: Callable[[], Mapping[str, str]], remote: str | None, *, ttl_s: float = 60.0,
                 max_grants: int = 4096, clock: Callable[[], float] = time.time,
                 peer: Callable[[str, str], tuple[str, int] | None] | None = None) -> None:  # fmt: skip
        self._key = hashlib.blake2b(secret[:64], digest_size=32, person=b"nexuskv.handoff").digest()
        self.node = node
        self.index = index
        self._epoch = epoch
        self._addresses = addresses  # transport -> address this node serves its tiers on
        self._peer = peer  # (node, transport) -> a peer's published address and live epoch: grants for its state
        self.remote = remote  # the transport that reaches peers (None: this node can neither issue nor accept)
        self.ttl_s = ttl_s
        self.max_grants = max_grants
        self._clock = clock
        self._lock = threading.Lock()
        # accepted grants, oldest first: (node, grant id) -> (expires, address, the index entries it added)
        self._grants: OrderedDict[tuple[str, str], tuple[float, str, list[tuple[bytes, Location]]]] = OrderedDict()
        self._expiry: list[tuple[float, tuple[str, str]]] = []  # a heap of (expires, grant) (stale ones skipped)
        # index entries grants added, with how many live grants vouch for each and the group bits they added; an
        # entry that was in the index before (a cluster index's, this node's own) is never added, nor removed
        self._added: dict[tuple[bytes, Location], list[int]] = {}  # -> [grants, mask added]
        self._newest: dict[str, tuple[float, str, str]] = {}  # node -> (expires, address, grant id) expiring last
        self.counts = {"issued": 0, "accepted": 0, "refused": 0, "expired": 0}

    # ------------------------------------------------------------------------------------------ the MAC

    def _mac(self, grant: Mapping[str, Any], request: Request, last_key: bytes) -> str:
        content = (grant["v"], grant["node"], grant["transport"], grant["address"], grant["epoch"],
                   tuple(tuple(r) for r in grant["runs"]), repr(float(grant["expires"])), request.tenant,
                   last_key.hex())  # fmt: skip
        return hashlib.blake2b(repr(content).encode(), key=self._key, digest_size=16).hexdigest()

    # ------------------------------------------------------------------------------------------ producer

    def issue(self, request: Request, keys: Sequence[bytes], *, blocks: int | None = None,
              holder: str | None = None) -> dict[str, Any] | None:  # fmt: skip
        """A grant for the longest prefix of `keys` (at most `blocks`) `holder` holds whole; None when none is.

        `holder` is this node by default. A router that follows the fleet's holdings (a cluster index) grants the
        node it routed a request to what a third node holds: the entries of the holder's live epoch and the
        address it published, both from the control plane (entries of an older registration are not granted).
        Engine-resident copies (`RESIDENT_TIER`) are not granted: peers cannot fetch them.
        """
        transport = self.remote
        holder = self.node if holder is None else holder
        if not transport:
            return None
        if holder == self.node:
            address, epoch = self._addresses().get(transport), int(self._epoch())
        else:
            peer = self._peer(holder, transport) if self._peer is not None else None
            if peer is None:
                return None
            address, epoch = peer
        if not address:
            return None
        paged, ckpt = group_masks(request.layout.groups)
        limit = len(keys) if blocks is None else max(0, min(blocks, len(keys)))
        runs: list[list[Any]] = []
        for b in range(limit):
            h = self.index.get(keys[b])
            best = None
            if h is not None:
                for loc, mask in h.locations:
                    if loc.node == holder and loc.tier != RESIDENT_TIER and mask & paged == paged \
                            and (holder == self.node or loc.epoch == epoch):  # fmt: skip
                        best = (loc.tier, mask & (paged | ckpt))
                        break
            if best is None:
                break
            if runs and runs[-1][1] == best[0] and runs[-1][2] == best[1]:
                runs[-1][0] = b + 1
            else:
                runs.append([b + 1, best[0], best[1]])
        if not runs:
            return None
        n = runs[-1][0]
        if ckpt and not runs[-1][2] & ckpt:  # a checkpointed group's state is needed at the cut: drop the tail
            return None
        grant: dict[str, Any] = {"v": GRANT_VERSION, "node": holder, "transport": transport, "address": address,
                                 "epoch": epoch, "runs": runs,
                                 "expires": round(self._clock() + self.ttl_s, 3)}  # fmt: skip
        grant["mac"] = self._mac(grant, request, keys[n - 1])
        with self._lock:
            self.counts["issued"] += 1
        return grant

    # ------------------------------------------------------------------------------------------ consumer

    def accept(self, request: Request, grant: Any, keys: Sequence[bytes]) -> HandoffResult:
        """Check a grant against this request's own keys; index the producer's blocks for its lifetime if it holds."""
        try:
            why, node = self._problem(request, grant, keys)
        except Exception as exc:  # anything a client can put in JSON is refused, never raised into a scheduler
            why, node = f"a malformed grant ({type(exc).__name__})", ""
        if why:
            with self._lock:
                self.counts["refused"] += 1
            log.warning("handoff refused; the request recomputes what it would have fetched", node=node or None,
                        request_id=request.request_id, tenant=request.tenant, reason=why)  # fmt: skip
            return HandoffResult(0, node, why)
        runs, epoch = grant["runs"], int(grant["epoch"])
        wanted: list[tuple[bytes, Location, int]] = []
        first = 0
        for end, tier, mask in runs:
            loc = Location(tier, node, epoch)
            wanted.extend((keys[b], loc, mask) for b in range(first, end))
            first = end
        gid, expires = grant["mac"], float(grant["expires"])
        with self._lock:
            self._purge(self._clock())
            if (node, gid) not in self._grants:
                vouched: list[tuple[bytes, Location]] = []
                for key, loc, mask in wanted:
                    mine = self._added.get((key, loc))
                    if mine is None:
                        held = self.index.get(key)
                        new = mask & ~(held.at(loc) if held is not None else 0)
                        if not new:
                            continue  # in the index already, not through a grant: not ours to add or remove
                        self.index.insert(key, loc, new)
                        mine = self._added[(key, loc)] = [0, new]
                    mine[0] += 1
                    vouched.append((key, loc))
                self._grants[(node, gid)] = (expires, str(grant["address"]), vouched)
                newest = (expires, str(grant["address"]), gid)
                if node not in self._newest or newest > self._newest[node]:
                    self._newest[node] = newest
                heapq.heappush(self._expiry, (expires, (node, gid)))
                while len(self._grants) > self.max_grants:
                    self._drop(self._grants.popitem(last=False)[1])
            self.counts["accepted"] += 1
        log.info("handoff accepted", node=node, request_id=request.request_id, blocks=first)
        return HandoffResult(first, node, "")

    def _problem(self, request: Request, grant: Any, keys: Sequence[bytes]) -> tuple[str, str]:
        """Why `grant` is not usable for this request ("" when it is), and the node it names."""
        if not isinstance(grant, Mapping):
            return f"a grant is an object, got {type(grant).__name__}", ""
        if len(repr(grant)) > MAX_GRANT_BYTES:
            return f"a grant of over {MAX_GRANT_BYTES} bytes", ""
        want = {"v", "node", "transport", "address", "epoch", "runs", "expires", "mac"}
        if set(grant) != want:
            return f"a grant has exactly the fields {sorted(want)}, got {sorted(map(str, grant))}", ""
        node = grant["node"]
        if not isinstance(node, str) or not 0 < len(node) <= MAX_NAME:
            return "the grant's node is not a name", ""
        if grant["v"] != GRANT_VERSION:
            return f"grant version {grant['v']!r}, this node reads {GRANT_VERSION}", node
        if node == self.node:
            return "the grant names this very node (its state is in the local index already)", node
        if not self.remote or grant["transport"] != self.remote:
            return f"the grant's transport {grant['transport']!r} is not this node's peer transport " \
                   f"({self.remote!r})", node  # fmt: skip
        if not isinstance(grant["address"], str) or not 0 < len(grant["address"]) <= MAX_NAME:
            return "the grant's address is not an address", node
        if not isinstance(grant["epoch"], int) or isinstance(grant["epoch"], bool) or grant["epoch"] < 0:
            return "the grant's epoch is not a non-negative integer", node
        expires = grant["expires"]
        if isinstance(expires, bool) or not ((isinstance(expires, float) and math.isfinite(expires))
                                             or (isinstance(expires, int) and abs(expires) < 1 << 53)):
            return "the grant's expiry is not a time", node
        now = self._clock()
        if expires <= now:
            return f"the grant expired {now - expires:.3f} s ago", node
        if expires > now + 2 * self.ttl_s:
            return "the grant expires further ahead than any this deployment issues", node
        runs = grant["runs"]
        if not isinstance(runs, list) or not 0 < len(runs) <= len(keys):
            return f"the grant's runs are not 1 to {len(keys)} [end, tier, mask] triples", node
        paged, ckpt = group_masks(request.layout.groups)
        first = 0
        for run in runs:
            if (not isinstance(run, list) or len(run) != 3 or not isinstance(run[0], int) or isinstance(run[0], bool)
                    or not isinstance(run[1], str) or not isinstance(run[2], int) or isinstance(run[2], bool)):
                return "a run is not [end, tier, mask]", node
            end, tier, mask = run
            if not first < end <= len(keys):
                return f"a run ends at block {end}, not after {first} and within the request's {len(keys)}", node
            if not tier or len(tier) > MAX_NAME or tier == RESIDENT_TIER:
                return f"tier {tier[:MAX_NAME]!r} cannot be fetched from a peer", node
            if mask & paged != paged or mask & ~(paged | ckpt):
                return f"group mask {mask:b} is not this layout's", node
            first = end
        mac = grant["mac"]
        if not isinstance(mac, str) or not MAC_FORM.fullmatch(mac) or \
                not hmac.compare_digest(mac, self._mac(grant, request, keys[first - 1])):  # fmt: skip
            return "the grant's MAC does not check (changed, forged, or for another request, tenant or model)", node
        return "", node

    # ------------------------------------------------------------------------------------------ the directory

    def address(self, node: str, transport: str) -> str | None:
        """The address of peer `node` on `transport` from its live grant that expires last (None: none is live).

        The newest grant, not the last accepted: a tenant replaying a grant the producer issued before it restarted
        on another port (within that grant's lifetime) cannot point everyone's fetches at the old address.
        """
        if transport != self.remote:
            return None
        with self._lock:
            self._purge(self._clock())
            newest = self._newest.get(node)
            if newest is not None and (node, newest[2]) not in self._grants:  # it went: find the next (rare)
                live = [(e, a, g) for (peer, g), (e, a, _) in self._grants.items() if peer == node]
                newest = max(live) if live else None
                if newest is None:
                    del self._newest[node]
                else:
                    self._newest[node] = newest
        return newest[1] if newest is not None else None

    def live(self) -> int:
        """Accepted grants not yet expired."""
        with self._lock:
            self._purge(self._clock())
            return len(self._grants)

    def _purge(self, now: float) -> None:
        """Forget expired grants and the index entries only they vouched for (under the lock; O(expired))."""
        while self._expiry and self._expiry[0][0] <= now:
            expires, gid = heapq.heappop(self._expiry)
            entry = self._grants.get(gid)
            if entry is not None and entry[0] == expires:
                del self._grants[gid]
                self._drop(entry)
                self.counts["expired"] += 1
        if len(self._expiry) > 4 * max(self.max_grants, len(self._grants)):  # bounded: dropped grants' leftovers
            self._expiry = [(e, g) for e, g in self._expiry if g in self._grants]
            heapq.heapify(self._expiry)

    def _drop(self, entry: tuple[float, str, list[tuple[bytes, Location]]]) -> None:
        """Release a grant's index entries: each goes when no other live grant vouches for it (O(its blocks))."""
        for pair in entry[2]:
            mine = self._added.get(pair)
            if mine is None:
                continue
            mine[0] -= 1
            if mine[0] <= 0:
                del self._added[pair]
                self.index.remove(pair[0], pair[1], mine[1])
