"""The plugin's hook: it adds `nexuskv sglang-args` (`commands.py`). SGLang loads the backend itself (`backend.py`)."""

from __future__ import annotations

import click

from nexuskv import hookimpl
from nexuskv_sglang.commands import sglang_args_command


@hookimpl
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add `nexuskv sglang-args`."""
    cli.add_command(sglang_args_command)
