"""`nexuskv vllm-identity`: the identity a vLLM model directory gets in NexusKV keys."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import click

__all__ = ["identity_command"]


@click.command("vllm-identity")
@click.argument("model", type=click.Path(exists=True, file_okay=False))
@click.option("--dtype", default="bfloat16", show_default=True, help="dtype vLLM runs the model in.")
@click.option("--block-size", default=128, show_default=True, help="vLLM's KV block size (CPU: 128).")
@click.option("--kv-cache-dtype", default="auto", show_default=True)
@click.option("--quantization", default=None)
def identity_command(model: str, dtype: str, block_size: int, kv_cache_dtype: str, quantization: str | None) -> None:
    """Print the model, tokenizer and layout identity the vLLM connector derives for MODEL (a local directory)."""
    from nexuskv_vllm.identity import EngineIdentity

    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    ident = EngineIdentity.build(model=model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                 layers=int(cfg["num_hidden_layers"]),
                                 kv_heads=int(cfg.get("num_key_value_heads") or heads),
                                 head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                                 block_size=block_size)  # fmt: skip
    click.echo(json.dumps(attrs.asdict(ident), indent=2, default=str))
