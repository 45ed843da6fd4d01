"""The plugin's hook: it adds `nexuskv vllm-identity` (`commands.py`)."""

from __future__ import annotations

import click

from nexuskv import hookimpl
from nexuskv_vllm.commands import identity_command


@hookimpl
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add `nexuskv vllm-identity`."""
    cli.add_command(identity_command)
