"""Fixtures of the vLLM connector's tests: a tiny Llama, LoRA adapters, a kernel config on a disk tier, and one
vLLM engine with the connector for the whole session (vLLM allows one engine per process; runs that need another
engine, such as the reference without a connector or a restart, are subprocesses of `nexuskv_vllm._run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM connector's tests run in .venv-vllm: make test-vllm")

from nexuskv_vllm.testing import Engine, connector_config, write_lora, write_tiny_llama

os.environ["NEXUSKV_DEADLINE_MS"] = "10000"  # tests assert decisions, not timing (set before any kernel starts)

DEFAULT_POLICY = """
name = "default"
failure = "deny"
min_gain_ms = 0.0
default_tier = "disk"

[[place]]
name = "everything-on-disk"
tier = "disk"
ttl = "1h"
"""

DENIED_POLICY = """
name = "denied"
extends = "default"

[[reuse]]
name = "never-reuse"
description = "This tenant's requests always recompute."
when = "true"
message = "tenant policy: no reuse"
"""


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def model_dir(workdir) -> Path:
    return write_tiny_llama(workdir / "model", seed=0)


@pytest.fixture(scope="session")
def loras(workdir, model_dir) -> dict[str, str]:
    return {name: str(write_lora(workdir / name, model_dir, seed=i + 1)) for i, name in enumerate(("lora-a", "lora-b"))}


@pytest.fixture(scope="session")
def kernel_toml(workdir) -> Path:
    policies = workdir / "policies"
    (policies / "tenants").mkdir(parents=True)
    (policies / "default.toml").write_text(DEFAULT_POLICY)
    (policies / "tenants" / "denied.toml").write_text(DENIED_POLICY)
    (workdir / "secret").write_text("ab" * 32)
    path = workdir / "kernel.toml"
    path.write_text(f"""
node = "n1"
page_size = 128
policies = "{policies}"
secret_file = "{workdir / 'secret'}"
load_timeout_ms = 1500.0

[tiers.disk]
store = "disk"
path = "{workdir / 'disk'}"
capacity_bytes = "1GiB"
""")
    return path


@pytest.fixture(scope="session")
def engine(model_dir, kernel_toml) -> Engine:
    return Engine(model_dir, kv_transfer_config=connector_config(kernel_toml, tenant="t1"), enable_lora=True)


@pytest.fixture
def side(model_dir):
    """A `SchedulerSide` for the tiny model (128-token blocks) over a DRAM-only kernel of its own, no engine."""
    from nexuskv_vllm.identity import EngineIdentity
    from nexuskv_vllm.scheduler import SchedulerSide

    from nexuskv import Kernel, KernelConfig

    ident = EngineIdentity.build(model=str(model_dir), dtype="float32", layers=2, kv_heads=2, head_dim=32,
                                 block_size=128)  # fmt: skip
    with Kernel(KernelConfig(node="n1", page_size=128), secret=bytes(range(32))) as k:
        yield SchedulerSide(k, ident)


def run_engine(workdir: Path, spec: dict) -> dict:
    """Run `spec` on a fresh engine in a subprocess (see `nexuskv_vllm._run`); returns its JSON result."""
    n = len(list(workdir.glob("spec-*.json")))
    spec_path, out_path = workdir / f"spec-{n}.json", workdir / f"out-{n}.json"
    spec_path.write_text(json.dumps(spec))
    env = os.environ | {"NEXUSKV_DEADLINE_MS": "10000"}
    proc = subprocess.run([sys.executable, "-m", "nexuskv_vllm._run", str(spec_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_path.read_text())


def vllm_request(rid: str, tokens: list[int], tenant: str | None):
    """A real vLLM scheduler `Request` for `tokens`, its tenant in `kv_transfer_params`."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": {"tenant": tenant}} if tenant else None
    return Request(rid, list(tokens), SamplingParams(max_tokens=512, extra_args=extra), None)


def prom_counters(base_url: str, prefix: str = "vllm:nexuskv_") -> dict[str, float]:
    """A `vllm serve`'s `/metrics` counters named `<prefix><name>_total`, summed over labels, by name."""
    import re

    from nexuskv_vllm.pd_testing import metric_totals

    return metric_totals(base_url, rf"^{re.escape(prefix)}(\w+)_total\{{[^}}]*\}} ([0-9.e+]+)$")
