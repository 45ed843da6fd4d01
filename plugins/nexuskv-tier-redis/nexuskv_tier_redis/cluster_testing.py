"""A real cluster for tests and benchmarks: etcd, Redis and node processes on one machine, and a shaped link.

`Cluster` starts etcd and Redis (on 127.0.0.1 unless told otherwise) and one process per node
(`_cluster_node`), each a kernel on the etcd control plane, the Redis cluster index and the TCP transport, and
drives them over a local pipe: `call(node, "serve", tokens=...)`. Nodes can be killed (SIGKILL), frozen
(SIGSTOP) and woken; etcd and Redis can be killed and restarted. `NetNS` puts a node in its own network
namespace behind a veth pair whose outgoing rate `tc ... tbf` limits (needs root; `NetNS.available()` says).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Listener
from typing import Any

from nexuskv.testing.netns import NetNS

__all__ = ["Cluster", "NetNS", "NodeError"]


class NodeError(RuntimeError):
    """A node answered a command with an error, or did not answer in time."""


class Cluster:
    """etcd, Redis and node processes (see the module docstring); a context manager that stops everything."""

    def __init__(self, nodes: Sequence[str] = ("a", "b", "c"), *, engine: str = "synthetic",
                 profile: str | None = None, lease_ttl_s: float = 1.0, host: str = "127.0.0.1",
                 links: dict[str, Any] | None = None, start_timeout_s: float = 120.0,
                 tls: dict[str, str] | None = None) -> None:  # fmt: skip
        from nexuskv_etcd.testing import EtcdServer
        from nexuskv_tier_redis.testing import RedisServer

        self.host, self.engine, self.profile, self.lease_ttl_s = host, engine, profile, lease_ttl_s
        self.links, self.start_timeout_s, self.tls = links, start_timeout_s, tls
        self.etcd = EtcdServer(host=host)
        self.redis = RedisServer(host=host)
        self._authkey = os.urandom(16).hex()
        self._listener = Listener((host, 0), authkey=self._authkey.encode())
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.conns: dict[str, Connection] = {}
        self._locks: dict[str, threading.Lock] = {}
        try:
            for n in nodes:
                self.start_node(n)
        except BaseException:
            self.close()
            raise

    def spec(self, node: str, **extra: Any) -> dict[str, Any]:
        """What a node process is told: its name, the servers, the harness, the engine."""
        addr = self._listener.address
        spec = {"node": node, "etcd": self.etcd.endpoint, "redis": self.redis.url, "engine": self.engine,
                "profile": self.profile, "lease_ttl_s": self.lease_ttl_s, "tcp_host": self.host,
                "harness_host": addr[0], "harness_port": addr[1], "authkey": self._authkey}  # fmt: skip
        if self.links is not None:
            spec["links"] = self.links
        if self.tls is not None:  # the tcp transport's tls_cert / tls_key / tls_ca: every peer link in mutual TLS
            spec["tls"] = self.tls
        spec.update(extra)
        return spec

    def start_node(self, node: str, *, prefix: Sequence[str] = (), **extra: Any) -> dict[str, Any]:
        """Start a node process (inside `prefix`, e.g. `NetNS.prefix()`) and wait until its kernel is up."""
        spec = self.spec(node, **extra)
        env = {**os.environ, "NEXUSKV_LOG_LEVEL": os.environ.get("NEXUSKV_LOG_LEVEL", "warning")}
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "nexuskv_tier_redis._cluster_node", json.dumps(spec)],
                                env=env)  # fmt: skip
        got: queue.Queue[Connection] = queue.Queue()
        threading.Thread(target=lambda: got.put(self._listener.accept()), daemon=True).start()
        try:
            conn = got.get(timeout=self.start_timeout_s)
        except queue.Empty:
            proc.kill()
            raise NodeError(f"node {node} did not connect within {self.start_timeout_s} s") from None
        self.procs[node], self.conns[node], self._locks[node] = proc, conn, threading.Lock()
        return self._answer(node, conn, self.start_timeout_s)  # type: ignore[no-any-return]

    def _answer(self, node: str, conn: Connection, timeout_s: float) -> Any:
        if not conn.poll(timeout_s):
            raise NodeError(f"node {node} did not answer within {timeout_s} s")
        status, result = conn.recv()
        if status != "ok":
            raise NodeError(f"node {node}: {result}")
        return result

    def call(self, node: str, cmd: str, timeout_s: float = 60.0, **args: Any) -> Any:
        """Run a command on a node; its result, or `NodeError` (an error there, no answer, a dead node)."""
        with self._locks[node]:
            conn = self.conns[node]
            try:
                conn.send((cmd, args))
                return self._answer(node, conn, timeout_s)
            except (OSError, EOFError) as exc:
                raise NodeError(f"node {node} is unreachable: {exc!r}") from None

    def kill(self, node: str) -> None:
        """SIGKILL a node process (a crash: no goodbye, its lease and index keys just stop being renewed)."""
        proc = self.procs.pop(node)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.conns.pop(node).close()

    def pause(self, node: str) -> None:
        """SIGSTOP a node (frozen: no heartbeat, no writes)."""
        self.procs[node].send_signal(signal.SIGSTOP)

    def resume(self, node: str) -> None:
        """SIGCONT a frozen node."""
        self.procs[node].send_signal(signal.SIGCONT)

    @staticmethod
    def wait_until(predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.02) -> float | None:
        """Seconds until `predicate()` was true (checked every `every_s`), or None after `timeout_s`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if predicate():
                return time.monotonic() - t0
            time.sleep(every_s)
        return None

    def close(self) -> None:
        """Stop the nodes (politely, then not), etcd and Redis."""
        for node in list(self.procs):
            proc = self.procs.pop(node)
            proc.send_signal(signal.SIGCONT)
            conn = self.conns.pop(node, None)
            try:
                if conn is not None:
                    conn.send(("quit", {}))
                    conn.poll(5.0)
            except (OSError, EOFError):
                pass
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._listener.close()
        self.redis.stop()
        self.etcd.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shaped_link_flip(*, rate: str = "16mbit", engine: str = "reference", profile: str | None = None,
                     tokens: Sequence[int], suffix: Callable[[int], list[int]], timeout_s: float = 60.0,
                     log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:  # fmt: skip
    """Node `far` in a namespace behind a tbf-shaped veth holds a prompt; node `near` serves it again and again.

    Returns the actions `near` took in each phase (`fast`, `slowed` to `rate`, `recovered`) and `flip`: 1 when
    it loaded from `far` while the link was fast, recomputed once the link was slowed, and loaded again after it
    recovered, all decided by what `near` measured (nobody sets `bandwidth_scale`). `near` keeps nothing it
    loads or computes, so every request asks the same question of the link.
    """
    ns = NetNS()
    phases: dict[str, list[str]] = {"fast": [], "slowed": [], "recovered": []}
    try:
        # A longer lease: far's heartbeats share the shaped link with the payloads it sends.
        with Cluster((), engine=engine, profile=profile, host=ns.host_ip, lease_ttl_s=3.0) as cluster:
            cluster.start_node("far", prefix=ns.prefix(), tcp_host=ns.ns_ip)
            cluster.start_node("near", promote_on_hit=False, commit=False)
            cluster.call("far", "serve", tokens=list(tokens) + suffix(0))
            cluster.call("far", "flush")
            n = 0

            def serve() -> str:
                nonlocal n
                n += 1
                out = cluster.call("near", "serve", tokens=list(tokens) + suffix(n))
                priced = any("would lose" in r or "does not beat" in r for r in out["reasons"])
                action = ("load" if any(t == "tcp" for _, _, t in out["spans"]) else
                          "recompute" if out["action"] == "recompute" and priced else
                          f"{out['action']} (not priced: {'; '.join(out['reasons'])[:80]})")  # fmt: skip
                log(f"  {action:<12} reused {out['reused']:>5}  ttft {out['ttft_ms']:7.1f} ms  {out['fallback']}")
                return action

            def phase(name: str, want: str) -> bool:
                t0 = time.monotonic()
                while time.monotonic() - t0 < timeout_s:
                    phases[name].append(serve())
                    if phases[name][-1] == want and phases[name][-3:].count(want) >= 2:
                        return True
                return False

            log("link unshaped")
            fast = phase("fast", "load")
            log(f"link shaped to {rate} (tbf)")
            ns.shape(rate)
            slowed = fast and phase("slowed", "recompute")
            log("link unshaped again")
            ns.shape(None)
            recovered = slowed and phase("recovered", "load")
            links = cluster.call("near", "stats")["links"]
    finally:
        ns.close()
    return {"flip": int(bool(fast and slowed and recovered)), "phases": phases, "links": links}
