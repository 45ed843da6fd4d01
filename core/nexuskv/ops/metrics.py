"""Operability: a kernel's Prometheus series, its `/status` JSON, and the opt-in HTTP endpoint serving both.

Nothing is counted here. The kernel's parts already keep what they did (the decision log's per-plan counts,
the hierarchy's and the load path's `Tally`, the writer's and the prefetcher's stats, the breakers, the link
estimates); `KernelCollector` reads them when it is scraped and turns them into `nexuskv_*` families, so a plan
pays no metric call at all. `Metrics` (what `kernel.metrics` is) owns the kernel's `CollectorRegistry`, adds
the collector to the registry a plugin's `nexuskv_metrics_registry` hook returns (an engine's own, so vLLM or
SGLang export NexusKV's series beside theirs), and with `metrics_port` serves `GET /metrics` and `GET /status`
from a small threaded WSGI server. docs/operations.md describes every series and the status document.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from nexuskv.errors import ConfigError
from nexuskv.logs import get_logger

__all__ = ["BREAKER_STATES", "KernelCollector", "Metrics"]

log = get_logger("nexuskv.metrics")  # the component name operators filter on: stable

BREAKER_STATES = ("closed", "open", "half-open")
_WRITER = ("accepted", "refused", "written", "failed")
_PREFETCH = ("submitted", "deduplicated", "refused", "done", "failed", "expired", "cancelled")
_TIER_COUNTS = ("hits", "misses", "read_bytes", "written_bytes", "evictions", "quarantined")


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _used_bytes(store: Any) -> int | None:
    try:
        return int(store.used_bytes())
    except Exception:  # a remote tier that cannot answer now: unknown, not a failed scrape
        return None


def tier_status(kernel: Any) -> dict[str, dict[str, Any]]:
    """Per tier, fastest first: capacity, use, fill, hits and misses of loads, bytes, evictions, quarantines."""
    counts = kernel.hierarchy.counts.snapshot()
    out: dict[str, dict[str, Any]] = {}
    for name in (*kernel.tier_order, *(t for t in kernel.tiers if t not in kernel.tier_order)):
        store = kernel.tiers[name]
        cap = int(getattr(store, "capacity_bytes", 0) or 0)
        used = _used_bytes(store)
        row: dict[str, Any] = {"capacity_bytes": cap, "used_bytes": used,
                               "fill": _ratio(used, cap) if used is not None else None}  # fmt: skip
        row.update({c: counts.get((c, name), 0) for c in _TIER_COUNTS})
        row["hit_ratio"] = _ratio(row["hits"], row["hits"] + row["misses"])
        out[name] = row
    return out


def link_status(kernel: Any) -> dict[str, dict[str, Any]]:
    """Per link (a tier, a transport or `peer:<node>`): bytes and spans read, and the measured estimate."""
    counts = kernel.loads.counts.snapshot()
    names = {k[1] for k in counts if isinstance(k, tuple)}
    estimates = dict(kernel.links.snapshot()) if kernel.links is not None else {}
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(names | set(estimates)):
        row: dict[str, Any] = {"read_bytes": counts.get(("link_bytes", name), 0),
                               "transfers": counts.get(("link_transfers", name), 0)}  # fmt: skip
        row.update(estimates.get(name, {}))
        # what plans price: an estimate with enough samples, recent enough (otherwise the profile's figure)
        links = kernel.links
        row["trusted"] = links is not None and name in estimates and links.get(name, probe=False) is not None
        out[name] = row
    return out


def queue_status(kernel: Any) -> dict[str, dict[str, Any]]:
    """The writer's and the prefetcher's queues: depth, bytes, bounds and their outcome counts."""
    w = kernel.writer
    items, nbytes = w.queued()
    p = kernel.prefetcher
    tasks = p.tasks()
    inflight = p.inflight_bytes()
    stats = dict(p.stats)
    return {
        "writer": {"items": items, "bytes": nbytes, "max_items": w.max_items, "max_bytes": w.max_bytes,
                   "fill": round(max(items / w.max_items, nbytes / w.max_bytes), 4),
                   **{k: w.stats[k] for k in _WRITER}},
        "prefetch": {"queued": sum(t.state == "queued" for t in tasks),
                     "running": sum(t.state == "running" for t in tasks), "inflight_bytes": inflight,
                     "max_tasks": p.max_tasks, "max_bytes": p.max_bytes, "bytes_moved": stats.get("bytes_moved", 0),
                     **{k: stats.get(k, 0) for k in _PREFETCH}},
    }  # fmt: skip


class KernelCollector(Collector):
    """Reads a kernel's counts and state at scrape time and yields its `nexuskv_*` metric families."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.closed = False  # set when the kernel closes: its parts are gone, so nothing is reported

    def collect(self) -> Iterator[Metric]:
        """Every family (empty ones included), each sample labelled with the kernel's `node`; none once closed."""
        if self.closed:
            return iter(())
        k = self.kernel
        node = k.node
        fams: list[Metric] = []

        def family(kind: type, name: str, doc: str, labels: Iterable[str] = (),
                   rows: Iterable[tuple[tuple[str, ...], float]] = ()) -> None:  # fmt: skip
            fam = kind(name, doc, labels=["node", *labels])
            for values, value in rows:
                fam.add_metric([node, *values], value)
            fams.append(fam)

        counter: Callable[..., None] = lambda *a: family(CounterMetricFamily, *a)  # noqa: E731
        gauge: Callable[..., None] = lambda *a: family(GaugeMetricFamily, *a)  # noqa: E731

        d = k.decision_log.counts()
        counter("nexuskv_plans_total", "Plans made, by action and reason class.", ("action", "reason"),
                [((a, r), n) for (a, r), n in sorted(d["plans"].items())])
        counter("nexuskv_fail_open_total", "Plans that failed open (recompute), by reason class.", ("reason",),
                [((r,), n) for r, n in sorted(d["fail_open"].items())])
        lost = k.reads.lost.snapshot()
        counter("nexuskv_fail_open_lost_gain_ms_total", "Predicted prefill ms fallbacks gave up (judged in hindsight), "
                "by reason class.", ("reason",), [((r,), row["lost_gain_ms"]) for r, row in lost.items()])
        counter("nexuskv_fail_open_unjudged_total", "Fallbacks whose lost gain is not judged (yet, or dropped).",
                ("reason",), [((r,), row["unjudged"]) for r, row in lost.items()])
        counter("nexuskv_tokens_reused_total", "Prompt tokens plans restore from stored state.", (),
                [((), d["tokens_reused"])])
        counter("nexuskv_tokens_recomputed_total", "Prompt tokens plans leave to prefill.", (),
                [((), d["tokens_recomputed"])])
        counter("nexuskv_policy_rule_decisions_total", "Plans each policy rule decided, by tenant and rule.",
                ("policy", "rule"), [(key, n) for key, n in sorted(d["rules"].items())])
        counter("nexuskv_decision_observer_drops_total", "Decision records dropped: the observer thread was behind.",
                (), [((), d["observer_drops"])])
        counter("nexuskv_decision_subscriber_drops_total", "Decision records dropped: a subscriber's stream was full.",
                (), [((), d["subscriber_drops"])])
        counter("nexuskv_decision_file_errors_total", "Decision records the decision file could not take.", (),
                [((), d["file_errors"])])

        loads = k.loads.counts.snapshot()
        counter("nexuskv_load_reports_total", "Load reports from connectors, by outcome.", ("outcome",),
                [(("ok",), loads.get("reports_ok", 0)), (("failed",), loads.get("reports_failed", 0))])
        counter("nexuskv_ttft_measured_seconds_total", "Sum of measured TTFT over reports that measured it.", (),
                [((), loads.get("ttft_measured_us", 0) / 1e6)])
        counter("nexuskv_ttft_predicted_seconds_total", "Sum of the predicted TTFT of those same reports.", (),
                [((), loads.get("ttft_predicted_us", 0) / 1e6)])
        buckets, total, _ = k.loads.ttft_error.snapshot()
        hist = HistogramMetricFamily("nexuskv_ttft_error_seconds", "|measured - predicted| TTFT per load report.",
                                     labels=["node"])  # fmt: skip
        hist.add_metric([node], [(floatToGoString(b), c) for b, c in buckets], total)
        fams.append(hist)

        tiers = tier_status(k)
        gauge("nexuskv_tier_capacity_bytes", "Capacity of each tier.", ("tier",),
              [((t,), r["capacity_bytes"]) for t, r in tiers.items()])
        gauge("nexuskv_tier_used_bytes", "Bytes each tier holds now.", ("tier",),
              [((t,), r["used_bytes"]) for t, r in tiers.items() if r["used_bytes"] is not None])
        for what, doc in (("hits", "Loads of a block the tier returned, checksum verified."),
                          ("misses", "Loads of a block the tier no longer had, or had corrupt."),
                          ("read_bytes", "Payload bytes read from each tier (loads and prefetch moves)."),
                          ("written_bytes", "Payload bytes stored into each tier (commits, moves, demotions)."),
                          ("evictions", "Payloads each tier evicted (capacity, TTL)."),
                          ("quarantined", "Corrupt payloads deleted from each tier.")):  # fmt: skip
            name = f"nexuskv_tier_{what}_total"
            counter(name, doc, ("tier",), [((t,), r[what]) for t, r in tiers.items()])

        links = link_status(k)
        counter("nexuskv_link_read_bytes_total", "Bytes of planned spans read over each link.", ("link",),
                [((n,), r["read_bytes"]) for n, r in links.items()])
        counter("nexuskv_link_transfers_total", "Planned spans read over each link.", ("link",),
                [((n,), r["transfers"]) for n, r in links.items()])
        gauge("nexuskv_link_bandwidth_bytes_per_second", "Measured bandwidth of each link plans price (trusted "
              "estimates only).", ("link",), [((n,), r["bandwidth_bytes_per_s"]) for n, r in links.items()
                                              if r["trusted"]])  # fmt: skip
        gauge("nexuskv_link_latency_seconds", "Measured latency of each link plans price (trusted estimates only).",
              ("link",), [((n,), r["latency_ms"] / 1e3) for n, r in links.items() if r["trusted"]])

        breakers = k.health.snapshot()
        gauge("nexuskv_breaker_state", "1 for each breaker's current state, 0 for the others.", ("breaker", "state"),
              [((b, s), float(r["state"] == s)) for b, r in breakers.items() for s in BREAKER_STATES])
        counter("nexuskv_breaker_trips_total", "Times each breaker opened.", ("breaker",),
                [((b,), r["trips"]) for b, r in breakers.items()])

        q = queue_status(k)
        w, p = q["writer"], q["prefetch"]
        gauge("nexuskv_writer_queue_items", "Payloads waiting in the writer.", (), [((), w["items"])])
        gauge("nexuskv_writer_queue_bytes", "Bytes waiting in the writer.", (), [((), w["bytes"])])
        counter("nexuskv_writer_items_total", "Payloads handed to the writer, by outcome.", ("outcome",),
                [((o,), w[o]) for o in _WRITER])
        gauge("nexuskv_prefetch_queue_tasks", "Prefetch tasks queued or running.", (),
              [((), p["queued"] + p["running"])])
        gauge("nexuskv_prefetch_inflight_bytes", "Prefetch bytes queued or moving, by source tier.", ("tier",),
              [((t,), n) for t, n in sorted(p["inflight_bytes"].items())])
        counter("nexuskv_prefetch_tasks_total", "Prefetch tasks, by outcome (refused and expired are drops).",
                ("outcome",), [((o,), p[o]) for o in _PREFETCH])
        counter("nexuskv_prefetch_moved_bytes_total", "Bytes prefetch moved between tiers.", (),
                [((), p["bytes_moved"])])

        gauge("nexuskv_epoch", "This node's control-plane epoch.", (), [((), k.epoch)])
        gauge("nexuskv_control_plane_ok", "1 while the lease is known to be alive.", (), [((), float(k.control_ok()))])
        gauge("nexuskv_policy_revision_info", "1, labelled with the serving policy revision.", ("revision",),
              [((k.policy_revision,), 1)])
        return iter(fams)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


# Registries (by id, with a weak reference to tell a reused id apart) that hold a kernel's collector.
_ATTACHED: dict[int, tuple[weakref.ref[Any], Metrics]] = {}
_ATTACHED_LOCK = threading.Lock()


class Metrics:
    """A kernel's metrics: `registry` (with `collector` in it), `status()`, and `port` when it serves HTTP."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.registry = CollectorRegistry()  # its own: no names to check, so no scrape when registering
        self.collector = KernelCollector(kernel)
        self.registry.register(self.collector)
        self.port: int | None = None  # the bound port while serving (`metrics_port = 0` picks a free one)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._external: list[Any] = []  # registries of other owners the collector was added to
        self._lock = threading.Lock()

    @classmethod
    def start(cls, kernel: Any) -> Metrics:
        """The kernel's metrics: in a plugin's registry when one answers the hook, served when configured."""
        m = cls(kernel)
        registry = kernel.plugins.metrics_registry(kernel)
        if registry is not None:
            m.attach(registry)
        if kernel.config.metrics_port is not None:
            try:
                m.serve(kernel.config.metrics_port, kernel.config.metrics_host)
            except BaseException:
                m.close()  # out of the engine's registry again: the kernel does not start
                raise
        return m

    def attach(self, registry: Any) -> bool:
        """Add the collector to another `CollectorRegistry` too (taken out again by `close`); False if refused.

        One registry takes one kernel's series (a second kernel's would repeat every family name): the second is
        refused with an error line, as is anything that is not a registry. The kernel starts either way.
        """
        if not callable(getattr(registry, "register", None)) or not callable(getattr(registry, "unregister", None)):
            log.error("metrics not added: nexuskv_metrics_registry answered something that is not a registry",
                      node=self.kernel.node, answer=type(registry).__name__)  # fmt: skip
            return False
        with _ATTACHED_LOCK:
            holder = _ATTACHED.get(id(registry))
            if holder is not None and holder[0]() is registry:
                log.error("metrics not added: the registry holds another kernel's series already",
                          node=self.kernel.node)  # fmt: skip
                return False
            try:
                registry.register(self.collector)
            except Exception as exc:  # names another collector there exports already, or a registry that raises
                log.error("metrics not added to the registry", node=self.kernel.node, error=f"{type(exc).__name__}: "
                          f"{exc}")  # fmt: skip
                return False
            _ATTACHED[id(registry)] = (weakref.ref(registry), self)
        with self._lock:
            self._external.append(registry)
        return True

    def status(self, decisions: int = 20) -> dict[str, Any]:
        """The node's state as a JSON-compatible dict, with its last `decisions` records (docs/operations.md)."""
        k = self.kernel
        counts = k.decision_log.counts()
        loads = k.loads.counts.snapshot()
        by_action: dict[str, int] = {}
        for (action, _), n in counts["plans"].items():
            by_action[action] = by_action.get(action, 0) + n
        _, err_sum, err_n = k.loads.ttft_error.snapshot()
        policies = k.policies
        return {
            "node": k.node, "at": round(time.time(), 3), "epoch": k.epoch, "control_ok": k.control_ok(),
            "policy_revision": k.policy_revision, "tenants": policies.tenants() if policies is not None else [],
            "plans": {"total": counts["decisions"], "by_action": by_action,
                      "by_reason": {f"{a}/{r}": n for (a, r), n in sorted(counts["plans"].items())},
                      "fail_open": counts["fail_open"], "tokens_reused": counts["tokens_reused"],
                      "tokens_recomputed": counts["tokens_recomputed"]},
            "lost_gain": k.reads.lost.snapshot(),
            "tiers": tier_status(k), "links": link_status(k), "breakers": k.health.snapshot(), **queue_status(k),
            "ttft": {"reports_ok": loads.get("reports_ok", 0), "reports_failed": loads.get("reports_failed", 0),
                     "measured": err_n, "mean_abs_error_ms": round(err_sum / err_n * 1e3, 3) if err_n else None,
                     "measured_mean_ms": round(loads.get("ttft_measured_us", 0) / err_n / 1e3, 3) if err_n else None,
                     "predicted_mean_ms": round(loads.get("ttft_predicted_us", 0) / err_n / 1e3, 3) if err_n else None},
            "decisions": {"observer_drops": counts["observer_drops"], "subscriber_drops": counts["subscriber_drops"],
                          "file_errors": counts["file_errors"], "recent": k.decision_log.recent(decisions)},
        }  # fmt: skip

    # ------------------------------------------------------------------------------------------ HTTP

    def wsgi_app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        """The WSGI app `serve` runs (mountable elsewhere): `GET /metrics`, `GET /status[?decisions=N]`."""
        path = environ.get("PATH_INFO") or "/"
        try:
            if path == "/metrics":
                encoder, ctype = choose_encoder(environ.get("HTTP_ACCEPT", ""))
                body, status = encoder(self.registry), "200 OK"
            elif path == "/status":
                query = parse_qs(environ.get("QUERY_STRING", ""))
                n = int(query.get("decisions", ["20"])[0])
                body, status, ctype = json.dumps(self.status(n)).encode(), "200 OK", "application/json"
            else:
                body, status, ctype = b"not found: try /metrics or /status\n", "404 Not Found", "text/plain"
        except ValueError as exc:
            body, status, ctype = f"bad request: {exc}\n".encode(), "400 Bad Request", "text/plain"
        except Exception as exc:  # a scrape never takes the server down
            log.exception("metrics endpoint failed", path=path)
            body, status, ctype = f"{type(exc).__name__}: {exc}\n".encode(), "500 Internal Server Error", "text/plain"
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve `wsgi_app` on `host:port` (0: a free port) on daemon threads; returns the bound port."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"already serving on port {self.port}")
            try:
                server = make_server(host, port, self.wsgi_app, server_class=_Server6 if ":" in host else _Server,
                                     handler_class=_QuietHandler)  # fmt: skip
            except OSError as exc:
                raise ConfigError(f"metrics_port: cannot serve on {host}:{port}: {exc.strerror or exc}") from None
            self._server, self.port = server, int(server.server_address[1])
            self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                            name="nexuskv-metrics", daemon=True)  # fmt: skip
            self._thread.start()
        log.info("serving metrics", node=self.kernel.node, url=f"http://{host}:{self.port}/metrics")
        return self.port

    def close(self) -> None:
        """Stop serving and take the collector out of other registries. Idempotent, never raises."""
        with self._lock:
            server, self._server = self._server, None
            external, self._external = self._external, []
        if server is not None:
            server.shutdown()
            server.server_close()
        for registry in external:
            with _ATTACHED_LOCK:
                _ATTACHED.pop(id(registry), None)
            try:
                registry.unregister(self.collector)
            except Exception as exc:  # gone already: nothing to take out
                log.debug("metrics collector not unregistered", error=repr(exc))
        self.port = None
        self.collector.closed = True  # a scrape after close answers nothing rather than a closed kernel's figures
