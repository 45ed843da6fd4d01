"""`nexuskv vllm-identity` (the identity a vLLM model directory gets in NexusKV keys) and `nexuskv pd-proxy`."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import click

__all__ = ["identity_command", "pd_proxy_command"]


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


def _engines(specs: tuple[str, ...], role: str) -> list:
    from nexuskv_vllm.pd_proxy import Engine

    out = []
    for spec in specs:
        node, sep, url = spec.partition("=")
        if not sep or not node or not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{spec!r}: expected NODE=http://HOST:PORT", param_hint=f"--{role}")
        out.append(Engine(node, url.rstrip("/")))
    return out


@click.command("pd-proxy")
@click.option("--prefill", "prefill", multiple=True, required=True, metavar="NODE=URL",
              help="A prefill engine (kv_producer): its kernel's node name and its URL. Repeatable.")
@click.option("--decode", "decode", multiple=True, required=True, metavar="NODE=URL",
              help="A decode engine (kv_consumer): its kernel's node name and its URL. Repeatable.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8100, show_default=True, type=int)
@click.option("--config", "config", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A kernel config for routing (its page_size must be the engines' block size).")
@click.option("--prefill-timeout-s", default=60.0, show_default=True, help="Longest wait for a prefill answer.")
@click.option("--cooldown-s", default=5.0, show_default=True, help="How long a failed engine is left out.")
def pd_proxy_command(prefill: tuple[str, ...], decode: tuple[str, ...], host: str, port: int, config: str | None,
                     prefill_timeout_s: float, cooldown_s: float) -> None:  # fmt: skip
    """Serve an OpenAI-compatible P/D proxy in front of prefill and decode `vllm serve` engines (docs/pd.md)."""
    import uvicorn

    from nexuskv import Kernel
    from nexuskv_vllm.pd_proxy import PDProxy

    proxy = PDProxy(_engines(prefill, "prefill"), _engines(decode, "decode"),
                    kernel=Kernel.from_config(config) if config else None, prefill_timeout_s=prefill_timeout_s,
                    cooldown_s=cooldown_s)  # fmt: skip
    uvicorn.run(proxy.app, host=host, port=port, log_level="warning")
