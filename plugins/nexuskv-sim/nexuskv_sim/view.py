"""The delayed cluster view strategies decide on: loads and holdings as of `now - report_delay_ms`.

Nodes report their load whenever it changes; tiers log every insert and eviction. The view keeps, per node, the
reports not yet superseded at the cutoff, and a lagged replica of every tier's key set to which logged changes
are applied lazily, once their time is at or before the cutoff. With `report_delay_ms = 0` the view is exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence

import simpy

from nexuskv_sim.api import TIERS, NodeLoad, SimRequest
from nexuskv_sim.profile import Profile
from nexuskv_sim.tiers import block_keys

__all__ = ["DelayedView"]

NEVER = float("-inf")  # the time of a node's report before it made one


class DelayedView:
    """`ClusterView` over a running simulation."""

    tiers: Sequence[str] = TIERS

    def __init__(self, env: simpy.Environment, *, node_model: Mapping[str, str], node_host: Mapping[str, str],
                 profile: Profile, report_delay_ms: float, hbm_capacity: Mapping[str, int]) -> None:  # fmt: skip
        self._env = env
        self.nodes: tuple[str, ...] = tuple(node_model)
        self.report_delay_ms = float(report_delay_ms)
        self._model = dict(node_model)
        self._host = dict(node_host)
        self._profile = profile
        self._hbm_capacity = dict(hbm_capacity)
        by_model: dict[str, list[str]] = {}
        for n, m in node_model.items():
            by_model.setdefault(m, []).append(n)
        self._by_model = {m: tuple(ns) for m, ns in by_model.items()}
        # replica index: hbm of every node, then dram and disk of every host
        self._index: dict[tuple[str, str], int] = {}
        for n in self.nodes:
            self._index["hbm", n] = len(self._index)
        for h in dict.fromkeys(node_host.values()):
            for t in ("dram", "disk"):
                self._index[t, h] = len(self._index)
        self._replicas: list[set[Hashable]] = [set() for _ in self._index]
        self._hbm_replica = {n: self._index["hbm", n] for n in self.nodes}
        self._host_replicas = [(h, i) for (t, h), i in self._index.items() if t != "hbm"]
        self._log: deque[tuple[float, int, Hashable, bool]] = deque()
        self._loads: dict[str, deque[tuple[float, tuple[int, int, int, int]]]] = {
            n: deque([(NEVER, (0, 0, 0, 0))]) for n in self.nodes
        }
        self._keys: dict[int, tuple[Hashable, ...]] = {}

    # ------------------------------------------------------------------------------------------ feeds

    def replica_index(self, tier: str, owner: str) -> int:
        """Index of the replica of `tier` of `owner` (a node for hbm, a host for dram and disk)."""
        return self._index[tier, owner]

    def log(self, replica: int, key: Hashable, present: bool) -> None:
        """A tier gained (`present`) or lost `key` now."""
        self._log.append((self._env.now, replica, key, present))

    def report(self, node: str, load: tuple[int, int, int, int]) -> None:
        """`node` reports (queued prefill tokens, waiting requests, running decodes, hbm used blocks) now."""
        dq, now = self._loads[node], self._env.now
        if dq[-1][0] == now:
            dq[-1] = (now, load)
        else:
            dq.append((now, load))
        cutoff = now - self.report_delay_ms
        while len(dq) > 1 and dq[1][0] <= cutoff:
            dq.popleft()

    def remember(self, req: SimRequest, keys: tuple[Hashable, ...]) -> None:
        """Cache the keys of a live request."""
        self._keys[req.rid] = keys

    def forget(self, req: SimRequest) -> None:
        """Drop the cached keys of a finished request."""
        self._keys.pop(req.rid, None)

    def advance(self) -> None:
        """Apply every logged change at or before the cutoff to the replicas."""
        cutoff = self._env.now - self.report_delay_ms
        log, reps = self._log, self._replicas
        while log and log[0][0] <= cutoff:
            _, i, key, present = log.popleft()
            if present:
                reps[i].add(key)
            else:
                reps[i].discard(key)

    # ------------------------------------------------------------------------------------------ ClusterView

    @property
    def now(self) -> float:
        """Simulated time (ms)."""
        return self._env.now

    def loads(self) -> dict[str, NodeLoad]:
        """Each node's last report at or before `now - report_delay_ms`."""
        cutoff = self._env.now - self.report_delay_ms
        out = {}
        for n, dq in self._loads.items():
            while len(dq) > 1 and dq[1][0] <= cutoff:
                dq.popleft()
            t, (q, w, d, used) = dq[0]
            at = t if t > NEVER else -1.0  # no report yet: before time 0, so a route at time 0 is not in it
            out[n] = NodeLoad(n, at, q, w, d, used, self._hbm_capacity[n], self._model[n])
        return out

    def _sets(self, node: str, tier: str) -> list[set[Hashable]]:
        i = TIERS.index(tier)
        h = self._host[node]
        idx = [self._index["hbm", node], self._index["dram", h], self._index["disk", h]][: i + 1]
        return [self._replicas[j] for j in idx]

    def _req_keys(self, req: SimRequest) -> tuple[Hashable, ...]:
        keys = self._keys.get(req.rid)
        return keys if keys is not None else block_keys(req)

    def prefix_blocks(self, node: str, tier: str, req: SimRequest) -> int:
        """Leading blocks of `req` held at `node` in `tier` or a faster one, as of the cutoff."""
        if self._model[node] != req.model:
            return 0
        self.advance()
        sets = self._sets(node, tier)
        n = 0
        for key in self._req_keys(req):
            if not any(key in s for s in sets):
                break
            n += 1
        return n

    def holdings(self, node: str, req: SimRequest) -> tuple[int, int, int]:
        """`prefix_blocks` of every tier at once (one pass): (hbm, dram, disk), non-decreasing."""
        if self._model[node] != req.model:
            return (0, 0, 0)
        self.advance()
        hbm, dram, disk = self._sets(node, "disk")
        h = d = k = 0
        in_h = in_d = True
        for key in self._req_keys(req):
            if in_h and key in hbm:
                h, d, k = h + 1, d + 1, k + 1
                continue
            in_h = False
            if in_d and (key in hbm or key in dram):
                d, k = d + 1, k + 1
                continue
            in_d = False
            if key in hbm or key in dram or key in disk:
                k += 1
                continue
            break
        return (h, d, k)

    def holders(self, req: SimRequest) -> tuple[str, ...]:
        """Nodes serving `req`'s model that hold its first block in hbm, or whose host holds it (as of the cutoff).

        One set lookup per node and per host: a fleet-sized strategy asks `holdings` of these nodes only.
        """
        keys = self._req_keys(req)
        if not keys:
            return ()
        self.advance()
        first, replicas = keys[0], self._replicas
        hosts = {h for h, i in self._host_replicas if first in replicas[i]}
        host, hbm = self._host, self._hbm_replica
        return tuple(n for n in self._by_model.get(req.model, ()) if host[n] in hosts or first in replicas[hbm[n]])

    def block_bytes(self, req: SimRequest) -> int:
        """Bytes of one full block of `req`'s model."""
        return self._profile.block_bytes(req.model)

    def nodes_for(self, model: str) -> tuple[str, ...]:
        """Nodes serving `model`."""
        return self._by_model.get(model, ())

    def host_of(self, node: str) -> str:
        """The host of `node`."""
        return self._host[node]

    def model_of(self, node: str) -> str:
        """The model `node` serves."""
        return self._model[node]
