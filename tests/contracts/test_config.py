"""KernelConfig from mappings and TOML files, and the plugin environment a config implies."""

from __future__ import annotations

import pytest

from nexuskv import ConfigError, KernelConfig
from nexuskv.contracts.config import plugin_env


def test_every_key_is_optional():
    cfg = KernelConfig.from_mapping({})
    assert cfg == KernelConfig()
    assert cfg.tiers == {"dram": {"store": "dram", "capacity_bytes": "1GiB"}}


def test_unknown_keys_and_wrong_types_name_the_origin_and_the_path():
    with pytest.raises(ConfigError, match=r"kernel.toml.*bogus"):
        KernelConfig.from_mapping({"bogus": 1}, origin="kernel.toml")
    with pytest.raises(ConfigError, match=r"kernel.toml.*deadline_ms"):
        KernelConfig.from_mapping({"deadline_ms": "soon"}, origin="kernel.toml")
    with pytest.raises(ConfigError, match=r"k.toml: .eviction. must be in \(.cost., .lru.\) \(got .random.\)"):
        KernelConfig.from_mapping({"eviction": "random"}, origin="k.toml")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        KernelConfig.from_toml(tmp_path / "nope.toml")


def test_a_toml_syntax_error_names_the_file(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text("node = \n")
    with pytest.raises(ConfigError, match=str(p)):
        KernelConfig.from_toml(p)


def test_relative_paths_are_relative_to_the_file(tmp_path):
    p = tmp_path / "conf" / "k.toml"
    p.parent.mkdir()
    p.write_text('policies = "pol"\nprofile = "/abs/profile.json"\nsecret_file = "s/secret"\n'
                 '[tiers.disk]\nstore = "disk"\npath = "cache"\n[tiers.far]\nstore = "disk"\npath = "/var/far"\n')
    cfg = KernelConfig.from_toml(p)
    assert cfg.policies == str(p.parent / "pol")
    assert cfg.profile == "/abs/profile.json"
    assert cfg.secret_file == str(p.parent / "s/secret")
    assert cfg.tiers["disk"]["path"] == str(p.parent / "cache")
    assert cfg.tiers["far"]["path"] == "/var/far"


def test_plugin_env_applies_the_allow_and_block_lists_on_top_of_the_environment():
    env = {"NEXUSKV_DISABLE_PLUGINS": "a, ,b", "OTHER": "1"}
    assert plugin_env(KernelConfig(), env) == env
    cfg = KernelConfig(plugins=("x", "y"), disable_plugins=("embedded",))
    got = plugin_env(cfg, env)
    assert got["NEXUSKV_PLUGINS"] == "x,y"
    assert got["NEXUSKV_DISABLE_PLUGINS"] == "a,b,embedded"
    assert got["OTHER"] == "1" and env["NEXUSKV_DISABLE_PLUGINS"] == "a, ,b"  # the input is not changed


def test_the_default_deadline_can_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "2.5")
    assert KernelConfig().deadline_ms == 2.5
    assert KernelConfig.from_mapping({"deadline_ms": 0.3}).deadline_ms == 0.3  # a config file's value wins
    monkeypatch.delenv("NEXUSKV_DEADLINE_MS")
    assert KernelConfig().deadline_ms == 0.5  # the budget's floor (`planning.budget`)
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "soon")
    with pytest.raises(ConfigError, match="NEXUSKV_DEADLINE_MS='soon': expected a number"):
        KernelConfig()


def test_checksum_algorithm_is_validated():
    from nexuskv import ConfigError, KernelConfig

    assert KernelConfig().checksum == "xxh3-128"
    assert KernelConfig.from_mapping({"checksum": "blake2b-128"}).checksum == "blake2b-128"
    with pytest.raises(ConfigError, match="checksum"):
        KernelConfig.from_mapping({"checksum": "md5"}, origin="k.toml")


def test_a_config_in_another_directory_works_from_anywhere(tmp_path, monkeypatch):
    """A new user's layout: the config and its policies in a deploy folder, the process started somewhere else."""
    from nexuskv import Kernel
    from tests.conftest import SECRET

    conf = tmp_path / "deploy" / "conf"
    (conf / "policies").mkdir(parents=True)
    (conf / "policies" / "default.toml").write_text('name = "default"\nmin_gain_ms = 7.0\n')
    (conf / "kernel.toml").write_text('policies = "policies"\ndecision_file = "log/decisions.jsonl"\n'
                                      '[tiers.dram]\nstore = "dram"\n[tiers.shm]\nstore = "shm"\nshm_dir = "shm"\n'
                                      'namespace = "x"\n')  # fmt: skip
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = KernelConfig.from_toml("../deploy/conf/kernel.toml")
    assert cfg.policies == str(conf / "policies") and cfg.decision_file == str(conf / "log" / "decisions.jsonl")
    assert cfg.tiers["shm"] == {"store": "shm", "shm_dir": str(conf / "shm"), "namespace": "x"}  # a path option
    (conf / "kernel.toml").write_text('policies = "policies"\n')
    with Kernel.from_config("../deploy/conf/kernel.toml", secret=SECRET) as k:
        monkeypatch.chdir(tmp_path)  # absolute: a process that changes directory later still finds them
        got = k.reload_policies()
        assert got.ok and got.problems == ()  # read again from the config's directory, not from here
        assert k.policies is not None and k.policies.for_tenant("acme").min_gain_ms == 7.0
    base = KernelConfig.from_mapping({"policies": "policies"}, origin="k.toml", relative_to=conf)  # a file's mapping
    assert base.policies == str(conf / "policies")
    assert KernelConfig.from_mapping({"policies": "policies"}).policies == "policies"  # no file: as given


@pytest.mark.parametrize("key", ["decision_inputs", "transports", "plugins", "disable_plugins"])
def test_a_string_where_a_list_of_strings_is_expected_is_an_error_not_its_characters(tmp_path, key):
    p = tmp_path / "k.toml"
    p.write_text(f'{key} = "chat"\n')
    with pytest.raises(ConfigError) as info:
        KernelConfig.from_toml(p)
    assert str(info.value) == f'{p}: {key}: expected a list of strings, got a string "chat" (write {key} = ["chat"])'
    p.write_text(f'{key} = ["chat"]\n')
    assert getattr(KernelConfig.from_toml(p), key) == ("chat",)
