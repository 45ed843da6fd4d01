"""The plugin's hooks: the kernel picks the native keyer and matcher when installed, the reference on request."""

import json
from pathlib import Path

from click.testing import CliRunner

from nexuskv import BlockKeyer, DictIndex, Kernel, KernelConfig, PluginManager
from nexuskv.cli import cli
from nexuskv_native import NativeIndex, NativeKeyer
from nexuskv_native.plugin import nexuskv_keyer, nexuskv_matcher

SECRET = b"k" * 32


def test_hooks_answer_unless_another_name_is_configured():
    assert isinstance(nexuskv_keyer(SECRET, 16, {}), NativeKeyer)
    assert isinstance(nexuskv_keyer(SECRET, 16, {"name": "native"}), NativeKeyer)
    assert nexuskv_keyer(SECRET, 16, {"name": "python"}) is None
    assert isinstance(nexuskv_matcher({}), NativeIndex)
    assert nexuskv_matcher({"name": "dict"}) is None


def test_the_kernel_picks_native_by_default_and_the_reference_when_configured():
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as k:
        assert type(k.keyer) is NativeKeyer and type(k.index) is NativeIndex
        assert k.reads._inline_matcher  # bounded C: no watchdog thread per plan
    cfg = KernelConfig(node="n1", keyer={"name": "python"}, matcher={"name": "dict"})
    with Kernel(cfg, secret=SECRET) as k:
        assert type(k.keyer) is BlockKeyer and type(k.index) is DictIndex


def test_native_and_reference_kernels_plan_and_load_the_same():
    from tests.conftest import make_request

    policies = str(Path(__file__).resolve().parents[3] / "policies")
    req = make_request(range(1000), tenant="chat")
    seen = []
    for keyer, matcher in (("native", "native"), ("python", "dict")):
        cfg = KernelConfig(node="n1", policies=policies, keyer={"name": keyer}, matcher={"name": matcher})
        with Kernel(cfg, secret=SECRET) as k:
            keys = k.keys(req)
            k.commit(req, [bytes([b % 256]) * 4096 for b in range(len(keys))], keys=keys)
            assert k.flush(5)
            plan = k.plan(req)
            got = k.materialize(plan, req)
            seen.append((keys, plan.action, plan.tokens_reused, got.complete, len(got.states)))
    assert seen[0] == seen[1] and seen[0][2] == 992


def test_plugins_command_shows_the_active_keyer_and_matcher():
    out = CliRunner().invoke(cli, ["plugins", "--json"])
    active = json.loads(out.output)["active"]
    assert active == {"keyer": "NativeKeyer (nexuskv_native.keyer)", "matcher": "NativeIndex (nexuskv_native.index)"}
    assert "native" in {i.name for i in PluginManager().info()}
