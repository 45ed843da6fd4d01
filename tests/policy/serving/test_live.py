"""LivePolicies: atomic replacement, refusal of a broken revision whole, the watcher, and concurrent reloads."""

import io
import json
import os
import threading
import time

import pytest

from nexuskv.logs import configure_logging
from nexuskv.policy.bundle import PolicyBundle
from nexuskv.policy.loader import Policies, PolicyError
from nexuskv.policy.serving.live import LivePolicies
from tests.conftest import wait_for
from tests.policy.test_loader import write


def policy(tag: str, extra: str = "") -> dict[str, str]:
    return {"default.toml": f'name = "default"\n[[reuse]]\nname = "{tag}"\nwhen = "match.tokens < 16"\n{extra}',
            "tenants/acme.toml": 'name = "acme"\n'}


BROKEN = {"default.toml": 'name = "default"\n[[reuse]]\nname = "bad"\nwhen = "match.tokens > \\"x\\""\n'}




def test_reload_swaps_in_a_new_revision_and_reports_it(tmp_path):
    root = write(tmp_path, policy("a"))
    live = LivePolicies(root)
    first = live.current
    assert live.revision == first.revision and not live.waiting
    write(tmp_path, policy("b"))
    got = live.reload()
    assert got.applied and got.ok and got.previous == first.revision and got.revision == live.revision
    assert live.current is not first and live.current.for_tenant("acme").rule_names("reuse") == ["b"]
    again = live.reload()
    assert again.unchanged and again.ok and not again.applied and live.revision == got.revision
    assert [h.source for h in live.history()] == ["start", "reload", "reload"]


def test_a_broken_revision_is_refused_whole_and_the_old_one_keeps_serving(tmp_path):
    stream = io.StringIO()
    configure_logging(level="info", json=True, stream=stream, force=True)
    root = write(tmp_path, policy("a"))
    live = LivePolicies(root)
    serving = live.current
    write(tmp_path, {**BROKEN, "tenants/acme.toml": 'name = "acme"\n'})
    got = live.reload()
    assert not got.applied and not got.ok and live.current is serving
    (p,) = got.problems
    assert (p.rule, p.line) == ("bad", 4) and p.file.endswith("default.toml")
    configure_logging(force=True)
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    refused = [e for e in events if e["event"] == "policy revision refused"]
    assert refused and refused[0]["rule"] == "bad" and refused[0]["line"] == 4 and refused[0]["column"] > 0
    assert refused[0]["serving"] == serving.revision


def test_a_loader_crash_is_a_refusal_not_an_outage(tmp_path, monkeypatch):
    live = LivePolicies(write(tmp_path, policy("a")))
    serving = live.current

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Policies, "_load", boom)
    got = live.reload()
    assert not got.ok and "disk on fire" in got.problems[0].message and live.current is serving


def test_apply_a_bundle_and_listeners_see_every_result(tmp_path):
    live = LivePolicies(None)
    assert live.waiting and live.revision == ""
    seen = []
    live.listen(seen.append)
    good = PolicyBundle(policy("z"))
    assert live.apply(good).applied and live.revision == good.revision
    assert live.apply(good).unchanged
    bad = live.apply(PolicyBundle(BROKEN))
    assert not bad.ok and live.revision == good.revision and bad.problems[0].file.startswith("bundle:")
    assert [(r.applied, r.unchanged, bool(r.problems)) for r in seen] == [(True, False, False), (False, True, False),
                                                                          (False, False, True)]  # fmt: skip


def test_a_broken_directory_at_start_is_an_error(tmp_path):
    with pytest.raises(PolicyError):
        LivePolicies(write(tmp_path, BROKEN))
    with pytest.raises(ValueError, match="no policy directory"):
        LivePolicies(None).reload()


def test_the_watcher_reloads_on_change_and_refuses_broken_saves(tmp_path):
    root = write(tmp_path, policy("a"))
    live = LivePolicies(root)
    live.watch(debounce_ms=50)
    try:
        time.sleep(0.3)  # the watch is set up
        write(tmp_path, policy("b"))
        assert wait_for(lambda: live.current.for_tenant("acme").rule_names("reuse") == ["b"])
        serving = live.revision
        write(tmp_path, BROKEN)
        assert wait_for(lambda: any(h.problems for h in live.history()))
        assert live.revision == serving and live.history()[-1].source == "watch"
    finally:
        live.close()


def test_concurrent_reloads_and_readers(tmp_path):
    """8 threads reload while 8 read: every read is a whole revision, and the last reload's revision serves."""
    root = write(tmp_path, policy("a"))
    live = LivePolicies(root)
    revisions = {live.revision: "a"}
    for tag in ("b", "c"):
        revisions[Policies.load(write(tmp_path / tag, policy(tag))).revision] = tag
    stop = threading.Event()
    bad: list[str] = []

    def reader():
        while not stop.is_set():
            cur = live.current
            tag = revisions.get(cur.revision)
            names = cur.for_tenant("acme").rule_names("reuse")
            if names != [tag]:
                bad.append(f"{cur.revision} has rules {names}, expected [{tag}]")
            time.sleep(0)  # readers like a scheduler's threads, not spinning: the reloads yield to them

    def reloader(i):
        for n in range(10):  # each save atomic (a deploy tool's rename); the saves race each other
            tmp = tmp_path / f".default.{i}"
            tmp.write_text(policy("b" if (i + n) % 2 else "c")["default.toml"])
            os.replace(tmp, tmp_path / "default.toml")
            live.reload()

    readers = [threading.Thread(target=reader) for _ in range(8)]
    for t in readers:
        t.start()
    writers = [threading.Thread(target=reloader, args=(i,)) for i in range(8)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert bad == []
    assert live.reload().unchanged  # what serves is what the directory holds now
