"""The policy channel on etcd: its contract on a real etcd, and a rollout to three kernel processes on loopback."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from etcd3gw.utils import _decode, _encode

from nexuskv import BundleError, LivePolicies, PolicyBundle, PolicyChannel, Rollout
from nexuskv.cli import cli
from nexuskv_etcd import EtcdControlPlane
from nexuskv_etcd.policy import MAX_BUNDLE_BYTES, EtcdPolicyChannel
from nexuskv_etcd.view import range_of

WAIT_S = 20.0

V1 = """name = "default"

[[reuse]]
name = "worth-a-page"
when = "match.tokens < request.layout.page_size"
message = "match shorter than one page"
"""

# `region_of` is a CEL function of the `geo` plugin: nodes without it cannot load this revision.
V2 = V1 + """
[[reuse]]
name = "same-region"
description = "State written in another region is not reused (the geo plugin names a node's region)."
when = 'region_of(node) == "moon"'
message = "state from the moon region is never reused"
"""
V2_RULE_LINE = V2.splitlines().index("""when = 'region_of(node) == "moon"'""") + 1

BROKEN = V1 + """
[[reuse]]
name = "bad-compare"
when = 'match.tokens < "x"'
message = "never"
"""


def wait_until(cond, timeout: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def policy_dir(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "default.toml").write_text(text)
    return root


@pytest.fixture
def plane(etcd_server, prefix):
    p = EtcdControlPlane(etcd_server.endpoint, prefix=prefix, watch=False)
    yield p
    p.close()


# ------------------------------------------------------------------------------------------ the channel


def test_the_channel_round_trips(plane, tmp_path):
    ch = plane.policy_channel()
    assert isinstance(ch, PolicyChannel)
    assert ch.current() is None and ch.history() == [] and ch.reports() == {}
    b1 = PolicyBundle.from_directory(policy_dir(tmp_path / "v1", V1), note="first")
    b2 = PolicyBundle.from_directory(policy_dir(tmp_path / "v2", V2), note="second")
    ch.publish(b1)
    ch.publish(b2)
    assert ch.current() == b2.revision
    assert ch.fetch(b2.revision).files == b2.files and ch.fetch(b2.revision).note == "second"
    assert ch.fetch(b1.revision).files == b1.files  # kept for rollback
    ch.publish(b1)
    assert [(r, n) for r, _, n in ch.history()] == [(b1.revision, "first"), (b2.revision, "second"),
                                                    (b1.revision, "first")]  # fmt: skip
    ch.report("n1", {"node": "n1", "serving": b1.revision, "status": "applied"})
    ch.report("n1", {"node": "n1", "serving": b1.revision, "status": "unchanged"})
    assert ch.reports() == {"n1": {"node": "n1", "serving": b1.revision, "status": "unchanged"}}
    with pytest.raises(BundleError, match="no bundle of revision 0123456789abcdef"):
        ch.fetch("0123456789abcdef")
    ch.close()  # a plane's channel leaves the plane's connection open
    assert plane.epoch() > 0


def test_publish_is_one_transaction(plane, prefix, tmp_path):
    ch = plane.policy_channel()
    bundle = PolicyBundle.from_directory(policy_dir(tmp_path / "v1", V1))
    ch.publish(bundle)
    _, kvs = range_of(plane._post, prefix + "policy/")
    written = {_decode(kv["key"]).decode()[len(prefix):]: int(kv["mod_revision"]) for kv in kvs}
    assert {k.split("/")[1] for k in written} == {"bundles", "current", "history"}
    assert len(set(written.values())) == 1  # bundle, history entry and current: one etcd revision


def test_a_reader_never_sees_a_missing_or_damaged_bundle(etcd_server, prefix, plane):
    bundles = [PolicyBundle({"default.toml": V1 + f"# {i}\n"}) for i in range(50)]
    done, seen, errors = threading.Event(), set(), []

    def read() -> None:
        reader = EtcdControlPlane(etcd_server.endpoint, prefix=prefix, watch=False)  # its own connection
        try:
            ch = reader.policy_channel()
            while not done.is_set():
                try:
                    rev = ch.current()
                    if rev is not None:
                        assert ch.fetch(rev).revision == rev
                        seen.add(rev)
                except Exception as exc:
                    errors.append(repr(exc))
        finally:
            reader.close()

    t = threading.Thread(target=read)
    t.start()
    try:
        ch = plane.policy_channel()
        for b in bundles:
            ch.publish(b)
    finally:
        done.set()
        t.join(timeout=WAIT_S)
    assert errors == [] and len(seen) > 1
    assert [r for r, _, _ in ch.history()] == [b.revision for b in bundles]


def test_damaged_and_oversized_bundles_are_refused(plane, prefix, tmp_path):
    ch = plane.policy_channel()
    good = PolicyBundle.from_directory(policy_dir(tmp_path / "v1", V1))
    ch.publish(good)
    data = json.loads(good.to_json())
    data["files"]["default.toml"] += "# edited on the way\n"
    plane._post("/kv/put", {"key": _encode(f"{prefix}policy/bundles/{good.revision}"),
                            "value": _encode(json.dumps(data))})  # fmt: skip
    with pytest.raises(BundleError, match="does not match its content"):
        ch.fetch(good.revision)
    live = LivePolicies(None)  # a node that waits for its first bundle
    rep = Rollout(live, ch, "n1").poll_once()
    assert rep["status"] == "failed" and rep["serving"] == "" and "does not match" in rep["problems"][0]
    assert ch.reports()["n1"]["status"] == "failed"

    huge = PolicyBundle({"default.toml": V1 + "#" * MAX_BUNDLE_BYTES + "\n"})
    with pytest.raises(BundleError, match=r"at most 1048576 .*shared directory"):
        ch.publish(huge)
    assert ch.current() == good.revision  # nothing of it was written


def test_a_rollout_on_etcd_survives_etcd_going_away(own_etcd_server, prefix, tmp_path):
    srv = own_etcd_server
    plane = EtcdControlPlane(srv.endpoint, prefix=prefix, timeout_s=0.3, watch=False)
    try:
        ch = plane.policy_channel()
        live = LivePolicies(policy_dir(tmp_path / "v1", V1))
        node = Rollout(live, ch, "n1")
        assert node.poll_once()["status"] == "unchanged"
        srv.kill()
        rep = node.poll_once()
        assert rep["status"] == "unreachable" and rep["error"].startswith("current: ") and len(rep["error"]) > 20
        srv.start()
        b2 = PolicyBundle({"default.toml": V1 + "# two\n"})
        assert wait_until(lambda: _try(lambda: ch.publish(b2)))
        assert wait_until(lambda: (node.poll_once() or {}).get("serving") == b2.revision)
        assert ch.reports()["n1"]["status"] == "applied"
    finally:
        plane.close()


def _try(fn) -> bool:
    try:
        fn()
        return True
    except Exception:
        return False


# ------------------------------------------------------------------------------------------ three processes

NODE = r'''
"""One kernel process of the rollout test: it answers `plan` and `quit` on stdin, one JSON line each."""
import json
import sys

from nexuskv import Kernel, KernelConfig, Layout, ModelIdentity, Request, StateGroup, TokenizerIdentity, hookimpl
from nexuskv import PluginManager


class Geo:
    @hookimpl
    def nexuskv_register_cel_functions(self, register):
        register("region_of", lambda node: node.partition("-")[0], ["string"], "string")


config, plugin = sys.argv[1], sys.argv[2]
pm = PluginManager()
if plugin == "geo":
    pm.register(Geo(), "geo")
kernel = Kernel(KernelConfig.from_toml(config), plugins=pm, secret=bytes(32))
# The kernel follows the channel itself (`policy_rollout`); a kernel that does not yet: follow it here.
rollout = getattr(kernel, "rollout", None) or getattr(getattr(kernel, "policy_ops", None), "rollout", None)
own = rollout is None
if own:

    rollout = Rollout(kernel.live, kernel.control.policy_channel(), kernel.node,
                      kernel.config.policy_rollout_interval_s).start()
print(json.dumps({"ready": kernel.node, "own_rollout": own}), flush=True)
req = Request(request_id="r", tenant="acme", model=ModelIdentity(name="tiny", revision="1"),
              tokenizer=TokenizerIdentity(name="tok"),
              layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16),
              token_ids=list(range(64)))
for line in sys.stdin:
    if line.strip() == "plan":
        plan = kernel.plan(req)
        print(json.dumps({"policy_revision": plan.policy_revision, "serving": kernel.live.revision,
                          "action": str(plan.action), "reasons": list(plan.reasons)}), flush=True)
    elif line.strip() == "quit":
        break
if own:
    rollout.close()
kernel.close()
print(json.dumps({"closed": kernel.node}), flush=True)
'''


class NodeProcess:
    """A kernel in its own process; `ask(command)` writes a line and waits for its JSON answer."""

    def __init__(self, script: Path, config: Path, plugin: str, log: Path) -> None:
        self.log = log
        env = {**os.environ, "NEXUSKV_PLUGINS": "etcd"}  # entry points: the etcd plugin only (a quicker start)
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(script), str(config), plugin], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1, env=env)  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def answer(self, timeout: float = WAIT_S) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer within {timeout} s; its log: {self.stderr()}") from None
        if line is None:
            raise AssertionError(f"the node exited ({self.proc.poll()}); its log: {self.stderr()}")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(timeout=WAIT_S)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=WAIT_S)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def node_config(tmp_path: Path, node: str, endpoint: str, prefix: str, policies: Path) -> Path:
    path = tmp_path / f"{node}.toml"
    path.write_text(f"""node = "{node}"
lease_ttl_s = 2.0
deadline_ms = 5000.0  # three busy processes: a 1 ms deadline would make a plan fall back, naming no revision
policies = "{policies}"
policy_rollout = "control-plane"
policy_rollout_interval_s = 0.2

[tiers.dram]
store = "dram"
capacity_bytes = "1MiB"

[control_plane]
name = "etcd"
endpoint = "{endpoint}"
prefix = "{prefix}"
timeout_s = 1.0
""")
    return path


def test_a_rollout_to_three_processes_one_of_which_cannot_load_it_then_a_rollback(etcd_server, prefix, tmp_path):
    v1, v2 = policy_dir(tmp_path / "v1", V1), policy_dir(tmp_path / "v2", V2)
    rev1, rev2 = PolicyBundle.from_directory(v1).revision, PolicyBundle.from_directory(v2).revision
    script = tmp_path / "node.py"
    script.write_text(NODE)
    plugins = {"eu-1": "geo", "eu-2": "geo", "us-1": "none"}  # us-1 lacks the plugin `region_of` comes from
    channel = EtcdPolicyChannel.connect(etcd_server.endpoint, prefix)
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(cli, ["--log-level", "error", "policy", *args, "--etcd", etcd_server.endpoint,
                                   "--prefix", prefix], catch_exceptions=False)  # fmt: skip

    def reports_show(want: dict[str, tuple[str, str, str]]) -> bool:
        """Every node's (status, serving, wanted) is as wanted."""
        got = channel.reports()
        return all(n in got and (got[n]["status"], got[n]["serving"], got[n]["wanted"]) == w for n, w in want.items())

    nodes: dict[str, NodeProcess] = {}
    try:
        for name, plugin in plugins.items():
            cfg = node_config(tmp_path, name, etcd_server.endpoint, prefix, v1)
            nodes[name] = NodeProcess(script, cfg, plugin, tmp_path / f"{name}.log")
        for name, node in nodes.items():
            ready = node.answer(60.0)
            assert ready["ready"] == name, ready
            print(name, "follows the channel through", "its own Rollout" if ready["own_rollout"] else "Kernel.rollout")
        # Each node reports at start, before any rollout: what it serves, nothing wanted yet.
        assert wait_until(lambda: reports_show({n: ("unchanged", rev1, None) for n in nodes})), channel.reports()
        plans = {n: p.ask("plan") for n, p in nodes.items()}
        assert {n: a["policy_revision"] for n, a in plans.items()} == dict.fromkeys(nodes, rev1), plans
        # The fleet's first publish: the revision every node serves already (what a rollback comes back to).
        res = run("publish", str(v1), "--note", "baseline")
        assert res.exit_code == 0 and res.stdout.strip() == rev1 == channel.current()
        assert wait_until(lambda: reports_show({n: ("unchanged", rev1, rev1) for n in nodes})), channel.reports()

        # This machine lacks the geo plugin too: the CLI refuses the bundle unless forced.
        res = run("publish", str(v2))
        assert res.exit_code == 1 and "region_of" in res.stderr and channel.current() == rev1
        res = run("publish", str(v2), "--force", "--note", "same-region rule")
        assert res.exit_code == 0 and res.stdout.strip() == rev2 == channel.current()

        want = {"eu-1": ("applied", rev2, rev2), "eu-2": ("applied", rev2, rev2), "us-1": ("failed", rev1, rev2)}
        assert wait_until(lambda: reports_show(want)), channel.reports()
        [problem] = channel.reports()["us-1"]["problems"]
        assert problem.startswith(f"bundle:{rev2}/default.toml:{V2_RULE_LINE}:") and "rule same-region" in problem
        assert "region_of" in problem
        # Each node plans with the revision it reports.
        plans = {n: p.ask("plan") for n, p in nodes.items()}
        assert {n: a["policy_revision"] for n, a in plans.items()} == {"eu-1": rev2, "eu-2": rev2, "us-1": rev1}, plans
        assert all(a["serving"] == a["policy_revision"] for a in plans.values())

        res = run("rollout-status")
        assert res.exit_code == 1, res.output  # a node failed to load the current revision
        lines = res.stdout.splitlines()
        assert lines[0].startswith(f"current: {rev2}") and lines[0].endswith(": same-region rule")
        assert [ln.split()[:4] for ln in lines[2:] if not ln.startswith(" ")][:3] == [
            ["eu-1", rev2, rev2, "applied"], ["eu-2", rev2, rev2, "applied"], ["us-1", rev1, rev2, "failed"]]
        assert f"    {problem}" in lines and lines[-1].startswith("2/3 nodes serve the current revision; 1 failed")

        # Roll back: publish the previous revision again; every node serves it (us-1 never left it).
        res = run("rollback")
        assert res.exit_code == 0 and res.stdout.strip() == rev1 == channel.current()
        want = {"eu-1": ("applied", rev1, rev1), "eu-2": ("applied", rev1, rev1), "us-1": ("unchanged", rev1, rev1)}
        assert wait_until(lambda: reports_show(want)), channel.reports()
        plans = {n: p.ask("plan") for n, p in nodes.items()}
        assert {n: a["policy_revision"] for n, a in plans.items()} == dict.fromkeys(nodes, rev1), plans
        res = run("rollout-status")
        assert res.exit_code == 0 and res.stdout.splitlines()[-1].startswith("3/3 nodes serve")
        history = [(r, n) for r, _, n in channel.history()]
        assert history == [(rev1, "baseline"), (rev2, "same-region rule"), (rev1, f"rollback from {rev2}")]
    finally:
        for node in nodes.values():
            node.stop()
        channel.close()
    assert all(node.proc.returncode == 0 for node in nodes.values()), {n: p.stderr() for n, p in nodes.items()}
