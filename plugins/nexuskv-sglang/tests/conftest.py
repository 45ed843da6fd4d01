"""SGLang's real classes on the CPU: its device and host KV pools, its storage config and factory, its file backend."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from nexuskv import Kernel, KernelConfig

PAGE = 4
SECRET = bytes(range(32))


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)


def mha_host(layout: str = "page_first") -> MHATokenToKVPoolHost:
    """A real MHA host pool on the CPU: 2 layers, 2 heads of 8, pages of 4 tokens, bfloat16."""
    dev = MHATokenToKVPool(64, PAGE, torch.bfloat16, 2, 8, 2, "cpu", False, start_layer=0, end_layer=1)
    info = dev.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev.size, start_layer=0, end_layer=1,
                                write_back_staging=dev.hicache_write_back_staging)  # fmt: skip


def mla_host() -> MLATokenToKVPoolHost:
    """A real MLA host pool on the CPU: 2 layers, latent 16 + rope 8, pages of 4 tokens."""
    dev = MLATokenToKVPool(64, PAGE, torch.bfloat16, 16, 8, 2, "cpu", False, start_layer=0, end_layer=1)
    info = dev.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, "page_first", pin_memory=False, device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=1, target_layer_num=2)  # fmt: skip


def storage_config(extra: dict | None = None, *, model: str = "tiny/model", mla: bool = False, tp_rank: int = 0,
                   tp_size: int = 1) -> HiCacheStorageConfig:  # fmt: skip
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model,
                                extra_config={"tenant": "chat", **(extra or {})})  # fmt: skip


def fill(host, pages: range, seed: int = 0) -> None:
    """Random page contents at host pages `pages` (page i = host indices [i * PAGE, (i + 1) * PAGE))."""
    g = torch.Generator().manual_seed(seed)
    for i in pages:
        flat = host.get_dummy_flat_data_page()
        host.set_from_flat_data_page(i * PAGE, torch.randn(flat.shape, generator=g).to(flat.dtype))


def page_bytes(host, i: int) -> bytes:
    return host.get_data_page(i * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def indices(pages: range) -> torch.Tensor:
    return torch.cat([torch.arange(i * PAGE, (i + 1) * PAGE, dtype=torch.int64) for i in pages])


@pytest.fixture
def policies(tmp_path) -> Path:
    """The shipped policies, plus a tenant whose policy refuses every reuse."""
    root = Path(__file__).resolve().parents[3] / "policies"
    out = tmp_path / "policies"
    (out / "tenants").mkdir(parents=True)
    (out / "default.toml").write_text((root / "default.toml").read_text())
    (out / "tenants" / "blocked.toml").write_text(
        'name = "blocked"\n\n[[reuse]]\nname = "never"\nwhen = "true"\nmessage = "this tenant never reuses"\n')
    return out


@pytest.fixture
def kernel(policies):
    # deadline_ms: a plan's budget floor of 50 ms, so a loaded test machine does not fail plans open (the default
    # 0.5 ms is what a scheduler wants; these tests check answers, not plan speed)
    cfg = KernelConfig(node="n1", page_size=PAGE, policies=str(policies), deadline_ms=50.0,
                       tiers={"dram": {"store": "dram", "capacity_bytes": "64MiB"}})  # fmt: skip
    k = Kernel(cfg, secret=SECRET)
    yield k
    k.close()


@pytest.fixture
def kernel_toml(tmp_path, policies) -> Path:
    path = tmp_path / "kernel.toml"
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    path.write_text(f'node = "n1"\npage_size = {PAGE}\npolicies = "{policies}"\nsecret_file = "{secret}"\n'
                    'deadline_ms = 50.0\n\n'
                    '[tiers.dram]\nstore = "dram"\ncapacity_bytes = "64MiB"\n')
    return path


def mamba_host():
    """A real Mamba host pool on the CPU: 2 layers of recurrent state (temporal 4x8 + conv 3x8), one checkpoint per
    page."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(2, 17, 4, 8), conv=(torch.zeros(2, 17, 3, 8),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=16, pin_memory=False, layout="page_first")
