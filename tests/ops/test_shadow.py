"""Shadow evaluation and impact analysis: disagreements counted exactly on known changes, from many threads."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from nexuskv import Kernel, KernelConfig, PlanAction
from nexuskv.ops.replay import Outcome
from nexuskv.ops.shadow import SETTINGS, Disagreements, RuleDiff, Shadow, impact
from nexuskv.policy.loader import Policies, PolicyError
from tests.conftest import SECRET, make_request

ROOT = Path(__file__).resolve().parents[2] / "policies"
CAP = """
[[reuse]]
name = "cap-512"
when = "match.tokens > 512"
max_tokens = "512"
"""


@pytest.fixture
def dirs(tmp_path):
    old = shutil.copytree(ROOT, tmp_path / "old")
    new = shutil.copytree(ROOT, tmp_path / "new")
    with open(new / "tenants" / "chat.toml", "a") as f:
        f.write(CAP)
    return old, new


def kernel(old: Path, tmp_path: Path, **kw) -> Kernel:
    cfg = KernelConfig(node="n1", policies=str(old), deadline_ms=60_000.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}}, **kw)  # fmt: skip
    return Kernel(cfg, secret=SECRET)


def requests(k: Kernel, n: int = 24):
    out = []
    for i in range(n):
        tenant = ("chat", "rag", "globex")[i % 3]
        req = make_request(range(i * 2000, i * 2000 + 64 * (i + 1)), tenant=tenant, request_id=f"r{i}")
        keys = k.keys(req)
        k.commit(req, [bytes(64)] * len(keys), keys=keys)
        out.append(req)
    assert k.flush(10)
    return out


def expected(plans) -> int:
    """The reference: the cap changes exactly chat's plans that reuse more than 512 tokens."""
    return sum(1 for p in plans if p.tenant == "chat" and p.tokens_reused > 512)


def test_shadow_counts_the_disagreements_of_a_known_change(dirs, tmp_path):
    old, new = dirs
    with kernel(old, tmp_path) as k:
        reqs = requests(k)
        assert k.shadow_report() is None
        revision = k.shadow_policies(new)
        plans = [k.plan(r) for r in reqs]
        report = k.shadow_report(wait_s=10)
        want = expected(plans)
        assert want >= 3 and report.candidate == revision and report.baseline == k.policy_revision
        assert (report.compared, report.disagreed) == (len(plans), want)
        assert report.by_rule == {"cap-512": want} and report.by_change == {"tokens_reused": want, "rules": want}
        assert report.transitions == {} and report.dropped == report.failed == report.incomplete == 0
        ex = report.examples[0]
        assert ex["after"].startswith("materialize 512 tokens") and ex["rules"] == ["cap-512"]
        assert [p.tokens_reused for p in plans] == [k.plan(r).tokens_reused for r in reqs]  # plans untouched
        assert k.shadow_policies(None) is None and k.shadow_report() is None


def test_shadow_from_many_threads_matches_the_reference(dirs, tmp_path):
    old, new = dirs
    with kernel(old, tmp_path) as k:
        reqs = requests(k)
        k.shadow_policies(new)
        plans = []
        lock = threading.Lock()

        def worker(i):
            for r in reqs[i::8] * 5:
                p = k.plan(r)
                with lock:
                    plans.append(p)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report = k.shadow_report(wait_s=20)
        assert report.dropped == 0 and report.compared == len(plans) == 5 * len(reqs)
        assert report.disagreed == expected(plans) == report.by_rule["cap-512"]


def test_a_broken_candidate_is_refused_and_nothing_changes(dirs, tmp_path):
    old, new = dirs
    (new / "tenants" / "chat.toml").write_text('name = "chat"\n[[reuse]]\nname = "x"\nwhen = "1"\n')
    with kernel(old, tmp_path) as k:
        with pytest.raises(PolicyError):
            k.shadow_policies(new)
        assert k.shadow_report() is None


def test_the_config_starts_a_shadow(dirs, tmp_path):
    old, new = dirs
    with kernel(old, tmp_path, policy_shadow=str(new)) as k:
        reqs = requests(k, 6)
        plans = [k.plan(r) for r in reqs]
        assert k.shadow_report(wait_s=10).disagreed == expected(plans)


def test_a_shadow_behind_drops_and_counts(dirs):
    old, new = dirs
    live, cand = Policies.load(old), Policies.load(new)
    gate = threading.Event()

    class Slow:
        tier_order = ("dram",)

        def decide(self, inputs, policies):
            gate.wait(10)
            raise RuntimeError("replay broke")

    shadow = Shadow(cand, Slow(), max_queued=2)
    try:
        for i in range(6):  # one in the thread, two queued, three dropped
            shadow.offer(object(), live, f"d{i}")
        gate.set()
        assert shadow.drain(10)
        report = shadow.report()
        assert report.dropped >= 3 and report.failed == 6 - report.dropped and report.compared == 0
    finally:
        shadow.close()


def test_disagreements_attribute_setting_changes():
    d = Disagreements(max_examples=1)
    a = Outcome("materialize", 512, "dram", ())
    assert d.add("x", "t", a, Outcome("recompute", 0, "", ())) == ["action", "tokens_reused", "tier"]
    d.add("y", "t", a, a)
    d.add("z", "t", a, Outcome("recompute", 0, "", ("deny-all",)))
    r = d.report("old", "new")
    assert (r.compared, r.disagreed, len(r.examples)) == (3, 2, 1)
    assert r.by_rule == {SETTINGS: 1, "deny-all": 1} and r.transitions == {"materialize -> recompute": 2}


def test_impact_replays_a_recorded_log(dirs, tmp_path):
    old, new = dirs
    log = tmp_path / "decisions.jsonl"
    with kernel(old, tmp_path, decision_file=str(log), decision_inputs=("chat", "rag")) as k:
        plans = [k.plan(r) for r in requests(k)]
        k.plan(make_request(range(64), tenant="chat"), deadline_ms=0.0)  # a fallback: recorded, not replayed
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0]["record"] == "context" and records[0]["planner"]["tier_order"] == ["dram"]
    assert len(records) == 1 + len(plans) + 1
    assert all(("inputs" in r) == (r["tenant"] in ("chat", "rag") and not r["fallback"]) for r in records[1:])
    assert not any(str(list(range(64))[1:20])[1:-1] in line for line in log.read_text().splitlines()[1:])
    report, skipped = impact(records, Policies.load(old), Policies.load(new))
    with_inputs = [p for p in plans if p.tenant in ("chat", "rag")]
    assert report.compared == len(with_inputs) and report.disagreed == expected(plans)
    assert skipped == {"without inputs": sum(p.tenant == "globex" for p in plans), "fallbacks": 1}
    same, skipped = impact(records, Policies.load(old), Policies.load(old))
    assert same.disagreed == 0 and "differs_from_record" not in skipped
    assert {p.action for p in with_inputs} >= {PlanAction.MATERIALIZE}


def test_a_rule_edited_in_place_is_blamed_and_unreplayable_kinds_are_named(dirs, tmp_path):
    _old, new = dirs
    edited = shutil.copytree(new, tmp_path / "edited")
    chat = edited / "tenants" / "chat.toml"
    chat.write_text(chat.read_text().replace('max_tokens = "512"', 'max_tokens = "256"')
                    .replace('priority = 1000.0', 'priority = 10.0'))  # fmt: skip
    log = tmp_path / "d.jsonl"
    with kernel(new, tmp_path, decision_file=str(log), decision_inputs=("*",)) as k:
        plans = [k.plan(r) for r in requests(k)]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    report, _ = impact(records, Policies.load(new), Policies.load(edited))
    capped = sum(1 for p in plans if p.tenant == "chat" and p.tokens_reused == 512)
    assert capped >= 3 and report.disagreed == capped and report.by_rule == {"cap-512": capped}
    assert RuleDiff(Policies.load(new), Policies.load(edited)).not_replayed() == ["place chat/system-prompt-pinned"]


def test_offers_after_close_are_dropped_and_close_never_raises(dirs):
    _old, new = dirs
    shadow = Shadow(Policies.load(new), object(), max_queued=1)
    shadow.close()
    shadow.offer(object(), None, "late")
    shadow.close()  # twice: still fine
    assert shadow.report().dropped == 1 and shadow.drain(1)


def test_rule_diff_sees_variables_share_owners_and_settings(tmp_path):
    def policies(cap: str, tier: str, share_when: str) -> Policies:
        root = tmp_path / f"{cap}-{tier}-{len(share_when)}"
        (root / "tenants").mkdir(parents=True)
        (root / "default.toml").write_text(
            f'name = "default"\ndefault_tier = "{tier}"\n[variables]\ncap = "{cap}"\n'
            '[[reuse]]\nname = "cap-by-variable"\nwhen = "match.tokens > 100"\nmax_tokens = "variables.cap"\n')
        (root / "tenants" / "rag.toml").write_text(
            f'name = "rag"\n[[share]]\nname = "docs-out"\nscope = "docs"\ntenants = ["chat"]\n'
            f"when = '{share_when}'\n")
        return Policies.load(root)

    old = policies("256", "dram", "true")
    diff = RuleDiff(old, policies("128", "dram", "true"))
    assert diff.edited("chat") == {"cap-by-variable"}  # the rule reads a variable that changed
    capped = Outcome("materialize", 256, "dram", ("cap-by-variable",))
    assert diff.blame("chat", capped, Outcome("materialize", 128, "dram", ("cap-by-variable",))) == ["cap-by-variable"]
    revoked = RuleDiff(old, policies("256", "disk", 'request.tenant == "nobody"'))
    shared = Outcome("materialize", 256, "dram", (), "rag/docs")
    assert revoked.blame("chat", shared, Outcome("recompute", 0, "", ())) == ["share rag/docs-out"]
    assert revoked.not_replayed() == ["setting default/default_tier", "setting rag/default_tier"]
