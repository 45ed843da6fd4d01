"""The cluster index's publisher: this node's registration and holdings in Redis, fenced by its epoch.

The publisher registers the node under its fencing epoch, publishes a snapshot of what it holds, then every
change in batches, each to the stream of the shard its keys fall in (`shard_of`), and renews its keys from the
heartbeat. A write whose outcome is unknown (a timeout, Redis down) makes it start the registration over under
the same epoch and republish everything; a refused write (the registration expired, or Redis lost it) makes it
register again; a refused registration (the epoch is fenced out) makes it ask the control plane for a new epoch.
The follower of peers' streams is in `_index_follow`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

from nexuskv import get_logger
from nexuskv_tier_redis._index_lua import PUBLISH, REGISTER, RENEW, RESET, all_keys, node_keys, shard_keys, shard_of

__all__ = ["KEY_LEN", "Op", "Publisher", "by_shard", "ops_of", "publish_ops", "stale"]

log = get_logger("nexuskv_tier_redis.index")

KEY_LEN = 16  # block keys are 16 bytes
Op = tuple[str, str, int, bytes]  # (S or R, tier, group mask, concatenated keys)
_SHARDS_RETRY_S = 10.0  # a node refused for its shard count registers again this often (its changes are dropped)


def publish_ops(client: redis.Redis, prefix: str, node: str, ident: str, ops: Iterable[Op], ttl_ms: int,
                maxlen: int = 100_000, *, shard: int = 0, shards: int = 1) -> int:  # fmt: skip
    """Publish operations to `node`'s shard `shard` as identity `ident` (epoch:token); returns the event's number.

    The keys of `ops` must all fall in `shard` (`by_shard` splits operations). Raises `redis.ResponseError`
    starting with STALE when `ident` is not the node's live registration: the server refuses writes of a
    fenced-out epoch.
    """
    args: list[Any] = [ident, ttl_ms, maxlen, KEY_LEN]
    for kind, tier, mask, blob in ops:
        args += [kind, tier, mask, blob]
    keys = [node_keys(prefix, node)[0], *shard_keys(prefix, node, shard, shards)]
    return int(client.eval(PUBLISH, len(keys), *keys, *args))


def by_shard(ops: Iterable[Op], shards: int) -> dict[int, list[Op]]:
    """Operations split by the shard of each key, in order within every shard."""
    if shards <= 1:
        return {0: list(ops)}
    out: dict[int, list[Op]] = {}
    for kind, tier, mask, blob in ops:
        parts: dict[int, list[bytes]] = {}
        for i in range(0, len(blob), KEY_LEN):
            key = blob[i : i + KEY_LEN]
            parts.setdefault(shard_of(key, shards), []).append(key)
        for s, keys in parts.items():
            out.setdefault(s, []).append((kind, tier, mask, b"".join(keys)))
    return out


def stale(exc: BaseException) -> bool:
    """True for the server's refusal of a fenced-out writer."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("STALE")


class Publisher:
    """Keeps `node`'s registration and holdings in Redis (one thread)."""

    def __init__(self, client: redis.Redis, prefix: str, node: str, take: Callable[[], list[Op]],
                 snapshot: Callable[[], list[Op]], *, batch_keys: int = 4096, maxlen: int = 100_000,
                 shards: int = 1) -> None:  # fmt: skip
        """`take()` returns the queued changes; `snapshot()` clears the queue and returns all this node holds."""
        self.client, self.prefix, self.node, self.shards = client, prefix, node, shards
        self._keys = all_keys(prefix, node, shards)
        self._take, self._snapshot = take, snapshot
        self.batch_keys, self.maxlen = batch_keys, maxlen
        self.epoch = 0  # the membership's epoch, and when its lease was renewed
        self._renewed_at = 0.0
        self._ttl_s = 0.0
        self.ident = ""  # the live registration, "" when there is none
        self._fenced_epoch = -1  # an epoch the server refused: wait for a new one
        self._shards_refused_at = -1e9  # when the deployment last refused this node's shard count
        self._registering = 0  # the epoch of the registration being attempted
        self._asked_at = -1e9
        self._reset = False  # a write's outcome is unknown: start the registration over and publish all again
        self._renew_due = False
        self.wake = threading.Event()
        self.stats = {"registrations": 0, "resets": 0, "events": 0, "refused_stale": 0, "refused_shards": 0,
                      "errors": 0}  # fmt: skip
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
        if isinstance(exc, redis.ResponseError) and str(exc).startswith("SHARDS"):  # configuration: no retry helps
            self.stats["refused_shards"] += 1
            log.error("index registration refused: this node's shard count differs from the deployment's; nothing "
                      "of this node is published until they agree (tried again every "
                      f"{_SHARDS_RETRY_S:g} s)", node=self.node, error=str(exc))  # fmt: skip
            self.ident = ""
            self._shards_refused_at = time.monotonic()
        elif stale(exc) and "STALE epoch" in str(exc):  # registering: this epoch is fenced out for good
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
        if time.monotonic() - self._shards_refused_at < _SHARDS_RETRY_S:
            self._take()  # refused for its shard count: nothing is kept for a registration that may never come
            return
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
            self.client.eval(RENEW, len(self._keys), *self._keys, self.ident, self._ttl_ms(), self.shards)

    def _register(self) -> None:
        token = os.urandom(6).hex()
        self._registering = self.epoch
        self.client.eval(REGISTER, len(self._keys), *self._keys, self.node, self.epoch, token, self._ttl_ms(),
                         self.shards)  # fmt: skip
        self.ident, self._reset = f"{self.epoch}:{token}", False
        self._renew_due = False
        self.stats["registrations"] += 1
        self._publish_snapshot("registered in the cluster index")

    def _start_over(self) -> None:
        """After a write of unknown outcome: a new token under the same epoch, and everything published again."""
        token = os.urandom(6).hex()
        self.ident = str(self.client.eval(RESET, len(self._keys), *self._keys, self.ident, token,
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
        """Publish `ops`, each shard's in order, in events of at most `batch_keys` keys."""
        for shard, shard_ops in sorted(by_shard(ops, self.shards).items()):
            batch: list[Op] = []
            size = 0
            for kind, tier, mask, blob in shard_ops:
                for i in range(0, len(blob), self.batch_keys * KEY_LEN):
                    part = blob[i : i + self.batch_keys * KEY_LEN]
                    batch.append((kind, tier, mask, part))
                    size += len(part)
                    if size >= self.batch_keys * KEY_LEN:
                        self._publish(batch, shard)
                        batch, size = [], 0
            if batch:
                self._publish(batch, shard)

    def _publish(self, batch: list[Op], shard: int) -> None:
        self._renew()  # a long snapshot must not let the registration lapse
        publish_ops(self.client, self.prefix, self.node, self.ident, batch, max(self._ttl_ms(), 1), self.maxlen,
                    shard=shard, shards=self.shards)  # fmt: skip
        self.stats["events"] += 1

    def stop(self) -> None:
        """Stop the thread (the node's keys expire with its lease)."""
        self._stop.set()
        self.wake.set()
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
