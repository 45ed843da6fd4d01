"""The plugin's hook: it adds `nexuskv simulate` and `nexuskv gen-trace` (`commands.py`)."""

from __future__ import annotations

import click

from nexuskv import hookimpl
from nexuskv_sim.commands import gen_trace_command, simulate_command


@hookimpl
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add `nexuskv simulate` and `nexuskv gen-trace`."""
    cli.add_command(simulate_command)
    cli.add_command(gen_trace_command)
