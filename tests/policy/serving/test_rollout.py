"""Fleet rollout on a shared directory: the channel's contract, a node's `Rollout`, and the CLI around them."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from nexuskv.cli import cli
from nexuskv.policy.bundle import BundleError, PolicyBundle
from nexuskv.policy.serving.live import LivePolicies
from nexuskv.policy.serving.rollout import DirectoryChannel, PolicyChannel, Rollout
from tests.conftest import wait_for

WAIT_S = 10.0

BASE = """name = "default"

[[reuse]]
name = "worth-a-page"
when = "match.tokens < request.layout.page_size"
message = "match shorter than one page"
"""

EXTRA = """
[[reuse]]
name = "long-enough"
when = "match.tokens < 2 * request.layout.page_size"
message = "match shorter than two pages"
"""

# An int compared with a string does not type-check (in default.toml at BAD_AT, the rule `bad-compare`).
BROKEN = """
[[reuse]]
name = "bad-compare"
when = 'match.tokens < "x"'
message = "never"
"""
BAD_AT = f"{(BASE + EXTRA + BROKEN).splitlines().index(BROKEN.splitlines()[3]) + 1}:22"


def policy_dir(root: Path, text: str, tenant: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "default.toml").write_text(text)
    if tenant is not None:
        (root / "tenants").mkdir(exist_ok=True)
        (root / "tenants" / "chat.toml").write_text(tenant)
    return root


@pytest.fixture
def dirs(tmp_path):
    """A good first revision, a good second one (with a tenant), a broken one, and the shared directory."""
    v1 = policy_dir(tmp_path / "v1", BASE)
    v2 = policy_dir(tmp_path / "v2", BASE + EXTRA, tenant='name = "chat"\nmin_gain_ms = 0.2\n')
    bad = policy_dir(tmp_path / "bad", BASE + EXTRA + BROKEN)
    return v1, v2, bad, tmp_path / "shared"


class Flaky:
    """A channel that stops answering while `down` is set (every call raises, like etcd gone)."""

    def __init__(self, inner: PolicyChannel) -> None:
        self.inner = inner
        self.down = False

    def __getattr__(self, name):
        attr = getattr(self.inner, name)

        def call(*args, **kw):
            if self.down:
                raise ConnectionError("channel down")
            return attr(*args, **kw)

        return call


# ------------------------------------------------------------------------------------------ the channel


def test_directory_channel_round_trips(dirs):
    v1, v2, _, shared = dirs
    ch = DirectoryChannel(shared)
    assert isinstance(ch, PolicyChannel)
    with pytest.raises(FileNotFoundError, match="missing"):  # not mounted is not "nothing published"
        ch.current()
    shared.mkdir()
    assert ch.current() is None and ch.history() == [] and ch.reports() == {}
    b1, b2 = PolicyBundle.from_directory(v1, note="first"), PolicyBundle.from_directory(v2, note="second")
    ch.publish(b1)
    ch.publish(b2)
    assert ch.current() == b2.revision
    got = ch.fetch(b2.revision)
    assert got.files == b2.files and got.note == "second" and "tenants/chat.toml" in got.files
    assert ch.fetch(b1.revision).files == b1.files  # kept for rollback
    assert [(r, n) for r, _, n in ch.history()] == [(b1.revision, "first"), (b2.revision, "second")]
    assert all(abs(at - time.time()) < 60 for _, at, _ in ch.history())
    ch.report("node/a b", {"node": "node/a b", "serving": b2.revision})  # a name that is no file name
    assert ch.reports() == {"node/a b": {"node": "node/a b", "serving": b2.revision}}
    with pytest.raises(BundleError, match="no bundle of revision 0123456789abcdef"):
        ch.fetch("0123456789abcdef")
    with pytest.raises(BundleError, match="not a bundle revision"):
        ch.fetch("../current")
    assert not list(shared.rglob("*.tmp"))


def test_a_reader_never_sees_a_missing_or_damaged_bundle(tmp_path):
    ch = DirectoryChannel(tmp_path / "shared")
    bundles = [PolicyBundle({"default.toml": BASE + f"# {i}\n"}) for i in range(50)]
    done, seen, errors = threading.Event(), set(), []

    def read() -> None:
        reader = DirectoryChannel(tmp_path / "shared")  # its own object, as another process would have
        while not done.is_set():
            try:
                rev = reader.current()
                if rev is not None:
                    assert reader.fetch(rev).revision == rev
                    seen.add(rev)
            except FileNotFoundError:  # before the first publish made the directory
                continue
            except Exception as exc:
                errors.append(repr(exc))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for b in bundles:
            ch.publish(b)
    finally:
        done.set()
        for t in readers:
            t.join(timeout=WAIT_S)
    assert errors == []
    assert len(seen) > 1 and seen <= {b.revision for b in bundles}
    assert [r for r, _, _ in ch.history()] == [b.revision for b in bundles]


PUBLISHER = """
import sys
from nexuskv.policy.bundle import PolicyBundle
from nexuskv.policy.serving.rollout import DirectoryChannel
ch = DirectoryChannel(sys.argv[1])
for i in range(20):
    ch.publish(PolicyBundle({"default.toml": 'name = "default"\\n# ' + sys.argv[2] + str(i) + "\\n"}, note=sys.argv[2]))
"""


def test_processes_publishing_at_once_keep_every_history_line(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", PUBLISHER, str(shared), who]) for who in ("a", "b", "c")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    ch = DirectoryChannel(shared)
    history = ch.history()
    assert len(history) == 60 and sorted(n for _, _, n in history) == ["a"] * 20 + ["b"] * 20 + ["c"] * 20
    assert len((shared / "history.jsonl").read_text().splitlines()) == 60  # no line lost or torn
    assert ch.current() in {r for r, _, _ in history} and ch.fetch(ch.current()).revision == ch.current()


# ------------------------------------------------------------------------------------------ a node's rollout


def test_rollout_applies_refuses_and_reports(dirs):
    v1, v2, bad, shared = dirs
    ch = DirectoryChannel(shared)
    live = LivePolicies(v1)
    first = live.revision
    node = Rollout(live, ch, "n1", interval_s=0.05)
    shared.mkdir()
    start = node.poll_once()  # the first poll reports, before anything was published
    assert start is not None and start["status"] == "unchanged" and start["serving"] == first
    assert start["wanted"] is None and ch.reports()["n1"]["serving"] == first
    assert node.poll_once() is None  # nothing new: nothing owed

    b2 = PolicyBundle.from_directory(v2)
    ch.publish(b2)
    rep = node.poll_once()
    assert rep["status"] == "applied" and rep["serving"] == rep["wanted"] == b2.revision == live.revision
    assert set(live.current.tenants()) == {"default", "chat"}
    assert ch.reports()["n1"] == rep and node.last_report == rep

    broken = PolicyBundle.from_directory(bad)
    ch.publish(broken)
    rep = node.poll_once()
    assert rep["status"] == "failed" and rep["wanted"] == broken.revision
    assert rep["serving"] == b2.revision == live.revision  # refused whole: the node keeps serving
    [problem] = rep["problems"]
    assert problem.startswith(f"bundle:{broken.revision}/default.toml:{BAD_AT}: rule bad-compare: ")
    assert node.poll_once() is None  # a failed revision is not tried again on every poll

    ch.publish(PolicyBundle.from_directory(v1))  # rollback: the previous revision published again
    rep = node.poll_once()
    assert rep["status"] == "applied" and rep["serving"] == first == live.revision and rep["problems"] == []
    assert [r.source for r in live.history()][-3:] == ["rollout", "rollout", "rollout"]


def test_a_node_already_serving_the_current_revision_reports_unchanged(dirs):
    v1, _, _, shared = dirs
    ch = DirectoryChannel(shared)
    ch.publish(PolicyBundle.from_directory(v1))
    live = LivePolicies(v1)
    rep = Rollout(live, ch, "n2").poll_once()
    assert rep["status"] == "unchanged" and rep["serving"] == rep["wanted"] == live.revision


def test_a_damaged_bundle_is_refused_and_reported(dirs):
    v1, v2, _, shared = dirs
    ch = DirectoryChannel(shared)
    b2 = PolicyBundle.from_directory(v2)
    ch.publish(b2)
    path = shared / "bundles" / f"{b2.revision}.json"
    data = json.loads(path.read_text())
    data["files"]["default.toml"] += "\n# edited on the way\n"
    path.write_text(json.dumps(data))
    with pytest.raises(BundleError, match="does not match its content"):
        ch.fetch(b2.revision)
    path.write_text(path.read_text()[:40])  # cut short
    with pytest.raises(BundleError, match="not JSON"):
        ch.fetch(b2.revision)
    live = LivePolicies(v1)
    rep = Rollout(live, ch, "n1").poll_once()
    assert rep["status"] == "failed" and rep["serving"] == live.revision != b2.revision
    assert b2.revision in rep["problems"][0] and "not JSON" in rep["problems"][0]


def test_an_unreachable_channel_is_asked_again_and_the_node_reports_when_it_answers(dirs):
    v1, v2, _, shared = dirs
    inner = DirectoryChannel(shared)
    inner.publish(PolicyBundle.from_directory(v1))
    ch = Flaky(inner)
    live = LivePolicies(v1)
    node = Rollout(live, ch, "n1")
    assert node.poll_once()["status"] == "unchanged"
    b2 = PolicyBundle.from_directory(v2)
    inner.publish(b2)
    ch.down = True
    for _ in range(3):  # never raises; every poll tries again
        rep = node.poll_once()
        assert rep["status"] == "unreachable" and "channel down" in rep["error"]
        assert rep["serving"] == live.revision != b2.revision
    assert inner.reports()["n1"]["status"] == "unchanged"  # (the report could not be written either)
    ch.down = False
    rep = node.poll_once()
    assert rep["status"] == "applied" and rep["serving"] == b2.revision and inner.reports()["n1"] == rep
    assert node.poll_once() is None


def test_a_report_that_could_not_be_written_is_written_at_the_next_poll(dirs):
    v1, _, _, shared = dirs
    inner = DirectoryChannel(shared, create=True)

    class ReadOnly:
        refuse = True

        def __getattr__(self, name):
            return getattr(inner, name)

        def report(self, node, report):
            if self.refuse:
                raise PermissionError("read-only file system")
            inner.report(node, report)

    ch = ReadOnly()
    node = Rollout(LivePolicies(v1), ch, "n1")
    assert node.poll_once()["status"] == "unchanged" and inner.reports() == {}
    assert node.poll_once() is not None and inner.reports() == {}  # still owed
    ch.refuse = False
    assert node.poll_once() == inner.reports()["n1"]
    assert node.poll_once() is None


def test_the_thread_follows_the_channel_and_stops(dirs):
    v1, v2, bad, shared = dirs
    ch = DirectoryChannel(shared)
    shared.mkdir()
    live = LivePolicies(v1)
    node = Rollout(live, ch, "n1", interval_s=0.02).start()
    try:
        assert wait_for(lambda: "n1" in ch.reports())  # reported at start, before any rollout
        b2 = PolicyBundle.from_directory(v2)
        ch.publish(b2)
        assert wait_for(lambda: live.revision == b2.revision)
        assert wait_for(lambda: ch.reports()["n1"]["status"] == "applied")
        ch.publish(PolicyBundle.from_directory(bad))
        assert wait_for(lambda: ch.reports()["n1"]["status"] == "failed")
        assert live.revision == b2.revision
    finally:
        node.close()
    assert node._thread is not None and not node._thread.is_alive()


# ------------------------------------------------------------------------------------------ the CLI


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, ["--log-level", "error", "policy", *args], catch_exceptions=False)

    return invoke


def test_publish_refuses_a_bundle_that_does_not_load_unless_forced(run, dirs):
    _, _, bad, shared = dirs
    res = run("publish", str(bad), "--to", str(shared))
    assert res.exit_code == 1 and "does not load here" in res.stderr and "--force" in res.stderr
    assert f"{bad.as_posix()}/default.toml:{BAD_AT}: rule bad-compare" in res.stderr  # named by the directory's file
    assert not (shared / "current").exists()
    res = run("publish", str(bad), "--to", str(shared), "--force")
    rev = PolicyBundle.from_directory(bad).revision
    assert res.exit_code == 0 and res.stdout.strip() == rev and DirectoryChannel(shared).current() == rev


def test_publish_needs_one_channel(run, dirs):
    v1, _, _, shared = dirs
    assert run("publish", str(v1)).exit_code == 2
    res = run("publish", str(v1), "--to", str(shared), "--etcd", "127.0.0.1:2379")
    assert res.exit_code == 2 and "one of them" in res.stderr
    res = run("rollout-status", "--to", str(shared))  # not made yet: one line, not a traceback
    assert res.exit_code == 1 and "policy channel" in res.stderr and "missing" in res.stderr


def test_status_and_rollback_through_the_cli(run, dirs):
    v1, v2, bad, shared = dirs
    ch = DirectoryChannel(shared)
    r1 = run("publish", str(v1), "--to", str(shared), "--note", "first")
    r2 = run("publish", str(v2), "--to", str(shared), "--note", "second")
    assert r1.exit_code == r2.exit_code == 0
    rev1, rev2 = r1.stdout.strip(), r2.stdout.strip()
    assert f"previous: {rev1}" in r2.stderr
    again = run("publish", str(v2), "--to", str(shared))
    assert again.exit_code == 0 and "already current" in again.stderr and len(ch.history()) == 2

    nodes = [Rollout(LivePolicies(v1), ch, "n1"), Rollout(LivePolicies(v1), ch, "n2")]
    for n in nodes:
        n.poll_once()
    res = run("rollout-status", "--to", str(shared))
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"current: {rev2}, published ") and lines[0].endswith(": second")
    assert lines[1].split() == ["node", "serving", "wanted", "status", "age"]
    assert lines[2].split()[:4] == ["n1", rev2, rev2, "applied"]
    assert lines[-1] == "2/2 nodes serve the current revision; 0 failed to load it"

    assert run("publish", str(bad), "--to", str(shared), "--force").exit_code == 0
    nodes[0].poll_once()
    res = run("rollout-status", "--to", str(shared))
    assert res.exit_code == 1  # a node failed to load the current revision
    n1 = res.stdout.splitlines().index(next(ln for ln in res.stdout.splitlines() if ln.startswith("n1 ")))
    assert res.stdout.splitlines()[n1].split()[:4] == ["n1", rev2, ch.current(), "failed"]
    assert res.stdout.splitlines()[n1 + 1].startswith("    bundle:") and "rule bad-compare" in res.stdout
    data = json.loads(run("rollout-status", "--to", str(shared), "--json").stdout)
    assert data["current"] == ch.current() and data["failed"] == ["n1"] and data["nodes"]["n1"]["status"] == "failed"

    res = run("rollback", "--to", str(shared))  # the revision before the current one
    assert res.exit_code == 0 and res.stdout.strip() == rev2 and ch.current() == rev2
    assert ch.history()[-1][2] == f"rollback from {PolicyBundle.from_directory(bad).revision}"
    for n in nodes:
        n.poll_once()
    assert {n: r["serving"] for n, r in ch.reports().items()} == {"n1": rev2, "n2": rev2}
    assert run("rollout-status", "--to", str(shared)).exit_code == 0

    res = run("rollback", "--to", str(shared), rev1[:8], "--note", "back to the start")  # a named one (prefix)
    assert res.exit_code == 0 and ch.current() == rev1 and ch.history()[-1] == (rev1, ch.history()[-1][1],
                                                                                   "back to the start")
    res = run("rollback", "--to", str(shared), "fedcba9876543210")
    assert res.exit_code == 1 and "no bundle of revision fedcba9876543210" in res.stderr


def test_rollback_with_nothing_before(run, dirs):
    v1, _, _, shared = dirs
    assert run("publish", str(v1), "--to", str(shared)).exit_code == 0
    res = run("rollback", "--to", str(shared))
    assert res.exit_code == 1 and "no revision before" in res.stderr


def test_rollout_status_wait_is_a_deploy_gate(run, dirs):
    v1, v2, _, shared = dirs
    ch = DirectoryChannel(shared, create=True)
    assert run("publish", str(v1), "--to", str(shared)).exit_code == 0
    nodes = [Rollout(LivePolicies(v1), ch, f"n{i}") for i in range(2)]
    for n in nodes:
        n.poll_once()
    assert run("publish", str(v2), "--to", str(shared)).exit_code == 0
    res = run("rollout-status", "--to", str(shared), "--wait", "0.3")  # nobody has polled since: not done
    assert res.exit_code == 2 and "2 not reported on it yet (n0, n1)" in res.stdout
    threading.Timer(0.3, lambda: [n.poll_once() for n in nodes]).start()
    res = run("rollout-status", "--to", str(shared), "--wait", "10")
    last = res.stdout.splitlines()[-1]
    assert res.exit_code == 0 and last == "2/2 nodes serve the current revision; 0 failed to load it"
    ch.report("dead", {"node": "dead", "serving": "x", "wanted": "x", "status": "applied", "at": time.time() - 3600})
    assert run("rollout-status", "--to", str(shared), "--wait", "0.2").exit_code == 2  # it will never report
    assert run("rollout-status", "--to", str(shared), "--wait", "5", "--stale", "60").exit_code == 0
