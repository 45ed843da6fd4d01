"""The cluster-wide state index in Redis: which node and tier holds which blocks, for every node of a deployment.

`ClusterIndex` is a `nexuskv.Matcher`. Plans read a local index (the builtin `DictIndex`) as always, inline and
within the deadline; Redis is never on the request path. Two threads keep it cluster-wide: the publisher writes
this node's changes to Redis (fenced by its epoch, server side), the follower applies every peer's (see
`_index_sync`). The kernel binds it at start (`bind`): it learns the node's name, epochs and lease renewals
from the kernel's membership, and checks peers against the control plane's view.

Config: `[matcher] name = "redis"`, `url`, `prefix`, `timeout_s`, `poll_s`, `batch_keys`, `stream_maxlen`,
`shards` (every node's holding and stream split by key into this many shards; the same in the whole deployment),
`follow` (`"all"` shards, `"none"`: this node holds only its own entries and follows no peer, or a list of the
shards this process follows) and `resync_threads` (shards read at once when a peer is resynced).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nexuskv import DictIndex, Holding, IndexSnapshot, Layout, Location, Match
from nexuskv_tier_redis._index_follow import Follower
from nexuskv_tier_redis._index_lua import MAX_SHARDS
from nexuskv_tier_redis._index_sync import KEY_LEN, Op, Publisher
from nexuskv_tier_redis.client import make_client

__all__ = ["ClusterIndex"]

ALL_GROUPS = (1 << 16) - 1  # a layout has at most 16 groups: "every group" in a removal


class ClusterIndex:
    """A node's view of the whole cluster's holdings, kept in step through Redis (see the module docstring)."""

    inline = True
    """Planning reads the local index only: bounded, honours `match(..., deadline=)`."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "nexuskv/", timeout_s: float = 0.5,
                 poll_s: float = 0.1, batch_keys: int = 4096, stream_maxlen: int = 100_000, shards: int = 1,
                 follow: str | Sequence[int] = "all", resync_threads: int = 8) -> None:  # fmt: skip
        self.shards = shards
        self.follow = _followed(shards, follow)
        if not isinstance(resync_threads, int) or isinstance(resync_threads, bool) or not 1 <= resync_threads <= 64:
            raise ValueError(f"resync_threads is a whole number from 1 to 64, got {resync_threads!r}")
        self._resync_threads = resync_threads
        if not prefix.endswith("/"):
            raise ValueError(f"prefix must end with '/', got {prefix!r}")
        if poll_s >= timeout_s:
            raise ValueError(f"poll_s ({poll_s}) must be below timeout_s ({timeout_s}): reads block for poll_s")
        self.url, self.prefix = url, prefix
        self._client = make_client(url, timeout_s, timeout_s)
        self._poll_s, self._batch_keys, self._maxlen = poll_s, batch_keys, stream_maxlen
        self._local = DictIndex()
        self.node = ""
        self._queue: list[Op] = []
        self._qlock = threading.Lock()  # the queue, and its order against snapshots
        self.publisher: Publisher | None = None
        self.follower: Follower | None = None

    # ------------------------------------------------------------------------------------------ binding

    def bind(self, kernel: Any) -> None:
        """Follow `kernel`'s membership: publish its holdings under its epoch, follow its peers'."""
        self.node = kernel.node
        membership = kernel.membership
        view = getattr(membership.plane, "view", None)

        def members() -> Mapping[str, int] | None:
            return view.members() if view is not None and getattr(view, "synced", True) else None

        self.publisher = Publisher(self._client, self.prefix, self.node, self._take, self._snapshot,
                                   batch_keys=self._batch_keys, maxlen=self._maxlen, shards=self.shards)  # fmt: skip
        if self.follow:
            self.follower = Follower(self._client, self.prefix, self.node, self._local, members, poll_s=self._poll_s,
                                     shards=self.shards, follow=self.follow,
                                     resync_threads=self._resync_threads)  # fmt: skip
        self.publisher.on_fenced = membership.rejoin
        self.publisher.start()
        if self.follower is not None:
            self.follower.start()
        ttl = membership.lease_ttl_s
        membership.listen(lambda epoch, renewed_at: self.publisher.beat(epoch, renewed_at, ttl))  # type: ignore[union-attr]

    def stats(self) -> dict[str, int]:
        """Counters of both workers (registrations, events, refused_stale, resyncs, gaps, dropped_peers, errors)."""
        out: dict[str, int] = {}
        for worker in (self.publisher, self.follower):
            if worker is not None:
                for k, v in dict(worker.stats).items():
                    out[f"{'publish' if worker is self.publisher else 'follow'}.{k}"] = v
        return out

    def peers(self) -> dict[str, str]:
        """The peers followed now and their identities (epoch:token)."""
        peers = dict(self.follower.peers) if self.follower else {}  # one C-level copy: safe while it changes
        return {n: ident for n, (ident, _) in peers.items()}

    # ------------------------------------------------------------------------------------------ the queue

    def _enqueue(self, location: Location, kind: str, mask: int, keys: Iterable[bytes]) -> None:
        """Queue a change of this node's holdings (called under `_qlock`, with the local change it describes)."""
        if not self.node or location.node != self.node:
            return  # peers' entries (applied by the follower) and writes before binding are not republished
        blob = b"".join(keys)
        if blob:
            self._queue.append((kind, location.tier, mask, blob))

    def _wake(self) -> None:
        if self.publisher is not None:
            self.publisher.wake.set()

    def _take(self) -> list[Op]:
        with self._qlock:
            ops, self._queue = self._queue, []
        return ops

    def _snapshot(self) -> list[Op]:
        """Everything this node holds now, as store operations, with the queue emptied in the same step."""
        grouped: dict[tuple[str, int], list[bytes]] = {}
        with self._qlock:  # no change lands between the two: each is in the snapshot or in the queue after it
            self._queue = []
            for loc in [loc for loc in self._local.holdings() if loc.node == self.node]:
                for key in self._local.keys_at(loc):
                    h = self._local.get(key)
                    mask = h.mask_at(loc.tier, self.node) if h is not None else 0
                    if mask:
                        grouped.setdefault((loc.tier, mask), []).append(key)
        return [("S", tier, mask, b"".join(sorted(keys))) for (tier, mask), keys in sorted(grouped.items())]

    # ------------------------------------------------------------------------------------------ Matcher

    def insert(self, key: bytes, location: Location, group_mask: int = 1) -> None:
        """Record that `location` holds the groups in `group_mask` for block `key`."""
        _check(key)
        with self._qlock:  # the local change and its event in one step: the queue's order is the index's
            self._local.insert(key, location, group_mask)
            self._enqueue(location, "S", group_mask, (key,))
        self._wake()

    def insert_many(self, keys: Iterable[bytes], location: Location, group_mask: int = 1) -> None:
        """`insert` for many keys at one location."""
        keys = list(keys)
        for key in keys:
            _check(key)
        with self._qlock:
            self._local.insert_many(keys, location, group_mask)
            self._enqueue(location, "S", group_mask, keys)
        self._wake()

    def remove(self, key: bytes, location: Location | None = None, group_mask: int | None = None) -> bool:
        """Forget groups (all if None) of `key` at `location` (all if None); True if anything was removed."""
        with self._qlock:
            h = self._local.get(key) if location is None else None
            targets = [loc for loc, _ in h.locations] if h is not None else [location] if location is not None else []
            removed = self._local.remove(key, location, group_mask)
            if removed:
                for loc in targets:
                    self._enqueue(loc, "R", group_mask if group_mask is not None else ALL_GROUPS, (key,))
        self._wake()
        return removed

    def drop_location(self, location: Location) -> int:
        """Forget everything held at `location`; return how many blocks lost it."""
        with self._qlock:
            keys = self._local.keys_at(location) if location.node == self.node else frozenset()
            n = self._local.drop_location(location)
            self._enqueue(location, "R", ALL_GROUPS, sorted(keys))
        self._wake()
        return n

    def drop_node(self, node: str, below_epoch: int | None = None) -> int:
        """Forget a node's holdings (only those older than `below_epoch` if given); return blocks affected."""
        doomed = [loc for loc in self._local.holdings()
                  if loc.node == node and (below_epoch is None or loc.epoch < below_epoch)]  # fmt: skip
        return sum(self.drop_location(loc) for loc in doomed)

    def get(self, key: bytes) -> Holding | None:
        """Exact match: the holding of one key (this node's and its peers')."""
        return self._local.get(key)

    def match(self, keys: Sequence[bytes], layout: Layout, deadline: float | None = None) -> Match:
        """Longest-prefix match against the local copy of the cluster's index (no network)."""
        return self._local.match(keys, layout, deadline)

    def holdings(self) -> dict[Location, int]:
        """Blocks held per location, peers included."""
        return self._local.holdings()

    def keys_at(self, location: Location) -> frozenset[bytes]:
        """Keys held at one location."""
        return self._local.keys_at(location)

    def snapshot(self) -> IndexSnapshot:
        """A read-only, point-in-time copy."""
        return self._local.snapshot()

    @property
    def version(self) -> int:
        """Changes so far (local and followed)."""
        return self._local.version

    def __len__(self) -> int:
        return len(self._local)

    def __contains__(self, key: object) -> bool:
        return key in self._local

    def close(self) -> None:
        """Stop both threads and the client (this node's keys expire with its lease)."""
        for worker in (self.publisher, self.follower):
            if worker is not None:
                worker.stop()
        self._client.close()

    def __repr__(self) -> str:
        """URL, prefix and node."""
        return f"<ClusterIndex {self.url} prefix={self.prefix!r} node={self.node!r} shards={self.shards}>"


def _followed(shards: Any, follow: Any) -> tuple[int, ...]:
    """The shards a process follows, checked: `"all"`, `"none"` or a list of shard numbers."""
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards is a whole number from 1 to {MAX_SHARDS}, got {shards!r}")
    if follow == "all":
        return tuple(range(shards))
    if follow == "none":
        return ()
    if isinstance(follow, (list, tuple)) and follow and all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < shards for s in follow):  # fmt: skip
        return tuple(sorted(set(follow)))
    raise ValueError(f'follow is "all", "none" or a non-empty list of shards from 0 to {shards - 1}, got {follow!r}')


def _check(key: bytes) -> None:
    if len(key) != KEY_LEN:
        raise ValueError(f"block keys are {KEY_LEN} bytes, got {len(key)}")
