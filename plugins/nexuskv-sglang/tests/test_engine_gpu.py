"""SGLang's engine with NexusKV as its HiCache L3: a prompt's pages written back, the caches above flushed, the same
prompt served from NexusKV with the same greedy tokens. Runs only where SGLang's engine runs (a CUDA GPU).

Why not on the CPU, exactly: SGLang's model layers import `sgl_kernel`, and the wheel SGLang 0.5.23 pins
(`sglang-kernel` 0.4.10) is a CUDA build: `sgl_kernel/load_utils.py::_load_architecture_specific_ops` raises
`ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library!` because `common_ops.abi3.so` links
`libcuda.so.1`, the NVIDIA driver's library. SGLang's CPU backend needs a CPU build of sgl-kernel (for Intel AMX),
which is not published for this version. Everything below the engine (the storage interface, the host pools, the
factory, the file backend) runs on the CPU in the other tests of this folder.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

PAGE = 16


def _why_not() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return ("SGLang's engine needs a CUDA GPU: sgl_kernel/load_utils.py::_load_architecture_specific_ops raises "
                "ImportError (common_ops.abi3.so links libcuda.so.1) and no CUDA device is visible")  # fmt: skip
    try:
        import sgl_kernel  # noqa: F401
    except ImportError as e:
        return f"sgl_kernel does not load here: {str(e).strip().splitlines()[0]}"
    return None


WHY_NOT = _why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def tiny_llama(path: Path) -> Path:
    """A random-weight Llama built from a config (SGLang's `dummy` load format fills the weights)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         torch_dtype="bfloat16")  # fmt: skip
    config.save_pretrained(path)
    return path


def test_a_prompt_is_served_again_from_nexuskv_with_the_same_tokens(tmp_path):
    import sglang as sgl

    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    policies = Path(__file__).resolve().parents[3] / "policies"
    decisions = tmp_path / "decisions.jsonl"
    toml = tmp_path / "kernel.toml"
    toml.write_text(f'node = "gpu-0"\npage_size = {PAGE}\npolicies = "{policies}"\nsecret_file = "{secret}"\n'
                    f'decision_file = "{decisions}"\n\n'
                    '[tiers.dram]\nstore = "dram"\ncapacity_bytes = "1GiB"\n')  # fmt: skip
    extra = {"backend_name": "nexuskv", "module_path": "nexuskv_sglang.backend", "class_name": "NexusKVStorage",
             "nexuskv_config": str(toml), "tenant": "chat", "interface_v1": 1}  # fmt: skip
    engine = sgl.Engine(model_path=str(tiny_llama(tmp_path / "model")), load_format="dummy", skip_tokenizer_init=True,
                        page_size=PAGE, mem_fraction_static=0.2, disable_cuda_graph=True,
                        enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_write_policy="write_through",
                        hicache_storage_backend="dynamic", hicache_storage_prefetch_policy="wait_complete",
                        hicache_storage_backend_extra_config=json.dumps(extra))  # fmt: skip
    try:
        prompt = [(7 * i + 3) % 2000 + 1 for i in range(32 * PAGE)]
        params = {"max_new_tokens": 8, "temperature": 0.0}
        first = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        time.sleep(5)  # the write-back to L3 runs behind the request
        assert engine.flush_cache().success  # GPU and host caches emptied: only NexusKV holds the prompt now
        again = engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        assert again == first
    finally:
        engine.shutdown()
    records = [json.loads(line) for line in decisions.read_text().splitlines()]
    reused = [r for r in records if r.get("action") == "materialize" and r.get("tokens_reused", 0) >= 16 * PAGE]
    assert reused, [r.get("reasons") for r in records[-5:]]
