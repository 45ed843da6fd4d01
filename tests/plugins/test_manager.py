import textwrap

import pytest

from nexuskv import Kernel, KernelConfig, PluginError, PluginManager, hookimpl
from nexuskv.plugins.manager import BUILTINS
from tests.conftest import SECRET


def install_dist(root, dist: str, plugins: dict[str, str], version: str = "1.2.3"):
    """Install a real distribution (dist-info + entry points) into `root`, which is put on sys.path."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "".join(f"{name} = {name.replace('-', '_')}_mod\n" for name in plugins)
    (info / "entry_points.txt").write_text(f"[nexuskv]\n{eps}")
    for name, source in plugins.items():
        (root / f"{name.replace('-', '_')}_mod.py").write_text(textwrap.dedent(source))


GOOD = """
    import nexuskv

    class NullStore:
        def __init__(self, name="null", capacity_bytes=0):
            self.name, self.capacity_bytes = name, capacity_bytes

    @nexuskv.hookimpl
    def nexuskv_register_tier_stores(register):
        register("null", NullStore)

    @nexuskv.hookimpl
    def nexuskv_observe_decision(decision):
        SEEN.append(decision)

    SEEN = []
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtins_are_registered_as_plugins():
    pm = PluginManager(entry_points=False)
    names = {i.name for i in pm.info()}
    assert set(BUILTINS) <= names
    assert pm.problems == []
    assert "dram" in pm.tier_stores() and "local" in pm.transports()
    info = {i.name: i for i in pm.info()}
    assert info["dram"].source == "builtin" and "nexuskv_register_tier_stores" in info["dram"].hooks


def test_entry_point_plugin_found_with_version(site):
    install_dist(site, "nexuskv-null", {"null": GOOD})
    pm = PluginManager(env={})
    info = {i.name: i for i in pm.info()}
    assert info["null"].source == "nexuskv-null" and info["null"].version == "1.2.3"
    assert "null" in pm.tier_stores()
    pm.observe_decision({"decision_id": "d1"})
    import null_mod

    assert null_mod.SEEN == [{"decision_id": "d1"}]


def test_plugin_raising_at_import_is_reported_and_skipped(site):
    install_dist(site, "nexuskv-broken", {"broken": "raise RuntimeError('boom at import')\n"})
    install_dist(site, "nexuskv-null", {"null": GOOD})
    pm = PluginManager(env={})
    assert [(p.plugin, p.stage) for p in pm.problems] == [("broken", "load")]
    assert "boom at import" in pm.problems[0].message
    assert "null" in pm.tier_stores()
    k = Kernel(KernelConfig(), plugins=pm, secret=SECRET)  # the kernel still starts
    assert "dram" in k.tiers
    k.close()


def test_plugin_with_unknown_hook_is_rejected_at_register(site):
    install_dist(site, "nexuskv-typo", {"typo": """
        import nexuskv
        @nexuskv.hookimpl
        def nexuskv_register_tier_store(register):
            pass
    """})
    pm = PluginManager(env={})
    assert [(p.plugin, p.stage) for p in pm.problems] == [("typo", "register")]
    assert "nexuskv_register_tier_store" in pm.problems[0].message


def test_allow_list_loads_only_named_and_reports_missing(site):
    install_dist(site, "nexuskv-null", {"null": GOOD, "other": GOOD.replace('"null"', '"other"')})
    pm = PluginManager(env={"NEXUSKV_PLUGINS": "other, nexuskv-not-installed"})
    names = {i.name for i in pm.info()}
    assert "other" in names and "null" not in names
    assert [(p.plugin, p.stage) for p in pm.problems] == [("nexuskv-not-installed", "allow-list")]
    assert "not installed" in pm.problems[0].message


def test_block_list_applies_to_builtins_and_entry_points(site):
    install_dist(site, "nexuskv-null", {"null": GOOD})
    pm = PluginManager(env={"NEXUSKV_DISABLE_PLUGINS": "null,dram"})
    names = {i.name for i in pm.info()}
    assert "null" not in names and "dram" not in names and "local" in names
    assert pm.problems == []  # both names are known: nothing to report


def test_an_unknown_name_in_the_block_list_is_a_problem_listing_the_known_names(site):
    """A typo (`dram-store` for `dram`) would otherwise block nothing, silently; reported like the allow list's."""
    install_dist(site, "nexuskv-null", {"null": GOOD})
    for entry_points in (True, False):
        pm = PluginManager(env={"NEXUSKV_DISABLE_PLUGINS": "null, dram-store"}, entry_points=entry_points)
        assert [(p.plugin, p.stage) for p in pm.problems] == [("dram-store", "block-list")]
        message = pm.problems[0].message
        assert message.startswith("plugin 'dram-store' is named in NEXUSKV_DISABLE_PLUGINS (or a config's "
                                  "disable_plugins) but no such plugin exists (known: ")  # fmt: skip
        assert "dram, " in message and "null, " in message and "local" in message
        assert "dram" in {i.name for i in pm.info()}  # the typo blocked nothing


def test_registrar_that_raises_is_reported_and_others_still_register():
    class Bad:
        @hookimpl
        def nexuskv_register_tier_stores(self, register):
            register("half", object)
            raise ValueError("registrar broke")

    pm = PluginManager(entry_points=False)
    pm.register(Bad(), "bad")
    stores = pm.tier_stores()
    assert "dram" in stores and "half" not in stores
    assert any(p.plugin == "bad" and "registrar broke" in p.message for p in pm.problems)


def test_duplicate_registration_keeps_first_and_reports():
    class Dup:
        @hookimpl
        def nexuskv_register_tier_stores(self, register):
            register("dram", object)

    pm = PluginManager(entry_points=False)
    pm.register(Dup(), "dup")
    assert pm.tier_stores()["dram"] is not object
    assert any("already registered" in p.message for p in pm.problems)


def test_firstresult_matcher_plugin_wins_over_builtin_and_failures_fall_through():
    sentinel = object()

    class Native:
        @hookimpl
        def nexuskv_matcher(self, config):
            return sentinel if config.get("name") == "native" else None

    class Crashing:
        @hookimpl(tryfirst=True)
        def nexuskv_matcher(self, config):
            raise RuntimeError("native lib missing")

    pm = PluginManager(entry_points=False)
    pm.register(Native(), "native")
    pm.register(Crashing(), "crashing")
    assert pm.matcher({"name": "native"}) is sentinel
    assert type(pm.matcher({})).__name__ == "DictIndex"
    assert any(p.plugin == "crashing" for p in pm.problems)


def test_no_answer_is_a_clear_error():
    pm = PluginManager(env={"NEXUSKV_DISABLE_PLUGINS": "embedded"}, entry_points=False)
    with pytest.raises(PluginError, match="no plugin answered nexuskv_control_plane"):
        pm.control_plane({})


def test_observer_exceptions_are_swallowed():
    class Loud:
        @hookimpl
        def nexuskv_observe_decision(self, decision):
            raise RuntimeError("observer bug")

    pm = PluginManager(entry_points=False)
    pm.register(Loud(), "loud")
    pm.observe_decision({"decision_id": "x"})  # must not raise
    assert pm.problems == []
