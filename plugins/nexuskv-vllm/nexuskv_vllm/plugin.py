"""The plugin's hook: it adds `nexuskv vllm-identity` and `nexuskv pd-proxy` (`commands.py`)."""

from __future__ import annotations

import click

from nexuskv import hookimpl
from nexuskv_vllm.commands import identity_command, pd_proxy_command


@hookimpl
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add `nexuskv vllm-identity` and `nexuskv pd-proxy`."""
    cli.add_command(identity_command)
    cli.add_command(pd_proxy_command)
