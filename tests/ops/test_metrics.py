"""Metrics: a real kernel under a real workload, scraped over HTTP on 127.0.0.1, every series checked against it."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nexuskv import Kernel, KernelConfig, LoadReport, PlanAction, hookimpl, slot_of
from nexuskv.errors import ConfigError
from nexuskv.plugins.manager import PluginManager
from tests.conftest import SECRET, make_request, run_threads

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
PAGE = 16
BLOCK = 4096

CAP_POLICY = """name = "default"
min_gain_ms = 0.0

[[reuse]]
name = "cap-capped"
when = 'request.tenant == "capped" && match.tokens > 64'
max_tokens = "64"
message = "tenant capped reuses at most 64 tokens"
"""


def make_kernel(tmp_path, **cfg) -> Kernel:
    pol = tmp_path / "policies"
    pol.mkdir(exist_ok=True)
    (pol / "default.toml").write_text(CAP_POLICY)
    base = dict(node="m1", policies=str(pol), metrics_port=0,
                tiers={"dram": {"store": "dram", "capacity_bytes": "8MiB"}})  # fmt: skip
    base.update(cfg)
    return Kernel(KernelConfig(**base), secret=SECRET)


def commit(k: Kernel, req) -> list[bytes]:
    keys = k.keys(req)
    res = k.commit(req, [bytes([i % 256]) * BLOCK for i in range(len(keys))], keys=keys)
    assert res.refused == 0 and k.flush(5)
    return keys


def scrape(k: Kernel) -> dict[tuple[str, frozenset], float]:
    """Every sample of GET /metrics, by (sample name, labels without `node`); each one labelled with the node."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{k.metrics.port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            assert labels.pop("node") == k.node, s
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def status(k: Kernel, query: str = "") -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{k.metrics.port}/status{query}", timeout=10) as resp:
        assert resp.headers["Content-Type"] == "application/json"
        return json.loads(resp.read())


def test_a_real_workload_is_what_the_scrape_reports(tmp_path):
    k = make_kernel(tmp_path)
    try:
        plans = []
        a = make_request(range(320), tenant="chat", request_id="a")  # 20 blocks
        plans.append(cold := k.plan(a))
        keys_a = commit(k, a)
        plans.append(warm := k.plan(a, keys=keys_a))
        got = k.materialize(warm, a, keys=keys_a)
        assert cold.action == PlanAction.RECOMPUTE and warm.action == PlanAction.MATERIALIZE and got.complete
        predicted = warm.predicted.ttft_ms
        assert k.report_load_result(warm, LoadReport(ok=True, measured_ttft_ms=predicted + 3.0)) == 320

        c = make_request(range(500, 660), tenant="capped", request_id="c")  # 10 blocks, reuse capped at 64 tokens
        keys_c = commit(k, c)
        plans.append(capped := k.plan(c, keys=keys_c))
        assert capped.tokens_reused == 64 and capped.rules == ("cap-capped",)

        b = make_request(range(1000, 1160), tenant="chat", request_id="b")  # 10 blocks, the first one rots
        keys_b = commit(k, b)
        store = k.tiers["dram"]
        good = store.get(slot_of(keys_b[0], 0))
        store.put(slot_of(keys_b[0], 0), b"\xff" * 100, good.descriptor)  # bit rot behind the kernel's back
        plans.append(rotten := k.plan(b, keys=keys_b))
        assert k.materialize(rotten, b, keys=keys_b).blocks == 0

        plans.append(late := k.plan(make_request(range(2000, 2160), request_id="d"), deadline_ms=0))
        for _ in range(3):  # a link that keeps failing: its breaker opens and plans fail open
            k.health.breaker("transport:local").failure("link reset")
        plans.append(broken := k.plan(a, keys=keys_a))
        assert "deadline" in late.reasons[0] and "circuit open" in broken.reasons[0]
        assert k.report_load_result(warm, LoadReport(ok=False, failed_block=3, tier="dram", timeout=True)) == 48

        m = scrape(k)
        plans_by = {(labels, v) for (name, labels), v in m.items() if name == "nexuskv_plans_total"}
        assert plans_by == {
            (frozenset({("action", "recompute"), ("reason", "nothing_reusable")}), 1),
            (frozenset({("action", "materialize"), ("reason", "gain")}), 3),  # warm, capped, rotten
            (frozenset({("action", "recompute"), ("reason", "fail_open")}), 2),
        }
        assert value(m, "nexuskv_fail_open_total", reason="deadline") == 1
        assert value(m, "nexuskv_fail_open_total", reason="breaker") == 1
        assert value(m, "nexuskv_tokens_reused_total") == sum(p.tokens_reused for p in plans) == 320 + 64 + 160
        assert value(m, "nexuskv_tokens_recomputed_total") == sum(p.tokens_total - p.tokens_reused for p in plans)
        assert value(m, "nexuskv_policy_rule_decisions_total", policy="default", rule="cap-capped") == 1
        # loads: 20 verified blocks of a, then b's rotten first block: a miss, and quarantined
        assert value(m, "nexuskv_tier_hits_total", tier="dram") == 20
        assert value(m, "nexuskv_tier_misses_total", tier="dram") == 1
        assert value(m, "nexuskv_tier_quarantined_total", tier="dram") == 1
        assert value(m, "nexuskv_tier_read_bytes_total", tier="dram") == 20 * BLOCK
        assert value(m, "nexuskv_tier_written_bytes_total", tier="dram") == (20 + 10 + 10) * BLOCK
        assert value(m, "nexuskv_tier_used_bytes", tier="dram") == store.used_bytes() == (20 + 10 + 9) * BLOCK
        assert value(m, "nexuskv_tier_capacity_bytes", tier="dram") == 8 << 20
        assert value(m, "nexuskv_tier_evictions_total", tier="dram") == 0
        assert value(m, "nexuskv_link_read_bytes_total", link="dram") == 20 * BLOCK
        assert value(m, "nexuskv_link_transfers_total", link="dram") == 1
        # one transfer is not an estimate plans price yet (`[links] min_samples`): no gauge until it is
        assert k.links.get("dram") is None and ("nexuskv_link_bandwidth_bytes_per_second",
                                                frozenset({("link", "dram")})) not in m  # fmt: skip
        # the connector's reports: one ok with a TTFT 3 ms over the prediction, one timeout
        assert value(m, "nexuskv_load_reports_total", outcome="ok") == 1
        assert value(m, "nexuskv_load_reports_total", outcome="failed") == 1
        assert value(m, "nexuskv_ttft_error_seconds_count") == 1
        assert value(m, "nexuskv_ttft_error_seconds_sum") == pytest.approx(0.003)
        assert value(m, "nexuskv_ttft_error_seconds_bucket", le="0.0025") == 0
        assert value(m, "nexuskv_ttft_error_seconds_bucket", le="0.005") == 1
        assert value(m, "nexuskv_ttft_measured_seconds_total") == pytest.approx((predicted + 3.0) / 1e3, abs=1e-6)
        assert value(m, "nexuskv_ttft_predicted_seconds_total") == pytest.approx(predicted / 1e3, abs=1e-6)
        # breakers: the link's opened on its failures, the tier's on the timeout report
        for breaker in ("transport:local", "dram"):
            assert value(m, "nexuskv_breaker_state", breaker=breaker, state="open") == 1
            assert value(m, "nexuskv_breaker_state", breaker=breaker, state="closed") == 0
            assert value(m, "nexuskv_breaker_trips_total", breaker=breaker) == 1
        assert value(m, "nexuskv_writer_items_total", outcome="accepted") == 40
        assert value(m, "nexuskv_writer_items_total", outcome="written") == 40
        assert value(m, "nexuskv_writer_items_total", outcome="refused") == 0
        assert value(m, "nexuskv_writer_queue_items") == value(m, "nexuskv_writer_queue_bytes") == 0
        assert value(m, "nexuskv_decision_observer_drops_total") == 0
        assert value(m, "nexuskv_epoch") == k.epoch
        assert value(m, "nexuskv_policy_revision_info", revision=k.policy_revision) == 1

        doc = status(k, "?decisions=3")
        assert (doc["node"], doc["epoch"], doc["policy_revision"]) == ("m1", k.epoch, k.policy_revision)
        dram = doc["tiers"]["dram"]
        assert (dram["capacity_bytes"], dram["hits"], dram["misses"], dram["quarantined"]) == (8 << 20, 20, 1, 1)
        assert dram["hit_ratio"] == round(20 / 21, 4) and dram["fill"] == round(39 * BLOCK / (8 << 20), 4)
        assert doc["breakers"]["transport:local"]["state"] == "open"
        assert doc["links"]["dram"]["read_bytes"] == 20 * BLOCK
        assert (doc["writer"]["written"], doc["writer"]["items"], doc["prefetch"]["queued"]) == (40, 0, 0)
        assert doc["plans"]["total"] == len(plans) and doc["plans"]["fail_open"] == {"deadline": 1, "breaker": 1}
        assert [d["decision_id"] for d in doc["decisions"]["recent"]] == [p.decision_id for p in plans[-3:]]
        assert doc["ttft"]["measured"] == 1 and doc["ttft"]["mean_abs_error_ms"] == pytest.approx(3.0)
        assert k.metrics.status(3) | {"at": 0} == doc | {"at": 0}  # the same document without HTTP
    finally:
        k.close()


def test_evictions_are_counted_as_the_store_reports_them(tmp_path):
    k = make_kernel(tmp_path, tiers={"dram": {"store": "dram", "capacity_bytes": 6 * BLOCK}})
    try:
        for n in range(3):
            commit(k, make_request(range(n * 1000, n * 1000 + 64), request_id=f"e{n}"))  # 4 blocks each
        m = scrape(k)
        stored = value(m, "nexuskv_tier_written_bytes_total", tier="dram") / BLOCK
        held = len(list(k.tiers["dram"].slots()))
        assert held <= 6 and value(m, "nexuskv_tier_evictions_total", tier="dram") == stored - held > 0
    finally:
        k.close()


def test_counts_are_exact_when_eight_threads_plan_load_and_report(tmp_path):
    k = make_kernel(tmp_path)
    try:
        warm = make_request(range(320), request_id="w")
        keys = commit(k, warm)
        stop = threading.Event()
        scrapes = []

        def scraper() -> None:  # scrapes while the workers run: reading never disturbs counting
            while not stop.is_set():
                scrapes.append(scrape(k))

        reader = threading.Thread(target=scraper)
        reader.start()

        def worker(i: int) -> None:
            for j in range(40):
                if j % 2:
                    k.plan(make_request(range(10_000 * (i + 1) + j * 100, 10_000 * (i + 1) + j * 100 + 64)))
                    continue
                plan = k.plan(warm, keys=keys)
                assert plan.tokens_reused == 320
                if j % 10 == 0:
                    assert k.materialize(plan, warm, keys=keys).complete
                    k.report_load_result(plan, LoadReport(ok=True, measured_ttft_ms=plan.predicted.ttft_ms + 1.0))

        try:
            run_threads(worker, 8)
        finally:
            stop.set()
            reader.join()
        m = scrape(k)
        assert value(m, "nexuskv_plans_total", action="materialize", reason="gain") == 8 * 20
        assert value(m, "nexuskv_plans_total", action="recompute", reason="nothing_reusable") == 8 * 20
        assert value(m, "nexuskv_tokens_reused_total") == 8 * 20 * 320
        assert value(m, "nexuskv_tokens_recomputed_total") == 8 * 20 * 64
        assert value(m, "nexuskv_tier_hits_total", tier="dram") == 8 * 4 * 20
        assert value(m, "nexuskv_link_transfers_total", link="dram") == 8 * 4
        assert value(m, "nexuskv_load_reports_total", outcome="ok") == 8 * 4
        assert value(m, "nexuskv_ttft_error_seconds_count") == 8 * 4
        assert value(m, "nexuskv_ttft_error_seconds_bucket", le="0.0025") == 8 * 4
        assert len(k.decision_log.recent()) == 100 and scrapes  # the ring keeps `decision_log_recent` records
    finally:
        k.close()


def test_an_engine_registry_from_the_hook_gets_the_series_until_close():
    engine = CollectorRegistry()

    class Engine:
        @hookimpl
        def nexuskv_metrics_registry(self, kernel):
            assert kernel.node == "e1" and kernel.hierarchy is not None  # asked once the parts are built
            return engine

    pm = PluginManager(entry_points=False)
    pm.register(Engine(), "engine")
    k = Kernel(KernelConfig(node="e1"), plugins=pm, secret=SECRET)
    try:
        assert k.metrics.port is None  # no metrics_port: nothing served
        k.plan(make_request(range(64)))
        fams = {f.name: f for f in text_string_to_metric_families(generate_latest(engine).decode())}
        [sample] = fams["nexuskv_plans"].samples
        assert sample.labels == {"node": "e1", "action": "recompute", "reason": "nothing_reusable"}
        assert sample.value == 1
    finally:
        k.close()
    assert "nexuskv_plans_total" not in generate_latest(engine).decode()  # taken out again by close


def test_the_endpoint_answers_404_and_the_port_is_freed_by_close(tmp_path):
    k = make_kernel(tmp_path)
    port = k.metrics.port
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
        assert err.value.code == 404
        with pytest.raises(ConfigError, match="metrics_port"):  # the port is taken: a clear start error
            Kernel(KernelConfig(node="m2", metrics_port=port), secret=SECRET)
    finally:
        k.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)


def test_every_exported_metric_is_documented(tmp_path):
    doc = DOCS.read_text()
    k = make_kernel(tmp_path, metrics_port=None)
    try:
        families = list(k.metrics.collector.collect())
    finally:
        k.close()
    names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert len(names) >= 30
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/operations.md does not describe {missing}"


def test_one_registry_takes_one_kernels_series_and_a_bad_answer_never_stops_a_kernel():
    engine = CollectorRegistry()

    class Engine:
        def __init__(self, answer):
            self.answer = answer

        @hookimpl
        def nexuskv_metrics_registry(self, kernel):
            return self.answer

    kernels = []
    for node, answer in (("r1", engine), ("r2", engine), ("r3", "prometheus")):
        pm = PluginManager(entry_points=False)
        pm.register(Engine(answer), "engine")
        kernels.append(Kernel(KernelConfig(node=node), plugins=pm, secret=SECRET))  # every one starts
    try:
        for k in kernels:
            k.plan(make_request(range(64)))
        text = generate_latest(engine).decode()
        assert text.count("# HELP nexuskv_plans_total") == 1  # one family, not two clashing ones
        nodes = {s.labels["node"] for f in text_string_to_metric_families(text) for s in f.samples}
        assert nodes == {"r1"}  # the second kernel was refused (an error line), the third's answer is no registry
        assert kernels[1].metrics.attach(CollectorRegistry()) and kernels[1].metrics.port is None
    finally:
        for k in kernels:
            k.close()
    assert kernels[0].metrics.port is None and list(kernels[0].metrics.collector.collect()) == []


def test_reports_that_would_break_the_ttft_figures_are_not_counted(tmp_path):
    k = make_kernel(tmp_path)
    try:
        req = make_request(range(64))
        commit(k, req)
        plan = k.plan(req)
        for ttft in (float("inf"), 1e308, float("nan")):  # counted nowhere, and the report still does its work
            assert k.report_load_result(plan, LoadReport(ok=True, measured_ttft_ms=ttft)) == plan.tokens_reused
        assert k.report_load_result(plan, LoadReport(ok=False, failed_block=1, tier="dram", measured_ttft_ms=9.0)) == 16
        m = scrape(k)
        assert m[("nexuskv_load_reports_total", frozenset({("outcome", "ok")}))] == 3
        assert m[("nexuskv_ttft_error_seconds_count", frozenset())] == 0  # a failed load's TTFT is not an error
    finally:
        k.close()


def test_a_quarantine_is_counted_once_and_only_for_a_payload_that_was_held(tmp_path):
    k = make_kernel(tmp_path)
    try:
        req = make_request(range(64))
        keys = commit(k, req)
        k.quarantine(keys[0], 0, "dram", "rotten")
        k.quarantine(keys[0], 0, "dram", "reported again")  # the connector's report after materialize's
        k.quarantine(b"\x01" * 16, 0, "dram", "never held")
        assert scrape(k)[("nexuskv_tier_quarantined_total", frozenset({("tier", "dram")}))] == 1
    finally:
        k.close()


@pytest.mark.parametrize("port", [-1, 70000])
def test_a_metrics_port_out_of_range_is_a_config_error(port):
    with pytest.raises(ConfigError, match="metrics_port"):
        KernelConfig.from_mapping({"metrics_port": port}, origin="k.toml")
