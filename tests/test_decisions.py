"""DecisionLog: one record per plan, observers off the caller's thread, exact counts under threads, drops counted."""

from __future__ import annotations

import json
import threading
import time

from nexuskv import PlanAction, hookimpl
from nexuskv.contracts import Plan, Predicted
from nexuskv.decisions import DecisionLog
from nexuskv.plugins import PluginManager


def plan(i: int) -> Plan:
    return Plan(decision_id=f"d{i}", request_id=f"r{i}", tenant="acme", action=PlanAction.RECOMPUTE,
                tokens_total=64, tokens_reused=0, predicted=Predicted(ttft_ms=1.0))  # fmt: skip


def observed(gate: threading.Event | None = None) -> tuple[PluginManager, list[dict]]:
    seen: list[dict] = []

    class Observer:
        @hookimpl
        def nexuskv_observe_decision(self, decision):
            if gate is not None:
                gate.wait(10)
            seen.append(decision)

    pm = PluginManager(entry_points=False)
    pm.register(Observer(), "obs")
    return pm, seen


def test_every_record_reaches_the_observers_in_order():
    pm, seen = observed()
    log = DecisionLog(pm)
    t0 = time.perf_counter()
    for i in range(20):
        log.record(plan(i), t0, fallback=i % 2 == 1)
    end = time.monotonic() + 5
    while len(seen) < 20 and time.monotonic() < end:
        time.sleep(0.01)
    log.close()
    assert [r["decision_id"] for r in seen] == [f"d{i}" for i in range(20)]
    assert [r["fallback"] for r in seen[:2]] == [False, True] and seen[0]["plan_ms"] >= 0
    assert log.decisions == 20 and log.observer_drops == 0


def test_counts_are_exact_when_many_threads_record():
    log = DecisionLog(PluginManager(entry_points=False))
    t0 = time.perf_counter()

    def worker(n: int) -> None:
        for i in range(300):
            log.record(plan(n * 1000 + i), t0)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    assert log.decisions == 8 * 300


def test_a_slow_observer_costs_dropped_records_never_a_wait():
    gate = threading.Event()
    pm, seen = observed(gate)
    log = DecisionLog(pm, max_queued=4)
    t0 = time.perf_counter()
    for i in range(50):
        log.record(plan(i), t0)
    assert seen == []  # the observer is still blocked: recording never waited for it
    gate.set()
    end = time.monotonic() + 5
    while len(seen) < 50 - log.observer_drops and time.monotonic() < end:
        time.sleep(0.01)
    log.close()
    # One record is with the (blocked) observer, four wait in the queue; every other one was dropped, and counted.
    assert log.decisions == 50
    assert 50 - 5 <= log.observer_drops <= 50 - 4
    assert len(seen) == 50 - log.observer_drops  # what was not dropped was delivered


def test_a_fallbacks_line_is_rendered_off_the_callers_thread_and_still_written():
    import io
    import json

    from nexuskv.logs import configure_logging

    buf = io.StringIO()
    configure_logging(json=True, stream=buf, force=True)
    try:
        log = DecisionLog(PluginManager(entry_points=False))
        log.record(plan(1), time.perf_counter(), fallback=True)
        log.record(plan(2), time.perf_counter())
        log.close()
        lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    finally:
        configure_logging(force=True)
    got = {(r["decision_id"], r["fallback"]) for r in lines if r.get("event") == "decision"}
    assert got == {("d1", True), ("d2", False)} and log.decisions == 2


def test_the_decision_file_gets_a_context_line_then_every_record_from_many_threads(tmp_path):
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(PluginManager(entry_points=False), file=path, node="n7")
    assert not log.wants_inputs("acme")  # no tenant opted in, no shadow: plans keep no inputs

    def worker(t: int) -> None:
        for i in range(50):
            log.record(plan(t * 1000 + i), time.perf_counter(), fallback=i % 10 == 0)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["record"] == "context" and lines[0]["node"] == "n7"
    decisions = lines[1:]
    assert sorted(d["decision_id"] for d in decisions) == sorted(f"d{t * 1000 + i}" for t in range(8)
                                                                 for i in range(50))  # fmt: skip
    assert sum(d["fallback"] for d in decisions) == 8 * 5 and log.file_errors == 0


def test_a_failing_decision_file_is_counted_and_never_stops_decisions(tmp_path):
    log = DecisionLog(PluginManager(entry_points=False), file=tmp_path / "d.jsonl", inputs_for=("acme",))
    assert log.wants_inputs("acme") and not log.wants_inputs("globex")

    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    log._file = Full()
    for i in range(3):
        log.record(plan(i), time.perf_counter())
    log.close()
    assert log.file_errors == 3 and log.decisions == 3


def test_close_with_a_full_queue_and_a_stuck_observer_returns_and_leaves_the_file_to_the_thread(tmp_path):
    gate = threading.Event()
    pm, seen = observed(gate)
    log = DecisionLog(pm, max_queued=2, file=tmp_path / "d.jsonl")
    for i in range(6):  # two queued, one perhaps taken by the (stuck) observer, the rest dropped
        log.record(plan(i), time.perf_counter())
    t0 = time.monotonic()
    log.close(timeout=0.3)
    assert time.monotonic() - t0 < 5 and not log._file.closed  # the thread may still write: not closed under it
    gate.set()
    end = time.monotonic() + 5
    while len(seen) + log.observer_drops < 6 and time.monotonic() < end:
        time.sleep(0.01)
    log._thread.join(5)
    assert not log._thread.is_alive() and log.observer_drops in (3, 4) and len(seen) + log.observer_drops == 6
    lines = (tmp_path / "d.jsonl").read_text().splitlines()
    assert len(lines) == 1 + len(seen) and log.file_errors == 0  # the context line, then every record not dropped
