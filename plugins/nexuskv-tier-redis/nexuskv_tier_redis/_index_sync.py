"""The cluster index's two background workers: the publisher of this node's holdings, the follower of its peers'.

The publisher registers the node under its fencing epoch, publishes a snapshot of what it holds, then every
change in batches, and renews its keys from the heartbeat. A write whose outcome is unknown (a timeout, Redis
down) makes it start the registration over under the same epoch and republish everything; a refused write
(the registration expired, or Redis lost it) makes it register again; a refused registration (the epoch is
fenced out) makes it ask the control plane for a new epoch. The follower reads every peer's event stream,
checks that event numbers follow one another (a gap, a new registration or a restarted Redis means a resync from
the peer's holding, read in chunks), and drops a peer's entries as soon as its liveness key expires or the
control plane no longer lists it at that epoch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

from nexuskv import Location, get_logger
from nexuskv_tier_redis._index_lua import PUBLISH, REGISTER, RENEW, RESET, keys_of

__all__ = ["KEY_LEN", "Follower", "Op", "Publisher", "publish_ops"]

log = get_logger("nexuskv_tier_redis.index")

KEY_LEN = 16  # block keys are 16 bytes
Op = tuple[str, str, int, bytes]  # (S or R, tier, group mask, concatenated keys)


def publish_ops(client: redis.Redis, prefix: str, node: str, ident: str, ops: Iterable[Op], ttl_ms: int,
                maxlen: int = 100_000) -> int:  # fmt: skip
    """Publish operations as `node` with identity `ident` (epoch:token); returns the event's number.

    Raises `redis.ResponseError` starting with STALE when `ident` is not the node's live registration: the
    server refuses writes of a fenced-out epoch.
    """
    args: list[Any] = [ident, ttl_ms, maxlen, KEY_LEN]
    for kind, tier, mask, blob in ops:
        args += [kind, tier, mask, blob]
    return int(client.eval(PUBLISH, 6, *keys_of(prefix, node), *args))


def stale(exc: BaseException) -> bool:
    """True for the server's refusal of a fenced-out writer."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("STALE")


class Publisher:
    """Keeps `node`'s registration and holdings in Redis (one thread)."""

    def __init__(self, client: redis.Redis, prefix: str, node: str, take: Callable[[], list[Op]],
                 snapshot: Callable[[], list[Op]], *, batch_keys: int = 4096,
                 maxlen: int = 100_000) -> None:  # fmt: skip
        """`take()` returns the queued changes; `snapshot()` clears the queue and returns all this node holds."""
        self.client, self.prefix, self.node = client, prefix, node
        self._take, self._snapshot = take, snapshot
        self.batch_keys, self.maxlen = batch_keys, maxlen
        self.epoch = 0  # the membership's epoch, and when its lease was renewed
        self._renewed_at = 0.0
        self._ttl_s = 0.0
        self.ident = ""  # the live registration, "" when there is none
        self._fenced_epoch = -1  # an epoch the server refused: wait for a new one
        self._registering = 0  # the epoch of the registration being attempted
        self._asked_at = -1e9
        self._reset = False  # a write's outcome is unknown: start the registration over and publish all again
        self._renew_due = False
        self.wake = threading.Event()
        self.stats = {"registrations": 0, "resets": 0, "events": 0, "refused_stale": 0, "errors": 0}
        self.on_fenced: Callable[[], None] | None = None  # asks the control plane for a new epoch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nexuskv-index-pub-{node}", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def beat(self, epoch: int, renewed_at: float, ttl_s: float) -> None:
        """The membership renewed its lease (or joined with `epoch`): renew or register on the thread."""
        self.epoch, self._renewed_at, self._ttl_s = epoch, renewed_at, ttl_s
        self._renew_due = True
        self.wake.set()

    def _ttl_ms(self) -> int:
        """What is left of the lease: the node's keys never outlive it."""
        return int((self._renewed_at + self._ttl_s - time.monotonic()) * 1e3)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.wake.wait(0.05)
            self.wake.clear()
            try:
                self._step()
            except redis.RedisError as exc:
                self._failed(exc)
            except Exception as exc:  # a bug must not end publishing silently: log, start over
                log.exception("index publisher step failed", node=self.node, error=repr(exc))
                self.ident, self._reset = "", False
                self._stop.wait(0.5)

    def _failed(self, exc: redis.RedisError) -> None:
        self.stats["errors"] += 1
        if stale(exc) and "STALE epoch" in str(exc):  # registering: this epoch is fenced out for good
            self.stats["refused_stale"] += 1
            self._fenced_epoch = self._registering
            log.warning("index registration refused: this node's epoch is fenced out; asking for a new one",
                        node=self.node, epoch=self._registering, error=str(exc))  # fmt: skip
            self._ask_for_epoch()
            self.ident = ""
        elif stale(exc):  # the live registration is not ours (expired, or Redis lost it): register again
            self.stats["refused_stale"] += 1
            log.warning("index write refused: registration not live", node=self.node, ident=self.ident,
                        error=str(exc))  # fmt: skip
            self.ident = ""
        else:  # unknown outcome (a timeout, a dropped connection): the same registration publishes all again
            log.warning("index publish failed; will publish everything again", node=self.node, error=repr(exc))
            self._reset = bool(self.ident)
            self._stop.wait(0.1)

    def _ask_for_epoch(self) -> None:
        """Ask the control plane for a new epoch (at most once a second while this one stays fenced)."""
        now = time.monotonic()
        if self.on_fenced is not None and now - self._asked_at >= 1.0:
            self._asked_at = now
            self.on_fenced()

    def _step(self) -> None:
        if self.epoch == self._fenced_epoch:
            self._ask_for_epoch()  # the request may have been lost with a failed join
        if self.epoch <= 0 or self.epoch == self._fenced_epoch or self._ttl_ms() <= 0:
            self._take()  # nothing may be written now; the next registration's snapshot has it all
            return
        if not self.ident or int(self.ident.partition(":")[0]) != self.epoch:
            self._register()
            return
        if self._reset:
            self._start_over()
            return
        self._renew()
        self._send(self._take())

    def _renew(self) -> None:
        if self._renew_due and self._ttl_ms() > 0:
            self._renew_due = False
            self.client.eval(RENEW, 6, *keys_of(self.prefix, self.node), self.ident, self._ttl_ms())

    def _register(self) -> None:
        token = os.urandom(6).hex()
        self._registering = self.epoch
        self.client.eval(REGISTER, 6, *keys_of(self.prefix, self.node), self.node, self.epoch, token, self._ttl_ms())
        self.ident, self._reset = f"{self.epoch}:{token}", False
        self._renew_due = False
        self.stats["registrations"] += 1
        self._publish_snapshot("registered in the cluster index")

    def _start_over(self) -> None:
        """After a write of unknown outcome: a new token under the same epoch, and everything published again."""
        token = os.urandom(6).hex()
        self.ident = str(self.client.eval(RESET, 6, *keys_of(self.prefix, self.node), self.ident, token,
                                          self._ttl_ms()).decode())  # fmt: skip
        self._reset = False
        self._renew_due = False
        self.stats["resets"] += 1
        self._publish_snapshot("index registration started over")

    def _publish_snapshot(self, event: str) -> None:
        ops = self._snapshot()
        self._send(ops)
        log.info(event, node=self.node, ident=self.ident, blocks=sum(len(o[3]) // KEY_LEN for o in ops))

    def _send(self, ops: list[Op]) -> None:
        batch: list[Op] = []
        size = 0
        for kind, tier, mask, blob in ops:
            for i in range(0, len(blob), self.batch_keys * KEY_LEN):
                part = blob[i : i + self.batch_keys * KEY_LEN]
                batch.append((kind, tier, mask, part))
                size += len(part)
                if size >= self.batch_keys * KEY_LEN:
                    self._publish(batch)
                    batch, size = [], 0
        if batch:
            self._publish(batch)

    def _publish(self, batch: list[Op]) -> None:
        self._renew()  # a long snapshot must not let the registration lapse
        publish_ops(self.client, self.prefix, self.node, self.ident, batch, max(self._ttl_ms(), 1), self.maxlen)
        self.stats["events"] += 1

    def stop(self) -> None:
        """Stop the thread (the node's keys expire with its lease)."""
        self._stop.set()
        self.wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


class Follower:
    """Applies every peer's events to the local index (one thread, blocking reads of at most `poll_s`)."""

    def __init__(self, client: redis.Redis, prefix: str, node: str, local: Any,
                 members: Callable[[], Mapping[str, int] | None], *, poll_s: float = 0.1) -> None:  # fmt: skip
        """`local` is the node's own index; `members()` the control plane's live nodes and epochs (None: unknown)."""
        self.client, self.prefix, self.node, self.local = client, prefix, node, local
        self.members, self.poll_ms = members, max(1, int(poll_s * 1e3))
        self.peers: dict[str, tuple[str, int]] = {}  # node -> (ident followed, last event number)
        self.stats = {"resyncs": 0, "gaps": 0, "events": 0, "dropped_peers": 0, "errors": 0}
        self.synced = threading.Event()  # set after the first complete pass
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
        idents = self.client.mget([keys_of(self.prefix, n)[0] for n in nodes])
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

    def _pass(self) -> None:
        live = self._live()
        for n in [n for n in self.peers if n not in live]:
            self._drop(n, "lease ended")
        for n, ident in live.items():
            if self.peers.get(n, ("", 0))[0] != ident:
                self._resync(n)
        if not self.peers:
            self._stop.wait(self.poll_ms / 1e3)
            return
        node_of = {keys_of(self.prefix, n)[4]: n for n in self.peers}
        streams = {key: f"0-{self.peers[n][1]}" for key, n in node_of.items()}
        got = self.client.xread(streams, block=self.poll_ms)  # type: ignore[arg-type]
        for stream, entries in got or ():
            n = node_of.get(stream.decode(), "")
            if n in self.peers:
                self._apply(n, entries)

    def _apply(self, n: str, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        ident, last = self.peers[n]
        epoch = int(ident.partition(":")[0])
        for entry_id, fields in entries:
            seq = int(entry_id.decode().partition("-")[2])
            if seq != last + 1 or fields.get(b"ident", b"").decode() != ident:
                self.stats["gaps"] += 1
                log.info("index stream gap; resync", peer=n, expected=last + 1, got=seq)
                self._resync(n)
                return
            self._ops(n, epoch, ops_of(fields))
            last = seq
            self.stats["events"] += 1
        self.peers[n] = (ident, last)

    def _ops(self, n: str, epoch: int, ops: Iterable[Op]) -> None:
        for kind, tier, mask, blob in ops:
            loc = Location(tier, n, epoch)
            keys = [blob[i : i + KEY_LEN] for i in range(0, len(blob), KEY_LEN)]
            if kind == "S":
                self.local.insert_many(keys, loc, mask)
            else:
                for k in keys:
                    self.local.remove(k, loc, mask)

    def _resync(self, n: str) -> None:
        """Replace everything known of peer `n` with its holding in Redis, read in chunks.

        The event number is read first and following resumes after it: events made while the holding was read
        are replayed on top (setting and clearing bits again, in order, ends where the peer is); a registration
        that started over meanwhile has a new identity, which the next pass sees.
        """
        k = keys_of(self.prefix, n)
        ident_raw, seq_raw = self.client.mget([k[0], k[3]])
        self.stats["resyncs"] += 1
        if ident_raw is None:
            self._drop(n, "not registered")
            return
        ident = ident_raw.decode()
        epoch = int(ident.partition(":")[0])
        grouped: dict[tuple[str, int], list[bytes]] = {}
        count = 0
        for field, mask in self.client.hscan_iter(k[2], count=10_000):
            grouped.setdefault((field[KEY_LEN:].decode(), int(mask)), []).append(field[:KEY_LEN])
            count += 1
        self.local.drop_node(n)
        for (tier, mask), keys in grouped.items():
            self.local.insert_many(keys, Location(tier, n, epoch), mask)
        self.peers[n] = (ident, int(seq_raw or 0))
        log.info("index resynced from the peer's holding", peer=n, ident=ident, blocks=count)

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
        """Stop the thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)


def ops_of(fields: Mapping[bytes, bytes]) -> list[Op]:
    """An event's operations, in the order they were made (fields `<n>:<kind>:<mask>:<tier>` -> keys)."""
    out: list[tuple[int, Op]] = []
    for head, blob in fields.items():
        if head in (b"seq", b"ident"):
            continue
        n, kind, mask, tier = head.decode().split(":", 3)
        out.append((int(n), (kind, tier, int(mask), blob)))
    return [op for _, op in sorted(out)]
