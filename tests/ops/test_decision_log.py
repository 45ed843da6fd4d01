"""DecisionLog: one record per plan, observers off the caller's thread, exact counts under threads, drops counted."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nexuskv import PlanAction, hookimpl
from nexuskv.contracts import Plan, Predicted
from nexuskv.ops.decision_log import DecisionLog
from nexuskv.plugins.manager import PluginManager


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


def decision_lines(buf) -> list[dict]:
    return [r for r in (json.loads(line) for line in buf.getvalue().splitlines()) if r.get("event") == "decision"]


def test_sampling_logs_exactly_that_fraction_and_every_fallback_while_everyone_sees_every_plan(tmp_path):
    import io

    from nexuskv.logs import configure_logging

    buf = io.StringIO()
    configure_logging(json=True, stream=buf, force=True)
    try:
        pm, seen = observed()
        log = DecisionLog(pm, file=tmp_path / "d.jsonl", sample=0.25)
        sub = log.subscribe()
        for i in range(104):
            log.record(plan(i), time.perf_counter(), fallback=i % 26 == 25)  # 4 fallbacks, 100 others
        log.close()
        lines = decision_lines(buf)
    finally:
        configure_logging(force=True)
    assert sum(not r["fallback"] for r in lines) == 25 and sum(r["fallback"] for r in lines) == 4
    assert len(seen) == 104 and len(list(sub)) == 104 and log.decisions == 104
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 1 + 104
    assert sum(log.counts()["plans"].values()) == 104 and log.counts()["fail_open"] == {"error": 4}


@pytest.mark.parametrize(("level", "logging_level", "expected"), [("off", "debug", 0), ("debug", "info", 0),
                                                                  ("debug", "debug", 6), ("info", "info", 6)])
def test_the_decision_level_routes_or_silences_the_lines(level, logging_level, expected):
    import io

    from nexuskv.logs import configure_logging

    buf = io.StringIO()
    configure_logging(json=True, stream=buf, level=logging_level, force=True)
    try:
        log = DecisionLog(PluginManager(entry_points=False), level=level)
        sub = log.subscribe()
        for i in range(6):
            log.record(plan(i), time.perf_counter(), fallback=i == 0)
        log.close()
        lines = decision_lines(buf)
    finally:
        configure_logging(force=True)
    assert len(lines) == expected and {r["level"] for r in lines} <= {level}
    assert [r["decision_id"] for r in sub] == [f"d{i}" for i in range(6)]  # the stream has them all


def test_bad_sampling_settings_are_refused():
    pm = PluginManager(entry_points=False)
    with pytest.raises(ValueError, match="sample"):
        DecisionLog(pm, sample=1.5)
    with pytest.raises(ValueError, match="level"):
        DecisionLog(pm, level="loud")


def test_recent_keeps_the_last_records_in_order():
    log = DecisionLog(PluginManager(entry_points=False), recent=5)
    for i in range(12):
        log.record(plan(i), time.perf_counter())
    log.close()
    assert [r["decision_id"] for r in log.recent()] == [f"d{i}" for i in range(7, 12)]
    assert [r["decision_id"] for r in log.recent(2)] == ["d10", "d11"]
    assert log.recent(0) == [] and len(log.recent(50)) == 5


def test_subscribers_get_every_record_from_eight_threads_on_the_log_thread(monkeypatch):
    from nexuskv.ops.decision_log import Subscription

    threads_seen = set()
    offer = Subscription.offer

    def spying_offer(self, record):
        threads_seen.add(threading.current_thread().name)
        return offer(self, record)

    monkeypatch.setattr(Subscription, "offer", spying_offer)
    log = DecisionLog(PluginManager(entry_points=False))
    subs = [log.subscribe(maxsize=10_000) for _ in range(2)]
    got: list[list[str]] = [[], []]
    readers = [threading.Thread(target=lambda s=s, out=out: out.extend(r["decision_id"] for r in s))
               for s, out in zip(subs, got, strict=True)]  # fmt: skip
    for r in readers:
        r.start()

    def worker(n: int) -> None:
        for i in range(200):
            log.record(plan(n * 1000 + i), time.perf_counter(), fallback=i % 50 == 0)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    log.close()  # closes the subscriptions: the readers' iterations end after what they hold
    for r in readers:
        r.join(10)
    expected = sorted(f"d{n * 1000 + i}" for n in range(8) for i in range(200))
    assert sorted(got[0]) == sorted(got[1]) == expected
    assert threads_seen == {"nexuskv-observers"} and log.subscriber_drops == 0


def test_a_full_subscription_drops_and_counts_and_a_closed_one_gets_nothing():
    log = DecisionLog(PluginManager(entry_points=False))
    full = log.subscribe(maxsize=3)
    gone = log.subscribe()
    gone.close()
    for i in range(10):
        log.record(plan(i), time.perf_counter())
    log.close()
    assert [full.get(timeout=1)["decision_id"] for _ in range(3)] == ["d0", "d1", "d2"]
    assert full.get(timeout=0) is None and full.drops == 7 and log.subscriber_drops == 7
    assert gone.get(timeout=0) is None and gone.drops == 0 and full.closed
    assert log.subscribe().closed  # after close: closed at once
    with pytest.raises(ValueError):
        log.subscribe(maxsize=0)


def test_get_waits_for_a_record_and_times_out_without_one():
    log = DecisionLog(PluginManager(entry_points=False))
    with log.subscribe() as sub:
        assert sub.get(timeout=0.01) is None
        threading.Timer(0.05, lambda: log.record(plan(1), time.perf_counter())).start()
        assert sub.get(timeout=10)["decision_id"] == "d1"
    assert sub.closed
    log.close()


def test_decision_lines_route_to_the_stdlib_logger_named_nexuskv_kernel():
    import logging

    import structlog

    from nexuskv.logs import configure_logging

    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Capture()
    logger = logging.getLogger("nexuskv.kernel")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    configure_logging()  # nexuskv's defaults first: a kernel started later leaves the routing below alone
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level,
                                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                                    structlog.processors.JSONRenderer()],
                        logger_factory=structlog.stdlib.LoggerFactory(), wrapper_class=structlog.stdlib.BoundLogger,
                        cache_logger_on_first_use=False)  # fmt: skip
    try:
        configure_logging()  # what a kernel's start calls: a no-op now
        log = DecisionLog(PluginManager(entry_points=False))
        log.record(plan(1), time.perf_counter())
        log.record(plan(2), time.perf_counter(), fallback=True)
        log.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        configure_logging(force=True)
    got = [json.loads(r.getMessage()) for r in records]
    assert [(r.name, r.levelname) for r in records] == [("nexuskv.kernel", "INFO")] * 2
    assert [(g["event"], g["decision_id"], g["component"]) for g in got] == [("decision", "d1", "nexuskv.kernel"),
                                                                             ("decision", "d2", "nexuskv.kernel")]


def test_the_decision_file_is_readable_by_its_owner_only(tmp_path):
    """It holds request ids, scopes and cache salts: created 0600 whatever the umask, and narrowed if it was wider."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        fresh, wide = tmp_path / "fresh.jsonl", tmp_path / "wide.jsonl"
        wide.write_text("")
        wide.chmod(0o644)
        for path in (fresh, wide):
            log = DecisionLog(PluginManager(entry_points=False), file=path, node="n1")
            log.close()
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
        assert len(wide.read_text().splitlines()) == 1  # the context line, appended: nothing it held was lost
    finally:
        os.umask(old)


def test_a_decision_file_someone_else_could_read_or_that_blocks_is_refused(tmp_path, monkeypatch):
    """A symlink (to a file another user reads), a FIFO (it would block the kernel) and a file another user owns
    are each a clear ConfigError at start, and nothing is written through them."""
    import os

    from nexuskv import ConfigError

    target = tmp_path / "elsewhere.jsonl"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path, why in ((link, "symlink"), (fifo, "fifo.jsonl")):
        with pytest.raises(ConfigError, match=why):  # the FIFO: refused, not blocked on a reader that never comes
            DecisionLog(PluginManager(entry_points=False), file=path, node="n1")
    assert target.read_text() == ""
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    linked = tmp_path / "linked.jsonl"
    os.link(secret, linked)  # a hard link to another of this user's files, planted at the path
    with pytest.raises(ConfigError, match="2 hard links"):
        DecisionLog(PluginManager(entry_points=False), file=linked, node="n1")
    assert secret.read_text() == "s3cret"
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text("")
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)  # nobody's file
    else:  # without root no file can be given away: this user is made someone else instead
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 1)
    with pytest.raises(ConfigError, match="owned by uid"):
        DecisionLog(PluginManager(entry_points=False), file=foreign, node="n1")
    assert foreign.read_text() == ""
