"""The plugin's hook: it adds `nexuskv serve` and `nexuskv serve-token` (`commands.py`)."""

from __future__ import annotations

import click

from nexuskv import hookimpl
from nexuskv_sidecar.commands import serve, serve_token


@hookimpl
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add `serve` and `serve-token`."""
    cli.add_command(serve)
    cli.add_command(serve_token)
