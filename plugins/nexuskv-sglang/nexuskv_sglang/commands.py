"""`nexuskv sglang-args`: the SGLang server flags that load NexusKV as its HiCache storage backend."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click

__all__ = ["sglang_args_command"]


def sglang_args(config: str, tenant: str, *, v1: bool = True) -> list[str]:
    """The `sglang.launch_server` arguments for a kernel config file and a tenant."""
    extra = {"backend_name": "nexuskv", "module_path": "nexuskv_sglang.backend", "class_name": "NexusKVStorage",
             "nexuskv_config": str(Path(config).resolve()), "tenant": tenant}  # fmt: skip
    if v1:
        extra["interface_v1"] = 1
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra, separators=(",", ":"))]  # fmt: skip


@click.command("sglang-args")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--tenant", required=True, help="The tenant every page of this SGLang server belongs to.")
@click.option("--v1/--legacy", default=True, show_default=True,
              help="SGLang's host-pool interface (batch_get_v1 / batch_set_v1), or its legacy one.")  # fmt: skip
def sglang_args_command(config: str, tenant: str, v1: bool) -> None:
    """Print the SGLang flags that use NexusKV (kernel CONFIG) as the HiCache L3 storage backend."""
    click.echo(shlex.join(sglang_args(config, tenant, v1=v1)))
