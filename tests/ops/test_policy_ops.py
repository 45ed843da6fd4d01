"""PolicyOps: a kernel following a rollout channel (waiting, then serving), and its configuration errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexuskv import ConfigError, Kernel, KernelConfig
from nexuskv.policy.bundle import PolicyBundle
from nexuskv.policy.serving.rollout import DirectoryChannel
from tests.conftest import SECRET, make_request, wait_for

ROOT = Path(__file__).resolve().parents[2] / "policies"




def test_a_rollout_node_without_policies_recomputes_and_stores_nothing_until_its_first_bundle(tmp_path):
    channel = DirectoryChannel(tmp_path / "fleet", create=True)
    cfg = KernelConfig(node="n1", policy_rollout=str(tmp_path / "fleet"), policy_rollout_interval_s=0.05,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "1MiB"}})  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        req = make_request(range(64), tenant="chat")
        keys = k.keys(req)
        assert k.policies is None and k.policy_revision == ""
        plan = k.plan(req)
        assert plan.action.value == "recompute" and plan.reasons == ("fail-open: no policy revision serving yet",)
        k.commit(req, [bytes(64)] * len(keys), keys=keys)
        assert k.flush(5) and k.match(req).longest() == 0  # the first block not admitted, the rest orphans
        assert k.writes.unadmitted == 1 and k.writes.orphans == len(keys) - 1
        bundle = PolicyBundle.from_directory(ROOT)
        channel.publish(bundle)
        assert wait_for(lambda: k.policy_revision == bundle.revision)
        assert wait_for(lambda: channel.reports().get("n1", {}).get("status") == "applied")
        k.commit(req, [bytes(64)] * len(keys), keys=keys)
        assert k.flush(5) and k.match(req).longest() == len(keys)
        plan = k.plan(req)
        assert plan.action.value == "materialize" and plan.policy_revision == bundle.revision
        assert k._status()["policy_revision"] == bundle.revision  # what the node publishes to the cluster view


def test_control_plane_rollout_needs_a_plane_with_a_channel():
    cfg = KernelConfig(node="n1", policy_rollout="control-plane")
    with pytest.raises(ConfigError, match="has no policy channel"):
        Kernel(cfg, secret=SECRET)


def test_policy_settings_are_read_from_toml_relative_to_the_file(tmp_path):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "kernel.toml"
    path.write_text('policies = "p"\npolicy_shadow = "cand"\ndecision_file = "d.jsonl"\ndecision_inputs = ["*"]\n'
                    'policy_rollout = "fleet"\npolicy_watch = true\n')  # fmt: skip
    cfg = KernelConfig.from_toml(path)
    assert cfg.policies == str(tmp_path / "conf" / "p") and cfg.policy_shadow == str(tmp_path / "conf" / "cand")
    assert cfg.decision_file == str(tmp_path / "conf" / "d.jsonl") and cfg.decision_inputs == ("*",)
    assert cfg.policy_rollout == str(tmp_path / "conf" / "fleet") and cfg.policy_watch
    path.write_text('policy_rollout = "control-plane"\n')
    assert KernelConfig.from_toml(path).policy_rollout == "control-plane"
    with pytest.raises(ConfigError, match="policy_rollout_interval_s"):
        KernelConfig.from_mapping({"policy_rollout_interval_s": 0})


def test_a_rollout_node_refuses_local_reloads_and_watching(tmp_path):
    cfg = KernelConfig(node="n1", policies=str(ROOT), policy_rollout=str(tmp_path / "fleet"))
    with Kernel(cfg, secret=SECRET) as k, pytest.raises(ValueError, match="publish a bundle"):
        k.reload_policies()  # it would leave the fleet's revision while its reports say otherwise
    with pytest.raises(ConfigError, match="exclude each other"):
        Kernel(KernelConfig(node="n1", policies=str(ROOT), policy_watch=True, policy_rollout=str(tmp_path)),
               secret=SECRET)
