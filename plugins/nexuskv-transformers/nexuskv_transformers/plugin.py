"""The plugin's hooks: the `transformers` connector (`factory.py`), `calibrate` and `engine-demo` (`commands.py`)."""

from __future__ import annotations

import click

from nexuskv import hookimpl
from nexuskv_transformers.commands import calibrate_command, engine_demo_command
from nexuskv_transformers.factory import connector


@hookimpl
def nexuskv_register_connectors(register) -> None:  # type: ignore[no-untyped-def]
    """Offer the reference engine as `transformers`: `factory(kernel, model="dense", size="test", **options)`."""
    register("transformers", connector)


@hookimpl
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add `calibrate` and `engine-demo`."""
    cli.add_command(calibrate_command)
    cli.add_command(engine_demo_command)
