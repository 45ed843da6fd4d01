"""The plugin's hook: it adds `nexuskv kv-events` (`commands.py`; zmq is imported only when it runs)."""

from __future__ import annotations

import click

from nexuskv import hookimpl
from nexuskv_vllm_events.commands import kv_events_command


@hookimpl
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add `nexuskv kv-events`."""
    cli.add_command(kv_events_command)
