"""Follow one vLLM engine's KV event stream (ZMQ) into its `EngineResidency`, resyncing through the replay endpoint.

vLLM's `ZmqEventPublisher` (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`) sends
`(topic, seq, payload)` on a PUB socket and answers replay requests on a ROUTER socket: send `("", start_seq)`,
receive `("", topic, seq, payload)` for every buffered batch from `start_seq`, then `("", "", -1, "")` (vLLM
before 0.32 left the topic out; both are read). The subscriber:

- at start, asks the replay endpoint for everything buffered (the engine may have run before it), then follows
  the live stream;
- on a gap, asks for the missing batches; when the replay cannot fill it (no replay endpoint, a timeout, the buffer
  no longer reaches back), forgets the engine's whole cache: a missed `BlockRemoved` would leave a block claimed
  that is gone, and a route priced on it would be wrong;
- on a restart (the numbers go back with other bytes), forgets the engine's cache and starts over;
- drops a batch that does not decode (`wire.WireError`), and forgets the engine's cache too: what it said is
  unknown.

Zero trust: vLLM's stream is not authenticated, so the subscriber reaches it only over `ipc://` (a socket file the
deployment's permissions guard) or loopback TCP unless `allow_remote=True` (a private network the operator
vouches for). Whatever arrives is bounded (messages up to `max_message_bytes`, a replay up to `max_replay`
batches and `max_replay_bytes`, the residency up to its `max_blocks`) and can only say which prefixes an engine
holds in its own cache: a route priced on it may be wrong, no state served can be (`RESIDENT_TIER` is never a
plan's source).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any

from nexuskv import ConfigError, get_logger
from nexuskv_vllm_events.ordering import Ordering, Position
from nexuskv_vllm_events.residency import EngineResidency
from nexuskv_vllm_events.wire import WireError, decode, seq_of

__all__ = ["KVEventSubscriber"]

log = get_logger("nexuskv.vllm_events")

_LOCAL = re.compile(r"^(ipc://.+|tcp://(127\.0\.0\.1|localhost|\[::1\]):\d+)$")
END_SEQ = -1  # vLLM's end-of-replay marker
COUNTS = ("received", "applied", "gaps", "replays", "replayed", "replay_failures", "lost", "restarts", "duplicates",
          "malformed", "other_topic", "disconnects")  # fmt: skip
"""The stream's counters in `KVEventSubscriber.stats` (batches, except `replays`: requests to the replay endpoint)."""


def check_endpoint(endpoint: str, *, allow_remote: bool, what: str = "endpoint") -> str:
    """`endpoint` when it is ipc:// or loopback TCP (or `allow_remote`); else a `ConfigError` saying why."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("ipc://", "tcp://")):
        raise ConfigError(f"KVEventSubscriber {what} {endpoint!r}: ipc://PATH or tcp://HOST:PORT expected")
    if not allow_remote and not _LOCAL.match(endpoint):
        raise ConfigError(f"KVEventSubscriber {what} {endpoint!r}: vLLM's event stream is not authenticated; "
                          "use ipc:// or loopback TCP, or pass allow_remote=True for a private network")  # fmt: skip
    return endpoint


class KVEventSubscriber:
    """One engine's KV event stream, applied to its residency on a background thread (`start` / `close`)."""

    def __init__(self, residency: EngineResidency, *, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", bind: bool = False, allow_remote: bool = False,
                 max_message_bytes: int = 8 << 20, replay_timeout_s: float = 2.0, max_replay: int = 100_000,
                 max_replay_bytes: int = 256 << 20) -> None:  # fmt: skip
        """Follow the engine at `endpoint`, applying what it says to `residency`.

        `endpoint` is the engine's PUB address (connected to), or with `bind=True` the address this binds for an
        engine whose publisher connects (vLLM connects when its endpoint has no `*`).
        """
        self.residency = residency
        self.endpoint = check_endpoint(endpoint, allow_remote=allow_remote)
        self.replay_endpoint = (check_endpoint(replay_endpoint, allow_remote=allow_remote, what="replay_endpoint")
                                if replay_endpoint else None)  # fmt: skip
        self.topic = topic.encode()
        self.bind = bind
        self.max_message_bytes = max_message_bytes
        self.replay_timeout_s = replay_timeout_s
        self.max_replay = max_replay
        self.max_replay_bytes = max_replay_bytes
        self._order = Ordering()
        self._counts = dict.fromkeys(COUNTS, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 10.0) -> KVEventSubscriber:
        """Connect (or bind), sync from the replay endpoint, and follow the stream; returns once subscribed."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("KVEventSubscriber already started")
            name = f"nexuskv-kv-events-{self.residency.node}"
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.close()
            raise ConfigError(f"KVEventSubscriber {self.endpoint}: could not subscribe: {self._error!r}")
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop following, and forget what the engine holds (nothing keeps it current any more).

        The thread stops between batches (a replay in progress too) and clears the residency as it ends; this
        clears it as well, so nothing is claimed once `close` returns, even if the thread is slow to end.
        """
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.residency.clear()

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """The stream's counters, the residency's, `next_seq` (the number expected next) and `alive`."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["next_seq"] = self._order.next
            out["alive"] = self._thread is not None and self._thread.is_alive()
        return {**out, **self.residency.stats()}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # ------------------------------------------------------------------------------------------ the thread

    def _open(self) -> tuple[Any, Any]:
        """The SUB socket, subscribed, and a monitor socket reporting its disconnects."""
        import zmq

        sub = zmq.Context.instance().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            (sub.bind if self.bind else sub.connect)(self.endpoint)
        except zmq.ZMQError:
            sub.close(0)
            raise
        return sub, monitor

    def _run(self) -> None:
        import zmq

        try:
            sub, monitor = self._open()
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        try:
            if self.replay_endpoint:
                self._resume()  # what the engine published before this subscribed
            self._ready.set()
            poller = _poller(sub, monitor)
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    monitor.recv_multipart()
                    sub, monitor = self._reconnect(sub, monitor)
                    poller = _poller(sub, monitor)
                elif sub in ready:
                    self._live(sub.recv_multipart(zmq.NOBLOCK))
        except Exception as exc:  # a socket that cannot be opened again: logged, visible in stats()["alive"]
            self._error = exc
            log.exception("KV event subscriber stopped", node=self.residency.node, endpoint=self.endpoint)
        finally:
            _close(sub, monitor)
            self.residency.clear()  # nothing keeps it current any more
            self._ready.set()

    def _reconnect(self, sub: Any, monitor: Any) -> tuple[Any, Any]:
        """The connection dropped (an oversized message, the engine went away): whatever was in flight is unknown.

        ZMQ does not reconnect after a message over `max_message_bytes`, so a connecting socket is opened again (a
        bound one keeps listening); then the replay says what was missed, or the engine's cache is forgotten.
        """
        self._count("disconnects")
        log.warning("KV event stream disconnected", node=self.residency.node, endpoint=self.endpoint)
        if not self.bind:  # a bound socket keeps listening (the peer reconnects), and re-binding at once can fail
            _close(sub, monitor)
            sub, monitor = self._open()
        if self._order.next is not None and not self._resume():
            self._lose("disconnected, and no replay says what was missed")
        return sub, monitor

    def _live(self, frames: list[bytes]) -> None:
        self._count("received")
        if len(frames) != 3:
            return self._malformed(f"{len(frames)} frames (topic, seq, payload expected)")
        topic, seq_frame, payload = frames
        if topic != self.topic:  # SUB filters by prefix; the topic must be exact
            return self._count("other_topic")
        try:
            seq = seq_of(seq_frame)
        except WireError as exc:
            return self._malformed(str(exc))
        position = self._order.classify(seq, payload)
        if position is Position.GAP:
            self._count("gaps")
            self._resume()
            position = self._order.classify(seq, payload)
            if position is Position.GAP:
                self._lose(f"batches {self._order.next}..{seq - 1} could not be replayed")
                position = Position.NEXT  # what comes after the gap is known again
        if position is Position.RESTART:
            self._count("restarts")
            log.info("engine restarted: its cache is forgotten", node=self.residency.node, seq=seq,
                     expected=self._order.next)  # fmt: skip
            self._forget()
            self._resume()  # the new engine's batches before this one
            position = self._order.classify(seq, payload)
        if position is Position.DUPLICATE:  # the replay brought it
            return self._count("duplicates")
        if position is Position.NEXT:
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        try:
            self.residency.apply(decode(payload))
        except WireError as exc:
            self._malformed(f"batch {seq}: {exc}")
        except Exception as exc:  # whatever a batch holds, the subscriber goes on (the cache is forgotten)
            log.exception("KV event batch failed", node=self.residency.node, seq=seq)
            self._malformed(f"batch {seq}: {type(exc).__name__}: {exc}")
        else:
            self._count("applied")
        self._order.applied(seq, payload, replayed=replayed)  # its number is used either way: no gap to fill

    def _resume(self) -> bool:
        """Catch up from the replay endpoint, proving that its numbering continues the batches applied so far.

        The replay starts at the last batch applied. When the publisher no longer has it, or has other bytes under
        its number (the engine restarted), continuity cannot be shown: the cache is forgotten and the publisher's
        whole buffer replayed from 0. False when the replay endpoint does not answer (or there is none).
        """
        last = self._order.last
        got = self._replay(last[0] if last else 0) if self.replay_endpoint else None
        if got is None:
            return False
        if last is not None and not (got and self._order.continues(*got[0])):
            self._lose(f"the replay does not continue batch {last[0]}")
            self._order.reset()
            got = self._replay(0)
            if got is None:
                return False
        for seq, payload in got:
            if self._stop.is_set():
                break
            expected = self._order.next
            if expected is not None and seq < expected:
                continue
            if expected is not None and seq > expected:
                self._lose(f"the replay skips from {expected} to {seq}")
            self._apply(seq, payload, replayed=True)
        return True

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered batches from `start`, in order; None when it cannot answer in time or well."""
        import zmq

        self._count("replays")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", max(start, 0).to_bytes(8, "big")])
            end = time.monotonic() + self.replay_timeout_s
            out: list[tuple[int, bytes]] = []
            size = 0
            while True:
                left = end - time.monotonic()
                if left <= 0 or not sock.poll(left * 1000):
                    return self._replay_failed(f"no end of replay in {self.replay_timeout_s:g} s")
                frames = sock.recv_multipart()
                if not 3 <= len(frames) <= 4 or frames[0] != b"":
                    return self._replay_failed(f"a replay message of {len(frames)} frames")
                if len(frames) == 4:  # vLLM 0.32: ("", topic, seq, payload); the end marker's topic is empty
                    topic, frames = frames[1], [b"", *frames[2:]]
                    if topic not in (self.topic, b""):
                        return self._replay_failed(f"a replayed batch on topic {topic[:64]!r}")
                seq = seq_of(frames[1])
                if seq == END_SEQ:
                    self._count("replayed", len(out))
                    return out
                size += len(frames[2])
                if seq < start or (out and seq <= out[-1][0]) or len(out) >= self.max_replay or \
                        size > self.max_replay_bytes:  # fmt: skip
                    return self._replay_failed(f"replayed batch {seq} out of order or over the bounds")
                out.append((seq, frames[2]))
        except (zmq.ZMQError, WireError) as exc:
            return self._replay_failed(str(exc))
        finally:
            sock.close(0)

    def _replay_failed(self, why: str) -> None:
        self._count("replay_failures")
        log.warning("KV event replay failed", node=self.residency.node, endpoint=self.replay_endpoint, why=why)
        return None

    def _malformed(self, why: str) -> None:
        self._count("malformed")
        log.warning("malformed KV event message: the engine's cache is forgotten", node=self.residency.node,
                    why=why)  # fmt: skip
        self.residency.clear()

    def _lose(self, why: str) -> None:
        self._count("lost")
        log.warning("KV events lost: the engine's cache is forgotten", node=self.residency.node, why=why)
        self.residency.clear()

    def _forget(self) -> None:
        self._order.reset()
        self.residency.clear()


def _poller(*sockets: Any) -> Any:
    import zmq

    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    return poller


def _close(sub: Any, monitor: Any) -> None:
    """Close a SUB socket and its monitor, whatever state they are in."""
    import zmq

    for step in (sub.disable_monitor, lambda: monitor.close(0), lambda: sub.close(0)):
        with contextlib.suppress(zmq.ZMQError):
            step()
