"""`nexuskv policy diff`: a recorded decision file replayed through two revisions, on the command line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from nexuskv.cli import cli
from nexuskv.policy.bundle import PolicyBundle
from tests.ops.test_shadow import dirs as dirs_fixture
from tests.ops.test_shadow import expected, kernel, requests

dirs = dirs_fixture  # the same fixture: an old and a new policy directory (new caps chat's reuse at 512 tokens)


def record(old, tmp_path, inputs=("*",)):
    log = tmp_path / "decisions.jsonl"
    with kernel(old, tmp_path, decision_file=str(log), decision_inputs=inputs) as k:
        plans = [k.plan(r) for r in requests(k)]
    return log, plans


def test_diff_prints_what_changes_and_exits_1(dirs, tmp_path):
    old, new = dirs
    log, plans = record(old, tmp_path)
    got = CliRunner().invoke(cli, ["policy", "diff", str(old), str(new), "--decisions", str(log), "--examples", "2"])
    n = expected(plans)
    assert got.exit_code == 1, got.output
    assert f"{len(plans)} decisions replayed, {n} change" in got.output
    assert f"cap-512: {n} decisions" in got.output and f"tokens_reused {n}" in got.output
    assert got.output.count("  ->  materialize 512 tokens") == 2


def test_diff_json_and_an_unchanged_revision(dirs, tmp_path):
    old, new = dirs
    log, plans = record(old, tmp_path)
    bundle = tmp_path / "old.json"
    bundle.write_text(PolicyBundle.from_directory(old).to_json())
    got = CliRunner().invoke(cli, ["policy", "diff", str(bundle), str(new), "--decisions", str(log), "--json"])
    data = json.loads(got.output)
    assert data["compared"] == len(plans) and data["disagreed"] == expected(plans) and data["skipped"] == {}
    same = CliRunner().invoke(cli, ["policy", "diff", str(old), str(bundle), "--decisions", str(log)])
    assert same.exit_code == 0 and f"{len(plans)} decisions replayed, 0 change" in same.output


def test_diff_without_inputs_and_with_a_broken_log(dirs, tmp_path):
    old, new = dirs
    log, plans = record(old, tmp_path, inputs=())
    got = CliRunner().invoke(cli, ["policy", "diff", str(old), str(new), "--decisions", str(log)])
    assert got.exit_code == 0 and f"skipped: {len(plans)} without inputs" in got.output
    assert "no decision with inputs to replay" in got.output
    with open(log, "a") as f:
        f.write('{"record": "context", "planner": null}\n{"record": "decision", "fallback": false, "inputs": {}}\n')
        f.write("{torn li")  # a crash mid-write
    bad = CliRunner().invoke(cli, ["policy", "diff", str(old), str(new), "--decisions", str(log)])
    assert bad.exit_code == 0 and f"decisions.jsonl:{len(plans) + 4}: not a JSON line" in bad.output
    assert "1 unreadable lines" in bad.output and "1 without a usable context line" in bad.output
    (new / "default.toml").write_text('name = "default"\nmin_gain_ms = @\n')
    broken = CliRunner().invoke(cli, ["policy", "diff", str(old), str(new), "--decisions", str(log)])
    assert broken.exit_code == 1 and "default.toml:2:15: TOML syntax error" in broken.output
