import threading

import pytest

from nexuskv.storage.write_queue import WriteItem, Writer

WAIT = 10.0  # generous liveness bound for waits on the worker; never a performance threshold


class GatedSink:
    """Records payloads; blocks inside the call until `gate` is set (the first call signals `entered`)."""

    def __init__(self, gated: bool = True) -> None:
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.entered = threading.Event()
        self.seen: list[object] = []
        self.lock = threading.Lock()

    def __call__(self, payload: object) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT)
        with self.lock:
            self.seen.append(payload)


@pytest.fixture
def writers():
    made: list[Writer] = []
    sinks: list[GatedSink] = []

    def make(sink, **kw):
        w = Writer(sink, **kw)
        made.append(w)
        if isinstance(sink, GatedSink):
            sinks.append(sink)
        return w

    yield make
    for s in sinks:
        s.gate.set()
    for w in made:
        w.close(timeout=WAIT)


def blocked_writer(make, **kw):
    """A writer whose worker is stuck inside the sink on item 'first' (10 bytes), so the queue fills up."""
    sink = GatedSink()
    w = make(sink, **kw)
    assert w.submit([WriteItem(10, "first")]) == 1
    assert sink.entered.wait(WAIT)
    return w, sink


def submit_without_blocking(w, items):
    """Run submit on another thread; it must return while the sink is still blocked."""
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(w.submit(items)), daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), "submit blocked on a full writer"
    return out[0]


def test_items_are_written_in_order(writers):
    sink = GatedSink(gated=False)
    w = writers(sink)
    items = [WriteItem(i + 1, f"p{i}") for i in range(200)]
    assert w.submit(items[:50]) == 50
    assert w.submit(items[50:]) == 150
    assert w.flush(WAIT)
    assert sink.seen == [it.payload for it in items]
    assert w.stats == {"accepted": 200, "refused": 0, "written": 200, "failed": 0}
    assert w.queued() == (0, 0)


def test_submit_of_nothing(writers):
    w = writers(GatedSink(gated=False))
    assert w.submit([]) == 0
    assert w.stats["accepted"] == w.stats["refused"] == 0


def test_byte_bound_refuses_the_excess_without_blocking(writers):
    w, sink = blocked_writer(writers, max_bytes=100, max_items=1000)
    # 10 bytes are still held by the item inside the sink
    got = submit_without_blocking(w, [WriteItem(40, "a"), WriteItem(40, "b"), WriteItem(40, "c"),
                                      WriteItem(1, "d")])  # fmt: skip
    assert got == 2  # a, b fit (90 bytes); c does not, and d after it is refused too (order is kept)
    assert w.stats["refused"] == 2
    assert w.queued() == (2, 90)
    assert submit_without_blocking(w, [WriteItem(11, "e")]) == 0
    assert submit_without_blocking(w, [WriteItem(10, "f")]) == 1  # exactly at the bound
    sink.gate.set()
    assert w.flush(WAIT)
    assert sink.seen == ["first", "a", "b", "f"]
    assert w.queued() == (0, 0)
    # the bound frees up as items are written
    assert w.submit([WriteItem(40, "g"), WriteItem(40, "h")]) == 2


def test_item_larger_than_the_byte_bound_is_always_refused(writers):
    w = writers(GatedSink(gated=False), max_bytes=100)
    assert w.submit([WriteItem(101, "huge")]) == 0
    assert w.stats["refused"] == 1


def test_item_bound_refuses_the_excess_without_blocking(writers):
    w, sink = blocked_writer(writers, max_bytes=1 << 30, max_items=3)
    got = submit_without_blocking(w, [WriteItem(1, i) for i in range(5)])
    assert got == 3
    assert w.queued()[0] == 3
    assert submit_without_blocking(w, [WriteItem(1, "late")]) == 0
    assert w.stats == {"accepted": 4, "refused": 3, "written": 0, "failed": 0}
    sink.gate.set()
    assert w.flush(WAIT)
    assert sink.seen == ["first", 0, 1, 2]
    assert w.stats["written"] == 4


def test_failing_sink_counts_failed_and_the_writer_keeps_going(writers):
    seen = []

    def sink(payload):
        if payload % 3 == 0:
            raise OSError(f"disk full at {payload}")
        seen.append(payload)

    w = writers(sink)
    assert w.submit([WriteItem(1, i) for i in range(10)]) == 10
    assert w.flush(WAIT)
    assert seen == [1, 2, 4, 5, 7, 8]
    assert w.stats["failed"] == 4 and w.stats["written"] == 6
    assert w.queued() == (0, 0)  # bytes of failed items are released too
    assert w.submit([WriteItem(1, 11)]) == 1
    assert w.flush(WAIT)
    assert seen[-1] == 11


def test_flush_times_out_while_the_sink_is_blocked(writers):
    w, sink = blocked_writer(writers)
    w.submit([WriteItem(1, "x")])
    assert w.flush(timeout=0.05) is False
    sink.gate.set()
    assert w.flush(WAIT) is True
    assert sink.seen == ["first", "x"]


def test_flush_on_an_idle_writer_returns_true_at_once(writers):
    w = writers(GatedSink(gated=False))
    assert w.flush(timeout=0) is True


def test_close_writes_what_is_queued(writers):
    w, sink = blocked_writer(writers)
    assert w.submit([WriteItem(1, i) for i in range(20)]) == 20
    closer = threading.Thread(target=w.close, kwargs={"timeout": WAIT})
    closer.start()
    sink.gate.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert sink.seen == ["first", *range(20)]
    assert w.stats["written"] == 21


def test_submit_after_close_refuses(writers):
    sink = GatedSink(gated=False)
    w = writers(sink)
    w.close()
    assert w.submit([WriteItem(1, "a"), WriteItem(1, "b")]) == 0
    assert w.stats["refused"] == 2
    assert sink.seen == []
    w.close()  # closing twice is harmless


# ------------------------------------------------------------------------------------------ fairness between tenants


def test_one_tenant_flat_out_cannot_starve_the_others():
    """Eight threads commit for four tenants as fast as they can; every tenant gets a fair part of the writes."""
    import time

    from tests.conftest import run_threads

    written: dict[str, int] = {}
    lock = threading.Lock()

    def sink(payload):
        time.sleep(0.0002)  # a real tier takes time: the queue is always full
        with lock:
            written[payload] = written.get(payload, 0) + 1

    w = Writer(sink, max_bytes=1 << 20, max_items=64)
    tenants = ["t0", "t1", "t2", "t3"]
    stop = time.monotonic() + 1.5

    def worker(i):
        tenant = tenants[0] if i < 5 else tenants[i - 4]  # t0 has five threads, the others one each
        while time.monotonic() < stop:
            w.submit([WriteItem(100, tenant) for _ in range(8)], tenant=tenant)

    run_threads(worker, 8)
    assert w.flush(WAIT)
    w.close()
    counts = [w.by_tenant[t]["written"] for t in tenants]
    assert sum(counts) == sum(written.values()) and all(written[t] == w.by_tenant[t]["written"] for t in tenants)
    assert min(counts) * 3 >= max(counts), counts  # the old writer: one tenant about 4,300, the others 5 to 14
    for t in tenants:
        per = w.by_tenant[t]
        assert per["accepted"] == per["written"] and per["refused"] > 0  # refusals are counted per tenant


def test_a_lone_tenant_may_use_the_whole_queue(writers):
    w, _sink = blocked_writer(writers, max_items=5)
    assert submit_without_blocking(w, [WriteItem(1, i) for i in range(10)]) == 5
    assert w.by_tenant[""] == {"accepted": 6, "refused": 5, "written": 0, "failed": 0}


def test_refusals_are_logged_per_tenant(writers):
    import structlog

    w, _sink = blocked_writer(writers, max_items=2)
    with structlog.testing.capture_logs() as logs:
        w.submit([WriteItem(1, "a")] * 5, tenant="acme")
        w.submit([WriteItem(1, "b")] * 5, tenant="globex")
        w.submit([WriteItem(1, "c")] * 5, tenant="acme")  # within the second: counted, logged later
    lines = [e for e in logs if e["event"] == "writer refused state (backpressure)"]
    assert [(e["tenant"], e["refused"]) for e in lines] == [("acme", 3), ("globex", 5)]
    assert w.by_tenant["acme"]["refused"] == 8 and w.by_tenant["globex"]["refused"] == 5
