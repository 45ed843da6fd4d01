"""The cluster index's follower: applies peers' events, shard by shard, to this process's index.

It reads every live peer's event stream in each shard it follows (one `XREAD` over all of them), checks that
event numbers follow one another per (peer, shard) (a gap means a resync of that shard only; a new registration
or a restarted Redis a resync of every followed shard, each shard's holding read in chunks, several shards at
once), and drops a peer's entries as soon as its liveness key expires or the control plane no longer lists it at
that epoch. A process that follows only some shards (`follow`) holds only those shards' entries.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import redis

from nexuskv import Location, get_logger
from nexuskv_tier_redis._index_lua import node_keys, shard_keys, shard_of
from nexuskv_tier_redis._index_sync import KEY_LEN, Op, ops_of

__all__ = ["Follower"]

log = get_logger("nexuskv_tier_redis.index")

Held = dict[tuple[str, int], list[bytes]]  # (tier, mask) -> keys


class Follower:
    """Applies peers' events in the followed shards to the local index (one thread, reads of at most `poll_s`)."""

    def __init__(self, client: redis.Redis, prefix: str, node: str, local: Any,
                 members: Callable[[], Mapping[str, int] | None], *, poll_s: float = 0.1, shards: int = 1,
                 follow: Sequence[int] | None = None, resync_threads: int = 8) -> None:  # fmt: skip
        """Follow `follow` (all `shards` when None) into `local`, this process's index.

        `members()` gives the control plane's live nodes and epochs (None: unknown).
        """
        self.client, self.prefix, self.node, self.local = client, prefix, node, local
        self.members, self.poll_ms = members, max(1, int(poll_s * 1e3))
        self.shards = shards
        self.follow = tuple(sorted(set(follow))) if follow is not None else tuple(range(shards))
        self.peers: dict[str, tuple[str, dict[int, int]]] = {}  # node -> (ident followed, shard -> last event)
        self.stats = {"resyncs": 0, "shard_resyncs": 0, "gaps": 0, "events": 0, "dropped_peers": 0, "errors": 0,
                      "wrong_shards": 0, "misplaced_keys": 0}  # fmt: skip
        self._wrong_shards = ""  # the deployment's other shard count, while it differs from this process's
        self.synced = threading.Event()  # set after the first complete pass
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, min(resync_threads, len(self.follow))),
                                                           thread_name_prefix=f"nexuskv-index-resync-{node}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nexuskv-index-follow-{node}", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
                self.synced.set()
            except Exception as exc:  # Redis away, or a bug: peers the control plane dropped go all the same
                self.stats["errors"] += 1
                if isinstance(exc, redis.RedisError):
                    log.warning("index follow failed; peers' entries kept until their leases say otherwise",
                                node=self.node, error=repr(exc))  # fmt: skip
                else:
                    log.exception("index follower pass failed", node=self.node, error=repr(exc))
                try:
                    self._drop_unlisted()
                except Exception as again:
                    log.exception("dropping unlisted peers failed", node=self.node, error=repr(again))
                self._stop.wait(0.2)

    def _live(self) -> dict[str, str]:
        """Peers registered in Redis and (when the control plane is known) listed there at the same epoch."""
        nodes = sorted(n.decode() for n in self.client.smembers(f"{self.prefix}idx:nodes") if n.decode() != self.node)
        if not nodes:
            return {}
        idents = self.client.mget([node_keys(self.prefix, n)[0] for n in nodes])
        listed = self.members()
        out: dict[str, str] = {}
        for n, raw in zip(nodes, idents, strict=True):
            if raw is None:
                continue
            ident = raw.decode()
            if listed is not None and listed.get(n) != int(ident.partition(":")[0]):
                continue  # gone from the control plane, or registered under an epoch it no longer holds
            out[n] = ident
        return out

    def _deployment_agrees(self) -> bool:
        """Whether the deployment's shard count (`idx:shards`, when set) is this process's; if not, follow no one.

        A follower of another count would read shards under the wrong split: part of every peer's holding, and
        resyncs that keep what they should remove. It drops every peer and waits until the counts agree.
        """
        raw = self.client.get(node_keys(self.prefix, self.node)[3])
        theirs = raw.decode() if raw is not None else str(self.shards)
        if theirs == str(self.shards):
            self._wrong_shards = ""
            return True
        if theirs != self._wrong_shards:
            self._wrong_shards = theirs
            self.stats["wrong_shards"] += 1
            log.error("index follow stopped: the deployment's shard count differs from this process's", node=self.node,
                      deployment=theirs, configured=self.shards)  # fmt: skip
        for n in list(self.peers):
            self._drop(n, "the deployment's shard count differs from this process's")
        return False

    def _pass(self) -> None:
        if not self._deployment_agrees():
            self._stop.wait(self.poll_ms / 1e3)
            return
        live = self._live()
        for n in [n for n in self.peers if n not in live]:
            self._drop(n, "lease ended")
        for n, ident in live.items():
            if self.peers.get(n, ("", {}))[0] != ident:
                self._resync(n)
        if not self.peers:
            self._stop.wait(self.poll_ms / 1e3)
            return
        where: dict[str, tuple[str, int]] = {}
        streams: dict[str, str] = {}
        for n, (_, seqs) in self.peers.items():
            for s in self.follow:
                key = shard_keys(self.prefix, n, s, self.shards)[2]
                where[key], streams[key] = (n, s), f"0-{seqs.get(s, 0)}"
        got = self.client.xread(streams, block=self.poll_ms)  # type: ignore[arg-type]
        for stream, entries in got or ():
            n, s = where.get(stream.decode(), ("", 0))
            if n in self.peers:
                self._apply(n, s, entries)

    def _apply(self, n: str, s: int, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        ident, seqs = self.peers[n]
        last = seqs.get(s, 0)
        epoch = int(ident.partition(":")[0])
        for entry_id, fields in entries:
            seq = int(entry_id.decode().partition("-")[2])
            if seq != last + 1 or fields.get(b"ident", b"").decode() != ident:
                self.stats["gaps"] += 1
                log.info("index stream gap; resync of the shard", peer=n, shard=s, expected=last + 1, got=seq)
                self._resync(n, s)
                return
            self._ops(n, s, epoch, ops_of(fields))
            last = seq
            self.stats["events"] += 1
        seqs[s] = last

    def _in_shard(self, keys: list[bytes], s: int) -> list[bytes]:
        """`keys` that belong in shard `s`; the others (a writer of the shared Redis put them there) are counted."""
        if self.shards == 1:
            return keys
        mine = [k for k in keys if shard_of(k, self.shards) == s]
        if len(mine) != len(keys):
            self.stats["misplaced_keys"] += len(keys) - len(mine)
        return mine

    def _ops(self, n: str, s: int, epoch: int, ops: Iterable[Op]) -> None:
        for kind, tier, mask, blob in ops:
            loc = Location(tier, n, epoch)
            keys = self._in_shard([blob[i : i + KEY_LEN] for i in range(0, len(blob), KEY_LEN)], s)
            if kind == "S":
                self.local.insert_many(keys, loc, mask)
            else:
                for k in keys:
                    self.local.remove(k, loc, mask)

    def _read_held(self, n: str, s: int) -> tuple[Held, int]:
        """Peer `n`'s holding in shard `s`, grouped by (tier, mask), and how many entries it has."""
        grouped: Held = {}
        count = 0
        for field, mask in self.client.hscan_iter(shard_keys(self.prefix, n, s, self.shards)[0], count=10_000):
            grouped.setdefault((field[KEY_LEN:].decode(), int(mask)), []).append(field[:KEY_LEN])
            count += 1
        return grouped, count

    def _resync(self, n: str, shard: int | None = None) -> None:
        """Replace what is known of peer `n` (in `shard`, or every followed shard) with its holding in Redis.

        Each shard's event number is read first and following resumes after it: events made while the holding
        was read are replayed on top (setting and clearing bits again, in order, ends where the peer is); a
        registration that started over meanwhile has a new identity, which the next pass sees. A one-shard resync
        that finds a new identity resyncs every followed shard.
        """
        known = self.peers.get(n, ("", {}))
        which = self.follow if shard is None else (shard,)
        seq_keys = [shard_keys(self.prefix, n, s, self.shards)[1] for s in which]
        ident_raw, *seq_raw = self.client.mget([node_keys(self.prefix, n)[0], *seq_keys])
        if ident_raw is None:
            self.stats["resyncs"] += 1
            self._drop(n, "not registered")
            return
        ident = ident_raw.decode()
        if shard is not None and ident != known[0]:
            self._resync(n)
            return
        self.stats["resyncs" if shard is None else "shard_resyncs"] += 1
        epoch = int(ident.partition(":")[0])
        held = list(self._pool.map(lambda s: self._read_held(n, s), which))
        if shard is None:
            self.local.drop_node(n)
        else:
            self._forget(n, shard)
        for (grouped, _), s in zip(held, which, strict=True):
            for (tier, mask), keys in grouped.items():
                self.local.insert_many(self._in_shard(keys, s), Location(tier, n, epoch), mask)
        seqs = dict(known[1]) if shard is not None else {}
        seqs.update({s: int(raw or 0) for s, raw in zip(which, seq_raw, strict=True)})
        self.peers[n] = (ident, seqs)
        log.info("index resynced from the peer's holding", peer=n, ident=ident, shards=len(which),
                 blocks=sum(c for _, c in held))  # fmt: skip

    def _forget(self, n: str, s: int) -> None:
        """Remove peer `n`'s entries whose keys fall in shard `s`."""
        for loc in [loc for loc in self.local.holdings() if loc.node == n]:
            for key in [k for k in self.local.keys_at(loc) if shard_of(k, self.shards) == s]:
                self.local.remove(key, loc)

    def _drop(self, n: str, why: str) -> None:
        dropped = self.local.drop_node(n)
        self.peers.pop(n, None)
        self.stats["dropped_peers"] += 1
        log.info("peer's index entries dropped", peer=n, why=why, blocks=dropped)

    def _drop_unlisted(self) -> None:
        """Redis is away: peers the control plane no longer lists (at the epoch followed) go all the same."""
        listed = self.members()
        if listed is None:
            return
        for n, (ident, _) in list(self.peers.items()):
            if listed.get(n) != int(ident.partition(":")[0]):
                self._drop(n, "lease ended (seen by the control plane)")

    def stop(self) -> None:
        """Stop the thread and the resync pool."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
