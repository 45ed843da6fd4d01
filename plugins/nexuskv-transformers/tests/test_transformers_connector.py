"""The connector's modes and fallbacks, the workload and the plugin's hooks."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import SECRET, connector, model, tokens
from nexuskv import Kernel, KernelConfig, PlanAction, PluginManager
from nexuskv_transformers.connector import TransformersConnector
from nexuskv_transformers.workload import PHASES, demo_workload


def test_never_mode_prefills_everything_and_stores_nothing(kernel):
    c = connector(kernel, model("dense"), mode="never")
    ids = tokens(80)
    for _ in range(2):
        out = c.run(c.request(ids, tenant="t"))
        assert out.plan is None and out.tokens_reused == 0 and out.committed == 0
    assert kernel.flush(5) and len(kernel.index) == 0


def test_always_mode_reuses_what_nexuskv_would_refuse():
    """With a link so slow that reuse loses, NexusKV recomputes and always-reuse loads anyway."""
    cfg = KernelConfig(node="n1", tiers={"dram": {"store": "shaped-link", "capacity_bytes": "64MiB",
                                                  "bandwidth_bytes_per_s": 1e5, "latency_ms": 0.0}},
                       load_timeout_ms=30_000)  # fmt: skip
    with Kernel(cfg, secret=SECRET) as k:
        ref = model("dense")
        ids = tokens(100)
        nexus = connector(k, ref)
        nexus.run(nexus.request(ids, tenant="t"))
        assert k.flush(5)
        k.cost.profile.tiers["dram"] = k.cost.profile.tiers["dram"].__class__(bandwidth_bytes_per_s=1e5)
        planned = nexus.run(nexus.request(ids, tenant="t"))
        assert planned.tokens_reused == 0 and "lose" in " ".join(planned.plan.reasons)
        always = connector(k, ref, mode="always", commit=False)
        got = always.run(always.request(ids, tenant="t"))
        assert got.tokens_reused == 96 and got.plan.action == PlanAction.MATERIALIZE
        assert got.ttft_s > 96 * 512 / 1e5 * 0.9  # it really waited for the slow link (bytes / bandwidth)


def test_missing_block_falls_back_to_the_last_good_one(kernel):
    ref = model("dense")
    ids = tokens(100)
    c = connector(kernel, ref)
    c.run(c.request(ids, tenant="t"))
    assert kernel.flush(5)
    req = c.request(ids, tenant="t")
    from nexuskv import slot_of

    kernel.tiers["dram"].delete(slot_of(kernel.keys(req)[3]))  # lost behind the index's back
    out = c.run(req, all_logits=True)
    assert out.tokens_reused == 48 and out.fallback.startswith("partial")
    full = c.engine.prefill(ids, all_logits=True).logits[48:]
    assert (out.logits - full).abs().max() <= 1e-5


def test_checkpointed_kinds_recompute_when_the_checkpoint_is_missing(kernel):
    ref = model("recurrent")
    ids = tokens(100)
    c = connector(kernel, ref, checkpoint_every=1)
    c.run(c.request(ids, tenant="t"))
    assert kernel.flush(5)
    req = c.request(ids, tenant="t")
    from nexuskv import slot_of

    kernel.tiers["dram"].delete(slot_of(kernel.keys(req)[5]))  # the checkpoint the plan picks
    out = c.run(req)
    assert out.tokens_reused == 0 and "recompute" in out.fallback


def test_commit_records_tensor_specs(kernel):
    ref = model("hybrid")
    c = connector(kernel, ref, checkpoint_every=2)
    out = c.run(c.request(tokens(70), tenant="t"))
    assert kernel.flush(5)
    # 4 full blocks of the dense group, checkpoints of the windowed group at 32, 64 (and 64 = last full block)
    assert out.committed == 4 + 2
    key = kernel.keys(c.request(tokens(70), tenant="t"))[1]
    desc = kernel.load(key, 1).descriptor
    assert [t.name for t in desc.tensors] == ["L0.k", "L0.v"] and desc.span.end == 32


def test_connector_checks_its_arguments(kernel):
    with pytest.raises(ValueError, match="unknown mode"):
        TransformersConnector(kernel, model("dense"), mode="sometimes")
    from nexuskv_transformers.models import build_model

    with pytest.raises(ValueError, match="page size"):
        TransformersConnector(kernel, build_model("dense", page_size=32))
    with pytest.raises(ValueError, match="unknown model kind"):
        build_model("diffusion")


def test_workload_is_deterministic_and_covers_every_phase():
    a, b = demo_workload(seed=3), demo_workload(seed=3)
    assert a == b and demo_workload(seed=4) != a
    assert {i.phase for i in a} == set(PHASES)
    chat = [i for i in a if i.session == "chat-0"]
    assert all(chat[n].tokens[: len(chat[n - 1].tokens)] == chat[n - 1].tokens for n in range(1, len(chat)))


def test_plugin_registers_connector_and_commands():
    pm = PluginManager({})
    assert "transformers" in pm.connectors()
    from nexuskv.cli import with_plugin_commands

    runner = CliRunner()
    for cmd in ("calibrate", "engine-demo"):
        res = runner.invoke(with_plugin_commands(), [cmd, "--help"])
        assert res.exit_code == 0, res.output
    with Kernel(KernelConfig(node="n1"), secret=SECRET) as k:
        conn = pm.connectors()["transformers"](k, model="latent")
        assert conn.ref.kind == "latent"
